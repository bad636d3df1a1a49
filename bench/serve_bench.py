#!/usr/bin/env python3
"""A serving benchmark in the manner of `vllm bench serve`, for any OpenAI-compatible server
(`kiln serve`, llama.cpp's `llama-server`, vLLM): streaming `POST /v1/completions` requests
whose prompts are token ids (so every server sees exactly the same tokens), a fixed number of
output tokens with the end of sequence ignored (`ignore_eos`, which Kiln, vLLM and
llama-server all take), and per-level metrics under vLLM's JSON field names:

    completed, failed, total_input_tokens, total_output_tokens, duration,
    request_throughput, output_throughput, total_token_throughput,
    {mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms, max_concurrency, request_rate

TTFT is from sending a request to its first streamed token, ITL the gaps between streamed
chunks, TPOT a request's (latency - TTFT) / (output tokens - 1), E2EL its whole latency.
Output and input token counts come from the server's `usage` (`stream_options.include_usage`)
and are checked against what was asked.

Loads, one level each:
  --concurrency 1,4,16,64   closed loop: that many clients, each sending its next request when
                            the last one ends (--prompts-per-client requests each, default 4)
  --request-rate 2,8,inf    open loop: Poisson arrivals at that many requests a second (inf:
                            all at once), --num-prompts requests (default 32), optionally capped
                            by --max-concurrency
  --sweep inferencex        the InferenceX grid: input/output 1k/1k, 1k/8k, 8k/1k, each at
                            concurrency 1, 2, 4, ..., 64 (--max-level lowers the top)
Prompts (--dataset): `random` (--input-len ids uniform over the vocabulary's ordinary ids,
--output-len out) or `sharegpt-like` (lengths drawn from log-normal distributions with
ShareGPT's medians, about 128 prompt and 160 output tokens, clipped to 4..1024: ShareGPT itself
is not reachable from this project's machines, so the prompts are still random ids).

    python3 bench/serve_bench.py --base-url http://127.0.0.1:8080 --model M \\
        --input-len 512 --output-len 256 --concurrency 1,4,16,64 --label kiln --out kiln.json
    python3 bench/serve_bench.py ... --sweep inferencex --out sweep.json --plot sweep.png

The JSON: {"label", "base_url", "model", "dataset", "levels": [metrics..]}; --plot draws
throughput per GPU (output tok/s) against interactivity (tok/s per user, 1000 / median TPOT)
for each input/output pair, as InferenceX draws it (needs matplotlib). Standard library only.
"""
import argparse
import http.client
import json
import math
import random
import statistics
import sys
import threading
import time
import urllib.parse

INFERENCEX = [(1024, 1024), (1024, 8192), (8192, 1024)]


