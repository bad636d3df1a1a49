"""Random DeepSeek-V2 and DeepSeek-V3 checkpoints and what transformers
computes on them.

Makes `crates/kiln-models/tests/data/moe/deepseek_v2` and `.../deepseek_v3`
(read by `tests/moe.rs` with the other sparse families): three layers, the
first dense, multi-head latent attention with interleaved RoPE, shared
experts.
- `deepseek_v3`: queries through `q_lora_rank`, YaRN with `mscale_all_dim`
  (so the softmax scale carries mscale²), 16 experts in 4 groups (the best
  2 kept), top 4 by sigmoid plus a random `e_score_correction_bias`,
  renormalized, scaled 2.5, one shared expert; and its MTP layer
  (`model.layers.3`, `nextn_golden.py`: transformers' own `MtpModel`) with
  its outputs at depths 1 and 2;
- `deepseek_v2`: `q_proj` directly, plain RoPE, 8 experts, top 3 of a
  softmax over all, not renormalized, scaled 1.5, two shared experts;
- `deepseek_v2_grouped`: as V2 with `group_limited_greedy` (the best 2 of 4
  groups by their best expert), as the 236B releases route;
- `glm4_moe_lite` (GLM-4.7-Flash): V3's attention with GLM-4.5's routing
  (sigmoid, one group), sparse layers from `mlp_layer_types`.

Saved with `save_pretrained` as f32 safetensors (per-expert tensors, as
released), with the log-softmax of transformers' logits (eager attention,
float64, no cache) over a prompt. The script prints the smallest routing
margins: a test tolerance means nothing if f32 rounding could flip a choice.

Run once with transformers >= 5.25 and CPU torch; the outputs are committed
and tests never run this:

    PYTHONPATH=<site-packages with torch, transformers> \\
        python3 scripts/goldens/deepseek_random.py crates/kiln-models/tests/data/moe
"""

import json
import os
import sys

import torch
import transformers
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM)

sys.path.insert(0, os.path.dirname(__file__))
import nextn_golden  # noqa: E402
from common import sigmoid_routing_margins, write_tokenizer  # noqa: E402

COMMON = {
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 40,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "moe_intermediate_size": 24,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CASES = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {
        "q_lora_rank": 24, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM, {
        "q_lora_rank": None, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 1,
        "topk_group": 1, "topk_method": "greedy", "n_shared_experts": 2,
        "routed_scaling_factor": 1.5, "moe_layer_freq": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "deepseek_v2_grouped": (DeepseekV2Config, DeepseekV2ForCausalLM, {
        "q_lora_rank": None, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
        "topk_group": 2, "topk_method": "group_limited_greedy", "n_shared_experts": 1,
        "routed_scaling_factor": 1.0, "moe_layer_freq": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, {
        "q_lora_rank": 24, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 1,
        "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.8, "norm_topk_prob": True,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
}
PROMPT = [1, 17, 93, 5, 64, 11, 33, 8, 77, 90, 45, 3, 88, 19, 56, 60, 27, 71, 9, 42]


def randomise(model, gen, skip=()):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(skip):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                # A peaked output distribution (a flat one tests little).
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") and p.shape[0] > 1:
                # Routers: logits of a few units.
                p.copy_(0.35 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def margins(model, cfg, run, v3):
    """The smallest routing gaps: V3's (`common.sigmoid_routing_margins`), or
    V2's between the k-th and (k+1)-th softmax score."""
    k = cfg.num_experts_per_tok
    if v3:
        return sigmoid_routing_margins(model, run, k, cfg.n_group, cfg.topk_group)
    grouped = getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
    gaps, group_gaps = [], []

    def hook(mod, inp, out):
        p = out[0].double().softmax(-1)
        if grouped:
            groups, keep = cfg.n_group, cfg.topk_group
            g = p.view(p.shape[0], groups, -1).max(-1).values
            top = g.topk(keep + 1, dim=-1)
            group_gaps.append((top.values[:, keep - 1] - top.values[:, keep]).min().item())
            mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, top.indices[:, :keep], True)
            p = p.masked_fill(~mask.repeat_interleave(p.shape[1] // groups, 1), 0.0)
        t = p.topk(k + 1, dim=-1).values
        gaps.append((t[:, k - 1] - t[:, k]).min().item())

    hooks = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        run()
    for h in hooks:
        h.remove()
    return {"experts": min(gaps), **({"groups": min(group_gaps)} if grouped else {})}


def main(root):
    torch.set_num_threads(2)
    for case, (cfg_cls, model_cls, over) in CASES.items():
        cfg = cfg_cls(**{**COMMON, **over}, attn_implementation="eager", experts_implementation="eager")
        ids = torch.tensor([PROMPT])
        # The first seed whose routing is clear everywhere (every margin at
        # least 2e-3): random routers often put two keys within f32 reach.
        v3 = case in ("deepseek_v3", "glm4_moe_lite")
        head = case == "deepseek_v3"
        for seed in range(20261208, 20261208 + 200):
            gen = torch.Generator().manual_seed(seed)
            model = model_cls(cfg).to(torch.float32).eval()
            randomise(model, gen)
            # V3 ships its MTP layer (transformers' own `MtpModel`).
            mtp = nextn_golden.new_layer(model, lambda m, skip: randomise(m, gen, skip)) if head else None
            model = model.to(torch.float64)
            margin = margins(model, cfg, lambda: model(ids, use_cache=False), v3)
            if head:
                fields, depth2 = nextn_golden.golden(model, mtp, PROMPT)
                margin_mtp = margins(mtp, cfg, depth2, v3)
                margin.update({f"mtp_{k}": v for k, v in margin_mtp.items()})
            if min(margin.values()) > 2e-3:
                break
        model = model.to(torch.float32)
        out = os.path.join(root, case)
        model.save_pretrained(out, safe_serialization=True)
        write_tokenizer(out, cfg.vocab_size)
        if head:
            nextn_golden.save_layer(mtp, model_cls, out, cfg.moe_intermediate_size)
        model = model.to(torch.float64)
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0]
        ls = [[round(v, 7) for v in row] for row in torch.log_softmax(logits, -1).tolist()]
        extra = fields if head else {}
        if head:
            assert extra["logprobs"] == ls
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump({
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "prompt": PROMPT,
                "seed": seed,
                "min_routing_margin": margin,
                "logprobs": ls,
                **extra,
            }, f)
        print(case, "saved to", out, "routing margins", margin, "argmax", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main(sys.argv[1])
