#!/usr/bin/env python3
"""KV-cache elements against the f32 cache on real models, on the CPU: the logits of every
position of 160 random token ids (120 in one prefill step, then one token a step) with
`--kv-cache-dtype f16` and `fp8` (E4M3 at unit scale, as the CUDA FP8 cache keeps it), each
against `f32`: cosine (min, mean), argmax agreement, largest |Δ log-softmax|.

    python3 bench/kv_fidelity.py KILN MODEL.gguf [MODEL.gguf ...] > out.json

Needs numpy.
"""
import json
import random
import subprocess
import sys
import tempfile

import numpy as np


def lsm(x):
    mx = x.max(1, keepdims=True)
    return x - mx - np.log(np.exp(x - mx).sum(1, keepdims=True))


def main():
    kiln, models = sys.argv[1], sys.argv[2:]
    rng = random.Random(5)
    ids = ",".join(str(rng.randrange(100, 40000)) for _ in range(160))
    out = []
    with tempfile.TemporaryDirectory() as d:
        for m in models:
            res = {}
            for kv in ["f32", "f16", "fp8"]:
                f = f"{d}/{kv}.npy"
                subprocess.run([kiln, "--threads", "2", "--kv-cache-dtype", kv, "dev", "logits", "-m", m,
                                "--device", "cpu", "--ids", ids, "--prefill", "120", "-o", f],
                               check=True, stderr=subprocess.DEVNULL)
                res[kv] = np.load(f).astype(np.float64)
            a = res["f32"]
            for kv in ["f16", "fp8"]:
                b = res[kv]
                cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
                r = {"model": m.split("/")[-1], "kv_cache_dtype": kv, "against": "f32",
                     "cosine_min": round(float(cos.min()), 6), "cosine_mean": round(float(cos.mean()), 6),
                     "argmax_agreement": round(float((a.argmax(1) == b.argmax(1)).mean()), 4),
                     "max_abs_logprob_diff": round(float(np.abs(lsm(a) - lsm(b)).max()), 4)}
                print(json.dumps(r), file=sys.stderr, flush=True)
                out.append(r)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