def percentile(xs, q):
    """The q-th percentile (linear between closest ranks, as numpy's default)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def prompts(dataset, n, input_len, output_len, vocab, seed):
    """n (token ids, output tokens) pairs."""
    rng = random.Random(seed)
    # Ordinary ids: clear of the special tokens tokenizers put at either end.
    lo, hi = min(100, vocab // 4), max(vocab - 100, vocab * 3 // 4)
    out = []
    for _ in range(n):
        if dataset == "sharegpt-like":
            i = int(min(1024, max(4, rng.lognormvariate(math.log(128), 0.9))))
            o = int(min(1024, max(4, rng.lognormvariate(math.log(160), 0.8))))
        else:
            i, o = input_len, output_len
        out.append(([rng.randrange(lo, hi) for _ in range(i)], o))
    return out


class Target:
    def __init__(self, base_url, model, timeout):
        u = urllib.parse.urlsplit(base_url)
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.https = u.scheme == "https"
        self.prefix = u.path.rstrip("/")
        if self.prefix.endswith("/v1"):
            self.prefix = self.prefix[:-3]
        self.model, self.timeout = model, timeout

    def connect(self):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def one(self, ids, max_tokens):
        """Streams one completion; returns its record (times in seconds)."""
        body = {"prompt": ids, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        r = {"ok": False, "ttft": None, "itl": [], "latency": None, "input_tokens": len(ids),
             "asked_output": max_tokens, "output_tokens": 0, "chunks": 0, "error": None}
        conn = self.connect()
        t0 = time.perf_counter()
        try:
            conn.request("POST", self.prefix + "/v1/completions", json.dumps(body),
                         {"content-type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                r["error"] = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return r
            last, usage, done = None, None, False
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                # A token event is a chunk with text (the usage chunk has no choices, the
                # last choice chunk may carry only the finish reason).
                if not "".join(c.get("text") or "" for c in chunk.get("choices") or []):
                    continue
                now = time.perf_counter()
                if r["ttft"] is None:
                    r["ttft"] = now - t0
                else:
                    r["itl"].append(now - last)
                last = now
                r["chunks"] += 1
            r["latency"] = time.perf_counter() - t0
            if usage:
                r["output_tokens"] = usage.get("completion_tokens", 0)
                r["input_tokens"] = usage.get("prompt_tokens", len(ids))
            else:
                r["output_tokens"] = r["chunks"]
            r["ok"] = done and r["ttft"] is not None
            if not r["ok"]:
                r["error"] = "stream ended without [DONE]" if not done else "no token streamed"
        except Exception as e:  # a failed request is counted, not fatal
            r["error"] = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        return r


def metrics(records, duration, max_concurrency, request_rate):
    ok = [r for r in records if r["ok"]]
    ms = lambda xs: [1000.0 * x for x in xs]  # noqa: E731
    ttft = ms([r["ttft"] for r in ok])
    e2el = ms([r["latency"] for r in ok])
    tpot = ms([(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1])
    itl = ms([x for r in ok for x in r["itl"]])
    out_tok = sum(r["output_tokens"] for r in ok)
    in_tok = sum(r["input_tokens"] for r in ok)
    m = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "asked_output_tokens": sum(r["asked_output"] for r in ok),
        "duration": duration,
        "max_concurrency": max_concurrency,
        "request_rate": request_rate,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        m[f"mean_{name}_ms"] = statistics.fmean(xs) if xs else 0.0
        m[f"median_{name}_ms"] = statistics.median(xs) if xs else 0.0
        m[f"std_{name}_ms"] = statistics.pstdev(xs) if len(xs) > 1 else 0.0
        m[f"p99_{name}_ms"] = percentile(xs, 99)
    # InferenceX's axes: throughput per GPU, and interactivity (tok/s a user sees).
    m["interactivity_tok_s_per_user"] = 1000.0 / m["median_tpot_ms"] if m["median_tpot_ms"] > 0 else 0.0
    return m


def closed_loop(target, work, concurrency):
    """`concurrency` clients, each taking the next prompt when its last request ends."""
    records, lock, it = [], threading.Lock(), iter(work)

    def client():
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                return
            rec = target.one(*item)
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def open_loop(target, work, rate, max_concurrency, seed):
    """Requests sent at Poisson arrival times (`rate` a second; inf: all at once)."""
    rng = random.Random(seed + 1)
    records, lock = [], threading.Lock()
    gate = threading.Semaphore(max_concurrency) if max_concurrency else None

    def send(item):
        if gate:
            gate.acquire()
        try:
            rec = target.one(*item)
        finally:
            if gate:
                gate.release()
        with lock:
            records.append(rec)

    t0 = time.perf_counter()
    threads, at = [], 0.0
    for item in work:
        if math.isfinite(rate):
            at += rng.expovariate(rate)
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t = threading.Thread(target=send, args=(item,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def run(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--label", default="server")
    ap.add_argument("--dataset", choices=["random", "sharegpt-like"], default="random")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152, help="ids are drawn below this")
    ap.add_argument("--concurrency", default=None, help="closed-loop levels, e.g. 1,4,16,64")
    ap.add_argument("--prompts-per-client", type=int, default=4)
    ap.add_argument("--request-rate", default=None, help="open-loop levels, e.g. 2,8,inf")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=0)
    ap.add_argument("--sweep", choices=["inferencex"], default=None)
    ap.add_argument("--max-level", type=int, default=64, help="the sweep's top concurrency")
    ap.add_argument("--warmup", type=int, default=1, help="requests before the first level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    target = Target(a.base_url, a.model, a.timeout)
    plan = []  # (input_len, output_len, kind, level)
    if a.sweep == "inferencex":
        levels = [c for c in (1, 2, 4, 8, 16, 32, 64) if c <= a.max_level]
        plan = [(i, o, "concurrency", c) for i, o in INFERENCEX for c in levels]
    else:
        for c in (a.concurrency.split(",") if a.concurrency else []):
            plan.append((a.input_len, a.output_len, "concurrency", int(c)))
        for r in (a.request_rate.split(",") if a.request_rate else []):
            plan.append((a.input_len, a.output_len, "rate", float(r)))
        if not plan:
            plan.append((a.input_len, a.output_len, "concurrency", 1))
    if a.warmup:
        for ids, o in prompts(a.dataset, a.warmup, min(a.input_len, 64), 4, a.vocab, a.seed + 99):
            target.one(ids, o)
    levels = []
    for n, (i, o, kind, level) in enumerate(plan):
        count = level * a.prompts_per_client if kind == "concurrency" else a.num_prompts
        work = prompts(a.dataset, count, i, o, a.vocab, a.seed + n)
        if kind == "concurrency":
            recs, dur = closed_loop(target, work, level)
            m = metrics(recs, dur, level, math.inf)
        else:
            recs, dur = open_loop(target, work, level, a.max_concurrency, a.seed + n)
            m = metrics(recs, dur, a.max_concurrency or None, level)
        m.update({"input_len": i if a.dataset == "random" else None,
                  "output_len": o if a.dataset == "random" else None})
        levels.append(m)
        lens = {"input_len": i, "output_len": o} if a.dataset == "random" else {"dataset": a.dataset}
        print(json.dumps({"label": a.label, **lens, kind: level,
                          "completed": m["completed"], "failed": m["failed"],
                          "output_throughput": round(m["output_throughput"], 1),
                          "median_ttft_ms": round(m["median_ttft_ms"], 1),
                          "median_tpot_ms": round(m["median_tpot_ms"], 2),
                          "p99_itl_ms": round(m["p99_itl_ms"], 2)}), flush=True)
    result = {"label": a.label, "base_url": a.base_url, "model": a.model, "dataset": a.dataset,
              "levels": levels}
    if a.out:
        with open(a.out, "w") as f:
            # inf is not JSON: the closed loop's request rate is written as null.
            json.dump(json.loads(json.dumps(result).replace("Infinity", "null")), f, indent=1)
    if a.plot:
        plot(result, a.plot)
    return result


def plot(result, path):
    """Throughput per GPU against interactivity, one line per input/output pair."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("serve_bench: matplotlib is missing; no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    pairs = {}
    for m in result["levels"]:
        pairs.setdefault((m["input_len"], m["output_len"]), []).append(m)
    for (i, o), ms in pairs.items():
        ms = sorted(ms, key=lambda m: m["max_concurrency"] or 0)
        ax.plot([m["interactivity_tok_s_per_user"] for m in ms], [m["output_throughput"] for m in ms],
                marker="o", label=f"{result['label']} {i}/{o}")
        for m in ms:
            ax.annotate(str(m["max_concurrency"]), (m["interactivity_tok_s_per_user"], m["output_throughput"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("interactivity (output tok/s per user)")
    ax.set_ylabel("throughput per GPU (output tok/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    r = run()
    sys.exit(1 if any(m["failed"] for m in r["levels"]) else 0)
