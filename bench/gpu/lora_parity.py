#!/usr/bin/env python3
"""Kiln CUDA logits under LoRA adapters against transformers with each adapter merged into the
base weights (W + scale * B A, in f32; the PEFT semantics the CPU goldens check), on the GPU.

For each adapter and a random-token prompt, log-softmax at every position of
- Kiln CUDA with the adapter, every position in one prefill step;
- Kiln CUDA with the adapter, --prefill positions in one step and the rest one token a step;
against the merged model in transformers f32 and bf16; also the base (Kiln vs transformers) and
the adapter's effect (merged vs base in transformers f32), so the bound means something.

    python3 bench/gpu/lora_parity.py --kiln .device/kiln --ckpt DIR --adapters A,B --out lora.json
"""
import argparse, json, os, subprocess, sys, tempfile

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from parity import compare  # noqa: E402

DEV = os.environ.get("PARITY_DEVICE", "cuda")  # cpu: a dry run of the script here
KDEV = "cuda" if DEV == "cuda" else "cpu"


def kiln(kiln, ck, ids, tmp, lora=None, prefill=None):
    npy = os.path.join(tmp, "k.npy")
    cmd = [kiln, "dev", "logits", "--device", KDEV, "-m", ck, "--ids", ",".join(map(str, ids)), "-o", npy]
    if lora:
        cmd += ["--lora", lora]
    if prefill:
        cmd += ["--prefill", str(prefill)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return np.load(npy)


def merge(model, adir):
    cfg = json.load(open(os.path.join(adir, "adapter_config.json")))
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / (r**0.5 if cfg.get("use_rslora") else r)
    w = load_file(os.path.join(adir, "adapter_model.safetensors"))
    with torch.no_grad():
        for k, a in w.items():
            if not k.endswith(".lora_A.weight"):
                continue
            mod = k[len("base_model.model."):-len(".lora_A.weight")]
            b = w[k.replace("lora_A", "lora_B")]
            lin = model.get_submodule(mod)
            lin.weight += scale * (b.float().to(DEV) @ a.float().to(DEV)).to(lin.weight.dtype)
    return scale


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], device=DEV)).logits[0].float().cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--adapters", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--prefill", type=int, default=200)
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.ckpt, "config.json")))
    ids = np.random.default_rng(0).integers(100, cfg["vocab_size"] - 1, a.tokens).tolist()
    load = lambda dt: AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=dt, attn_implementation="sdpa").to(DEV).eval()
    rep = {"ckpt": a.ckpt, "tokens": a.tokens, "prefill": a.prefill, "adapters": {}}
    tmp = tempfile.mkdtemp()
    base32 = hf_logits(load(torch.float32), ids)
    base16 = hf_logits(load(torch.bfloat16), ids)
    kb = kiln(a.kiln, a.ckpt, ids, tmp)
    rep["base"] = {"kiln_cuda_vs_hf_f32": compare(kb, base32), "kiln_cuda_vs_hf_bf16": compare(kb, base16)}
    for adir in a.adapters.split(","):
        m = load(torch.float32)
        scale = merge(m, adir)
        f32 = hf_logits(m, ids)
        del m
        m = load(torch.bfloat16)
        merge(m, adir)
        b16 = hf_logits(m, ids)
        del m
        torch.cuda.empty_cache() if DEV == "cuda" else None
        kp = kiln(a.kiln, a.ckpt, ids, tmp, lora=adir)
        kd = kiln(a.kiln, a.ckpt, ids, tmp, lora=adir, prefill=a.prefill)
        rep["adapters"][os.path.basename(adir)] = {
            "scale": scale,
            "adapter_effect_hf_merged_vs_base_f32": compare(f32, base32),
            "kiln_cuda_prefill_vs_hf_merged_f32": compare(kp, f32),
            "kiln_cuda_prefill_vs_hf_merged_bf16": compare(kp, b16),
            "kiln_cuda_decode_vs_hf_merged_f32": compare(kd, f32),
            "kiln_cuda_decode_vs_hf_merged_bf16": compare(kd, b16),
            "hf_merged_bf16_vs_f32": compare(b16, f32),
            "kiln_cuda_with_adapter_vs_hf_base_f32": compare(kp, base32),
        }
        print(os.path.basename(adir), json.dumps(rep["adapters"][os.path.basename(adir)]), flush=True)
    json.dump(rep, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
