#!/usr/bin/env python3
"""Random Mixture-of-Experts checkpoints at the head sizes real releases use, made on
the GPU machine with its transformers, saved as bf16 safetensors with a word-level
tokenizer (the tests' tiny checkpoints have 12- and 16-wide heads, which the CUDA
attention kernels route to their reference path).

Shapes:
- `qwen3_moe-small`: Qwen3-MoE's layer (128-wide heads with QK-norm, 16 experts, top 4,
  normalized) on a 1024-wide, 6-layer body;
- `qwen3_moe-30b-a3b-12l`: Qwen3-30B-A3B's layer and vocabulary on 12 of its 48 layers (the
  decode roofline's shape: active bytes a token over the copy bandwidth);
- `mixtral-small`: Mixtral's layer (8 experts, top 2, w1/w3/w2) on a 1024-wide, 4-layer body.

Weights are normal with spread 1/sqrt(fan-in), norms around 1; the router's spread is
larger (4/sqrt(fan-in)) so tokens' expert choices are clear of ties more often.

    python3 bench/gpu/moe_ckpt.py SHAPE OUT_DIR
"""
import json, os, sys

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "goldens"))
from common import write_tokenizer  # noqa: E402

SHAPES = {
    "qwen3_moe-small": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[])),
    # Qwen3-30B-A3B's layer (2048 wide, 128 experts of 768, top 8, 32 query / 4 KV heads of 128,
    # its vocabulary) on 12 of its 48 layers: 8.1B parameters, 16 GB in bf16.
    "qwen3_moe-30b-a3b-12l": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[])),
    "mixtral-small": (MixtralConfig, MixtralForCausalLM, dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_local_experts=8,
        num_experts_per_tok=2)),
}


def main(shape, out):
    cfg_cls, cls, kw = SHAPES[shape]
    cfg = cfg_cls(**kw, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.copy_(4.0 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, cfg.vocab_size)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"shape": shape, "params": n, "out": out}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
