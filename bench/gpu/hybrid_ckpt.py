#!/usr/bin/env python3
"""Random hybrid checkpoints at the head sizes real releases use, made on the GPU
machine with its transformers (5.17 has Qwen3.5 and LFM2), saved as bf16
safetensors with a word-level tokenizer.

Shapes:
- `qwen3_5-small`: Qwen3.5's heads (full attention head_dim 256 with partial RoPE,
  DeltaNet key/value heads of 128) on a 1024-wide, 8-layer body — for parity;
- `lfm2-small`: LFM2-1.2B's heads (64-wide GQA, kernel-3 short convolutions) on a
  1024-wide, 8-layer body — for parity;
- `qwen3_5-9b`: Qwen3.5-9B's shape (4096 wide, 32 layers, 3 DeltaNet : 1 attention,
  248,320-word vocabulary) — for the decode roofline (weights made on the GPU).

Weights are normal with spread 1/sqrt(fan-in) (so a deep random stack neither
blows up nor dies), norms around their centre, DeltaNet's decay parameters in
their trained range.

    python3 bench/gpu/hybrid_ckpt.py SHAPE OUT_DIR
"""
import json, os, sys

import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "goldens"))
from common import write_tokenizer  # noqa: E402


def qwen_layers(n):
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


SHAPES = {
    "qwen3_5-small": ("qwen", dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=4, linear_num_value_heads=8, layer_types=qwen_layers(8))),
    "qwen3_5-9b": ("qwen", dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, layer_types=qwen_layers(32))),
    "lfm2-small": ("lfm2", dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=4608, block_multiple_of=256,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv"])),
}


def main(shape, out):
    kind, kw = SHAPES[shape]
    common = dict(max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=(kind == "lfm2"))
    if kind == "qwen":
        cfg = Qwen3_5TextConfig(**kw, **common, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
        cls = Qwen3_5ForCausalLM
    else:
        cfg = Lfm2Config(**kw, **common, norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls = Lfm2ForCausalLM
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or (kind == "lfm2" and name.endswith("norm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))  # zero-centred: scales by 1 + w
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("conv1d.weight", "conv.conv.weight")):
                p.copy_(0.4 * torch.randn_like(p))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, cfg.vocab_size)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"shape": shape, "params": n, "out": out}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
