#!/usr/bin/env python3
"""Random hybrid checkpoints at the head sizes real releases use, made on the GPU
machine with its transformers (5.17 has Qwen3.5 and LFM2), saved as bf16
safetensors with a word-level tokenizer.

Shapes:
- `qwen3_5-small`: Qwen3.5's heads (full attention head_dim 256 with partial RoPE,
  DeltaNet key/value heads of 128) on a 1024-wide, 8-layer body — for parity;
- `lfm2-small`: LFM2-1.2B's heads (64-wide GQA, kernel-3 short convolutions) on a
  1024-wide, 8-layer body — for parity;
- `qwen3_5_moe-small`: the same body with Qwen3.5-MoE's sparse feed-forward (16 experts of 256,
  top 4, normalized, a gated shared expert of 256) — for parity of the MoE hybrid on the device's
  MoE kernels;
- `qwen3_5_moe-35b-a3b-8l`: Qwen3.5-35B-A3B's layer (2048 wide, 256 experts of 512, top 8, a
  shared expert of 512, 3 DeltaNet : 1 attention) on 8 of its 40 layers — for its decode roofline;
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

try:  # the MoE hybrid (the dense ones need only the above)
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
except ImportError:
    Qwen3_5MoeForCausalLM = Qwen3_5MoeTextConfig = None

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
    "qwen3_5_moe-small": ("qwen_moe", dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=4, linear_num_value_heads=8, layer_types=qwen_layers(8),
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
        shared_expert_intermediate_size=256)),
    "qwen3_5_moe-35b-a3b-8l": ("qwen_moe", dict(
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, layer_types=qwen_layers(8),
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512)),
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
    if kind in ("qwen", "qwen_moe"):
        if kind == "qwen_moe" and Qwen3_5MoeTextConfig is None:
            sys.exit("this transformers has no Qwen3.5-MoE")
        cfg_cls, cls = ((Qwen3_5TextConfig, Qwen3_5ForCausalLM) if kind == "qwen"
                        else (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM))
        cfg = cfg_cls(**kw, **common, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
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
