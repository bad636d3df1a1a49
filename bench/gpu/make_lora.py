#!/usr/bin/env python3
"""Random PEFT LoRA adapters for a Hugging Face Llama/Qwen-shaped checkpoint (GPU machine, no peft).

Writes DIR_PREFIX0 .. DIR_PREFIX{count-1}, each adapter_config.json + adapter_model.safetensors
as PEFT saves them (base_model.model.<module>.lora_A/lora_B.weight), A uniform in +-1/sqrt(in)
and B uniform in +-b/sqrt(r) (PEFT's init_lora_weights=False draws both with bound 1/sqrt(fan_in)).

    python3 bench/gpu/make_lora.py --ckpt DIR --out PREFIX --count 8 --rank 16 \
        --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
"""
import argparse, json, os

import torch
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True, help="directory prefix; adapter i goes to PREFIX{i}")
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--rslora", action="store_true")
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--b-scale", type=float, default=0.1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    c = json.load(open(os.path.join(a.ckpt, "config.json")))
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads)
    hd = c.get("head_dim") or h // heads
    shapes = {  # module: (out, in)
        "q_proj": ("self_attn", heads * hd, h),
        "k_proj": ("self_attn", kv * hd, h),
        "v_proj": ("self_attn", kv * hd, h),
        "o_proj": ("self_attn", h, heads * hd),
        "gate_proj": ("mlp", inter, h),
        "up_proj": ("mlp", inter, h),
        "down_proj": ("mlp", h, inter),
    }
    targets = a.targets.split(",")
    dtype = getattr(torch, a.dtype)
    r = a.rank
    for i in range(a.count):
        g = torch.Generator().manual_seed(a.seed * 1000 + i)
        tensors = {}
        for layer in range(layers):
            for t in targets:
                part, out, inp = shapes[t]
                name = f"base_model.model.model.layers.{layer}.{part}.{t}"
                A = (torch.rand(r, inp, generator=g) * 2 - 1) / inp**0.5
                B = (torch.rand(out, r, generator=g) * 2 - 1) * a.b_scale / r**0.5
                tensors[f"{name}.lora_A.weight"] = A.to(dtype).contiguous()
                tensors[f"{name}.lora_B.weight"] = B.to(dtype).contiguous()
        d = f"{a.out}{i}"
        os.makedirs(d, exist_ok=True)
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        json.dump({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": a.alpha,
            "use_rslora": a.rslora, "target_modules": targets, "bias": "none", "use_dora": False,
            "fan_in_fan_out": False, "lora_dropout": 0.0, "modules_to_save": None,
            "base_model_name_or_path": a.ckpt,
        }, open(os.path.join(d, "adapter_config.json"), "w"), indent=1)
        print("wrote", d, len(tensors), "tensors", flush=True)


if __name__ == "__main__":
    main()
