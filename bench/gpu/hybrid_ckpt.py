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
- `glm4_moe-small`: GLM-4.5's layer kinds (128-wide heads with q/k/v biases, QK-norm and RoPE over
  half of each head; 32 experts of 256 in 4 groups, the best 2 kept, top 8 by sigmoid scores plus a
  selection bias, scaled 2.5; an ungated shared expert; layer 0 dense) on a 1024-wide, 8-layer
  body — for parity of the DeepSeek-style routing on the device;
- `deepseek-small`: DeepSeek-V3's attention at its head sizes (latent 512, rope 64, nope 128,
  value 128; queries through a 768 rank) with its routing (32 experts of 256 in 4 groups, top 6, a
  shared expert; layer 0 dense) on a 1024-wide, 8-layer body — for parity of latent attention;
- `qwen3_5-9b`: Qwen3.5-9B's shape (4096 wide, 32 layers, 3 DeltaNet : 1 attention,
  248,320-word vocabulary) — for the decode roofline (weights made on the GPU).

Weights are normal with spread 1/sqrt(fan-in) (so a deep random stack neither
blows up nor dies), norms around their centre, DeltaNet's decay parameters in
their trained range.

    python3 bench/gpu/hybrid_ckpt.py SHAPE OUT_DIR [--mtp]

`--mtp` (Qwen3.5 shapes) adds a multi-token-prediction head as Qwen3.5 checkpoints ship it
(`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, one full-attention `mtp.layers.0`, `mtp.norm`;
`mtp_num_hidden_layers: 1`) in a shard of its own listed in the index.
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


DEV = "cuda" if torch.cuda.is_available() else "cpu"


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
    "glm4_moe-small": ("glm", dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, attention_bias=True,
        use_qk_norm=True, n_routed_experts=32, num_experts_per_tok=8, moe_intermediate_size=256,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, norm_topk_prob=True)),
    "deepseek-small": ("deepseek", dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=32,
        num_experts_per_tok=6, moe_intermediate_size=256, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True)),
    "lfm2-small": ("lfm2", dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=4608, block_multiple_of=256,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv"])),
}


def randomise(named, kind):
    with torch.no_grad():
        for name, p in named:
            if name.endswith("linear_attn.norm.weight") or (kind in ("lfm2", "glm", "deepseek") and name.endswith("norm.weight")):
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


def add_mtp(model, cfg, out):
    """The head's tensors in `model-mtp.safetensors`, listed in the index with the model's."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    h = cfg.hidden_size
    with torch.device(DEV):
        head = torch.nn.ModuleDict({
            "fc": torch.nn.Linear(2 * h, h, bias=False),
            "pre_fc_norm_embedding": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
            "pre_fc_norm_hidden": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
            "layers": torch.nn.ModuleList([Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention"))]),
            "norm": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
        })
    randomise(head.named_parameters(), "qwen")
    tensors = {f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, os.path.join(out, "model-mtp.safetensors"), metadata={"format": "pt"})
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        idx = json.load(open(index))
    else:
        # One file: renamed to a shard so the index can list both.
        os.rename(os.path.join(out, "model.safetensors"), os.path.join(out, "model-00001.safetensors"))
        keys = load_file(os.path.join(out, "model-00001.safetensors"), device="cpu").keys()
        idx = {"metadata": {}, "weight_map": {k: "model-00001.safetensors" for k in keys}}
    idx["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
    json.dump(idx, open(index, "w"))
    c = json.load(open(os.path.join(out, "config.json")))
    c["mtp_num_hidden_layers"] = 1
    json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=2)


def main(shape, out, mtp=False):
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
    elif kind == "deepseek":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        cfg = DeepseekV3Config(**kw, **common, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0})
        cls = DeepseekV3ForCausalLM
    elif kind == "glm":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
        cfg = Glm4MoeConfig(**kw, **common, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
        cls = Glm4MoeForCausalLM
    else:
        cfg = Lfm2Config(**kw, **common, norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls = Lfm2ForCausalLM
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        model = cls(cfg)
    randomise(model.named_parameters(), kind)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.02 * torch.randn_like(b))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, cfg.vocab_size)
    if mtp:
        add_mtp(model, cfg, out)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"shape": shape, "params": n, "out": out}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--mtp" in sys.argv[3:])
