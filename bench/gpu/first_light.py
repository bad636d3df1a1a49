#!/usr/bin/env python3
"""First light of Kiln's CUDA backend, in one GPU round:

1. a random checkpoint of SmolLM2-135M shape (bf16 safetensors) made by `kiln dev random-checkpoint`;
2. Kiln's all-position logits on the CPU backend and on the CUDA backend (`kiln dev logits --device ...`);
3. transformers' bf16 logits on the GPU for the same checkpoint (the oracle), and its f32 logits;
4. `kiln bench --device cuda` (prefill/decode speed of this first, unfused backend).

Writes one JSON report. Run on the GPU machine from the repo root:
    python3 bench/gpu/first_light.py --kiln .device/kiln --out $OUT/first_light.json
"""
import argparse, json, os, subprocess, sys, tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logit_compare  # noqa: E402


def compare(a, b):
    """logit_compare's distances, and whether the last position's top 5 agree."""
    return {
        **logit_compare.compare(a, b),
        "top5_last_equal": np.argsort(-a[-1])[:5].tolist() == np.argsort(-b[-1])[:5].tolist(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    tok_dir = os.path.join(os.path.dirname(__file__), "..", "smollm2-tokenizer")
    rng = np.random.default_rng(0)
    ids = [1] + rng.integers(3, 49152, size=args.tokens - 1).tolist()
    report = {"device": torch.cuda.get_device_name(0), "tokens": len(ids)}
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "s135")
        subprocess.run([args.kiln, "dev", "random-checkpoint", "--preset", "smollm2-135m", "--tokenizer", tok_dir,
                        "--dtype", "bf16", "-o", ck], check=True)
        outs = {}
        for dev in ["cpu", "cuda"]:
            npy = os.path.join(tmp, dev + ".npy")
            r = subprocess.run([args.kiln, "dev", "logits", "--device", dev, "-m", ck,
                                "--ids", ",".join(map(str, ids)), "-o", npy], capture_output=True, text=True)
            print(r.stderr, file=sys.stderr)
            if r.returncode != 0:
                report[f"kiln_{dev}_error"] = r.stderr[-2000:]
                continue
            outs[dev] = np.load(npy)
        torch.set_grad_enabled(False)
        hf = {}
        for name, dtype in [("bf16", torch.bfloat16), ("f32", torch.float32)]:
            m = AutoModelForCausalLM.from_pretrained(ck, dtype=dtype, attn_implementation="eager").cuda().eval()
            hf[name] = m(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
            del m
        if "cpu" in outs:
            report["kiln_cpu_vs_hf_f32"] = compare(outs["cpu"], hf["f32"])
        if "cuda" in outs:
            report["kiln_cuda_vs_hf_bf16"] = compare(outs["cuda"], hf["bf16"])
            report["hf_bf16_vs_hf_f32"] = compare(hf["bf16"], hf["f32"])
            report["kiln_cuda_vs_hf_f32"] = compare(outs["cuda"], hf["f32"])
            if "cpu" in outs:
                report["kiln_cuda_vs_kiln_cpu"] = compare(outs["cuda"], outs["cpu"])
            r = subprocess.run([args.kiln, "bench", "--device", "cuda", "-m", ck, "--prompt-tokens", "512",
                                "--gen-tokens", "128", "--runs", "3"], capture_output=True, text=True)
            print(r.stderr, file=sys.stderr)
            if r.returncode == 0:
                report["kiln_cuda_bench"] = json.loads(r.stdout)
            else:
                report["kiln_cuda_bench_error"] = r.stderr[-2000:]
    for k, v in report.items():
        if isinstance(v, dict) and "cosine" in v:
            print(f"{k:24s} max|Δlogprob| {v['max_abs_logprob_diff']:.3e}  cos {v['cosine']:.6f}  "
                  f"argmax {v['argmax_agreement']:.3f}")
    b = report.get("kiln_cuda_bench")
    if b:
        print("kiln cuda bench: prefill", b["prefill_tokens_per_second"]["median"], "decode",
              b["decode_tokens_per_second"]["median"])
    json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
