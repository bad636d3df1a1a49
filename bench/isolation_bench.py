#!/usr/bin/env python3
"""What running the engine in its own process costs: `kiln serve --isolation process` against
`--isolation thread` on the same model, batch 1 (one client, closed loop), through
bench/serve_bench.py — decode tok/s (1000 / median TPOT) and median TTFT — the two modes
alternated over --rounds, each on a fresh server.

    python3 bench/isolation_bench.py --kiln target/release/kiln --model MODEL [--device cpu] \\
        [--input-len 512 --output-len 128 --rounds 3] --out result.json

Standard library only (and bench/serve_bench.py beside it).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def start(kiln, model, device, isolation, extra):
    cmd = [kiln, "serve", model, "--device", device, "--port", "0", "--isolation", isolation,
           "--throughput-log-secs", "0"] + extra
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    addr = None
    for line in proc.stderr:
        m = re.search(r" on http://(\S+)", line)
        if m:
            addr = m.group(1)
        if line.rstrip().endswith("; ready"):
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    if addr is None:
        proc.kill()
        sys.exit(f"kiln serve --isolation {isolation} did not start")
    return proc, addr


def measure(args, isolation):
    proc, addr = start(args.kiln, args.model, args.device, isolation, args.serve_arg)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(
                [sys.executable, os.path.join(HERE, "serve_bench.py"), "--base-url", f"http://{addr}",
                 "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                 "--concurrency", "1", "--prompts-per-client", str(args.prompts), "--vocab", str(args.vocab),
                 "--warmup", "2", "--label", isolation, "--out", out.name],
                check=True, stdout=subprocess.DEVNULL)
            level = json.load(open(out.name))["levels"][0]
    finally:
        proc.kill()
        proc.wait()
    return {"decode_tok_s": 1000.0 / level["median_tpot_ms"], "ttft_ms": level["median_ttft_ms"],
            "failed": level["failed"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-arg", action="append", default=[], help="more `kiln serve` flags")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = {"thread": [], "process": []}
    for r in range(args.rounds):
        for mode in ("thread", "process") if r % 2 == 0 else ("process", "thread"):
            m = measure(args, mode)
            runs[mode].append(m)
            print(f"round {r} {mode}: decode {m['decode_tok_s']:.1f} tok/s, TTFT {m['ttft_ms']:.1f} ms", flush=True)
    med = {k: {"decode_tok_s": statistics.median(x["decode_tok_s"] for x in v),
               "ttft_ms": statistics.median(x["ttft_ms"] for x in v)} for k, v in runs.items()}
    result = {
        "what": "kiln serve --isolation process vs thread, batch 1 through bench/serve_bench.py "
                f"(random ids, {args.input_len} in, {args.output_len} out, ignore_eos), modes alternated, "
                "median of rounds",
        "model": args.model, "device": args.device, "runs": runs, "median": med,
        "decode_ratio_process_vs_thread": med["process"]["decode_tok_s"] / med["thread"]["decode_tok_s"],
        "ttft_delta_ms_process_minus_thread": med["process"]["ttft_ms"] - med["thread"]["ttft_ms"],
    }
    print(json.dumps({k: result[k] for k in ("median", "decode_ratio_process_vs_thread",
                                             "ttft_delta_ms_process_minus_thread")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
