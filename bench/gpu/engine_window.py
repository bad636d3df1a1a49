#!/usr/bin/env python3
"""Sliding-window blocks freed on CUDA: greedy completions through `kiln serve`
(the engine: chunked prefill, one block table per layer group, blocks behind the
window freed, batched decode) against `kiln generate` (every block kept, one
sequence) on the same checkpoint and device, for prompts past the window, one
request at a time: the same kernels and shapes, so the texts must be identical
unless a kernel reads a freed block (another position's keys). Then the four at
once (batched products and attention: bf16 sums in another order, so a random
model's near-ties may flip; reported as the common prefix).

    python3 bench/gpu/engine_window.py --kiln .device/kiln --ckpt DIR --out engine-window.json
"""
import argparse, json, subprocess, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor


def post(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--port", type=int, default=18181)
    args = ap.parse_args()
    words = "harbour ledger courier crates warehouse tide lantern rope anchor gull".split()
    # Four prompts of about 700-1000 tokens (past a 512-token window).
    prompts = [
        " ".join(words[(i * 7 + k) % len(words)] for i in range(300 + 80 * k)) for k in range(4)
    ]
    alone = []
    for p in prompts:
        r = subprocess.run(
            [args.kiln, "generate", "-m", args.ckpt, "--device", args.device, "-p", p, "--json",
             "--temperature", "0", "--max-tokens", str(args.max_tokens)],
            capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"kiln generate failed: {r.stderr[-2000:]}")
        alone.append(json.loads(r.stdout))
    server = subprocess.Popen(
        [args.kiln, "serve", args.ckpt, "--device", args.device, "--port", str(args.port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2) as h:
                    if json.load(h).get("status") == "ok":
                        break
            except Exception:
                pass
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models", timeout=10) as r:
            name = json.load(r)["data"][0]["id"]
        body = lambda p: {"model": name, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0}
        served = [post(args.port, body(p)) for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            batched = list(pool.map(lambda p: post(args.port, body(p)), prompts))
    finally:
        server.terminate()
        server.wait(timeout=30)
    cases = []
    for a, s, b in zip(alone, served, batched):
        text, btext = s["choices"][0]["text"], b["choices"][0]["text"]
        common = next((i for i, (x, y) in enumerate(zip(a["text"], btext)) if x != y),
                      min(len(a["text"]), len(btext)))
        cases.append({
            "prompt_tokens": s["usage"]["prompt_tokens"],
            "cached_tokens_batched": (b["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
            "generate_text": a["text"],
            "serve_text": text,
            "identical": a["text"] == text,
            "batched_common_prefix_chars": common,
            "batched_text_chars": len(btext),
        })
    out = {"device": args.device, "ckpt": args.ckpt, "cases": cases,
           "all_identical": all(c["identical"] for c in cases)}
    json.dump(out, open(args.out, "w"), indent=1)
    print(json.dumps({"all_identical": out["all_identical"],
                      "prompt_tokens": [c["prompt_tokens"] for c in cases]}))


if __name__ == "__main__":
    main()
