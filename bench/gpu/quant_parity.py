#!/usr/bin/env python3
"""Kiln CUDA against Kiln CPU on the same quantized GGUF (issue 18's oracle for
block weights on the device): for random token ids, the logits of every position
from `kiln dev logits` on the GPU — the first --prefill positions in one step, the
rest one token a step (the decode GEMV, recorded steps) — and on the CPU (f32 over
the same blocks), compared by log-softmax distance, cosine and argmax agreement.

    python3 bench/gpu/quant_parity.py --kiln .device/kiln --model Q.gguf --out parity.json
"""
import argparse, json, os, random, subprocess, tempfile, time

import numpy as np



from logit_compare import compare  # noqa: E402


def logits(kiln, model, device, ids, out, prefill=None, quantize=None):
    cmd = [kiln, "dev", "logits", "-m", model, "--device", device,
           "--ids", ",".join(map(str, ids)), "-o", out]
    if quantize:
        cmd += ["--quantize", quantize]
    if prefill:
        cmd += ["--prefill", str(prefill)]
    t = time.time()
    subprocess.run(cmd, check=True)
    return np.load(out), time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quantize", help="quantize the float model as it loads (both backends)")
    a = ap.parse_args()
    rng = random.Random(1)
    ids = [rng.randrange(100, 49000) for _ in range(a.tokens)]
    with tempfile.TemporaryDirectory() as d:
        q = a.quantize
        gpu_prefill, tg = logits(a.kiln, a.model, "cuda", ids, os.path.join(d, "g.npy"), None, q)
        gpu_decode, _ = logits(a.kiln, a.model, "cuda", ids, os.path.join(d, "gd.npy"), a.prefill, q)
        cpu, tc = logits(a.kiln, a.model, "cpu", ids, os.path.join(d, "c.npy"), None, q)
    r = {
        "model": os.path.basename(a.model) + (f" --quantize {a.quantize}" if a.quantize else ""),
        "tokens": a.tokens,
        "prefill_then_decode_from": a.prefill,
        "cuda_prefill_vs_cpu": compare(gpu_prefill, cpu),
        "cuda_decode_vs_cpu": compare(gpu_decode, cpu),
        "cuda_decode_vs_cuda_prefill": compare(gpu_decode, gpu_prefill),
        "seconds": {"cuda_prefill_run": round(tg, 1), "cpu_run": round(tc, 1)},
    }
    print(json.dumps(r, indent=1))
    with open(a.out, "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
