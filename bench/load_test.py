#!/usr/bin/env python3
"""Bounded load test of `kiln serve` on loopback: N concurrent streaming chat
clients with mixed prompt and output lengths. Checks that every stream is
well-formed (chunks parse, one finish_reason, ends with [DONE]), that there
are zero errors, and that /stats shows 0 running and 0 KV blocks used after;
reports p50/p99 time to first token and throughput as one JSON line.

    PYTHONPATH=$(scripts/install-sdks.sh) python3 bench/load_test.py BASE_URL [CLIENTS]

Needs httpx (installed with the SDKs). Sends traffic to BASE_URL only
(e.g. http://127.0.0.1:8080) and stops by itself.
"""
import asyncio, json, statistics, sys, time

import httpx

BASE = sys.argv[1].rstrip("/")
CLIENTS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
TOPICS = ["the sea", "a red fox", "prime numbers", "the moon", "bread", "rivers", "clocks", "music"]


MODEL = None


async def one(client, i):
    body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 8 + (i * 7) % 57,
            "messages": [{"role": "user", "content": ("Be brief. " * (i % 6)) + f"Tell me about {TOPICS[i % 8]}."}]}
    t0 = time.perf_counter()
    ttft, n_chunks, finish, done = None, 0, None, False
    async with client.stream("POST", BASE + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"status {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            for c in chunk.get("choices", []):
                if c["delta"].get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
                if c.get("finish_reason"):
                    if finish is not None:
                        return {"error": "two finish reasons"}
                    finish = c["finish_reason"]
                n_chunks += 1
    if not done or finish is None:
        return {"error": f"malformed stream (done={done}, finish={finish})"}
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "chunks": n_chunks,
            "total": time.perf_counter() - t0}


async def main():
    limits = httpx.Limits(max_connections=CLIENTS + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        models = (await client.get(BASE + "/v1/models")).json()
        global MODEL
        MODEL = models["data"][0]["id"]
        t0 = time.perf_counter()

        async def run(i):
            try:
                return await one(client, i)
            except Exception as e:
                return {"error": repr(e)}

        results = await asyncio.gather(*[run(i) for i in range(CLIENTS)])
        wall = time.perf_counter() - t0
        for _ in range(50):
            stats = (await client.get(BASE + "/stats")).json()
            sched = stats.get("scheduler", stats)
            if sched.get("num_running") == 0 and sched.get("num_blocks_used") == 0:
                break
            await asyncio.sleep(0.1)
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok)
    q = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else None
    report = {"clients": CLIENTS, "errors": len(errors), "error_samples": errors[:5], "wall_seconds": wall,
              "ttft_p50_seconds": q(0.5), "ttft_p99_seconds": q(0.99),
              "streamed_chunks_per_second": sum(r["chunks"] for r in ok) / wall,
              "running_after": sched.get("num_running"), "kv_blocks_used_after": sched.get("num_blocks_used"),
              # The server's own view (/stats latency, from its histograms): TTFT without the
              # load generator's scheduling delay.
              "server_latency": stats.get("latency")}
    print(json.dumps(report))
    sys.exit(0 if not errors and report["kv_blocks_used_after"] == 0 else 1)


asyncio.run(main())
