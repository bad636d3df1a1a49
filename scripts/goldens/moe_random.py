"""Random Mixture-of-Experts checkpoints and what transformers computes on them.

Makes the test data of `crates/kiln-models/tests/moe.rs`: for each family
below a small random model (every weight randomised, norms around 1, the
routers scaled so each token's chosen experts are clearly apart from the
rest), saved with `save_pretrained` as f32 safetensors (transformers writes
the per-expert layout released checkpoints use), and the log-softmax of
transformers' logits (eager attention, float64, no cache) over a prompt.
The script prints, per family, the smallest gap between a token's last kept
and first dropped router logit: a test tolerance means nothing if f32
rounding could flip a choice.

Run once with transformers >= 5.24 and CPU torch; the outputs are committed
and tests never run this:

    PYTHONPATH=<site-packages with torch, transformers> \
        python3 scripts/goldens/moe_random.py crates/kiln-models/tests/data/moe
"""

import json
import os
import sys

import torch
import transformers
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from common import write_tokenizer  # scripts/goldens/common.py

COMMON = {
    "vocab_size": 96,
    "hidden_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CASES = {
    # 8 experts, top 2, always renormalized; w1/w3/w2 names.
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "rope_theta": 1e6}),
    # Shared expert with its sigmoid gate, q/k/v biases, weights not renormalized.
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  {"intermediate_size": 40, "num_experts": 8, "num_experts_per_tok": 3,
                   "moe_intermediate_size": 24, "shared_expert_intermediate_size": 36,
                   "norm_topk_prob": False}),
    # QK-norm, renormalized top 4 of 8, layer 1 dense (mlp_only_layers).
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  {"intermediate_size": 40, "num_experts": 8, "num_experts_per_tok": 4,
                   "moe_intermediate_size": 24, "norm_topk_prob": True, "mlp_only_layers": [1],
                   "head_dim": 16}),
}

PROMPT = [1, 17, 93, 5, 64, 11, 33, 8, 77, 90, 45, 3, 88, 19, 56, 60, 27, 71, 9, 42]


def randomise(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") and p.shape[0] > 1:
                # Routers: wide logits, so the top k is decided by a margin.
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def routing_margin(model, ids, top_k):
    """The smallest gap, over layers and tokens, between the k-th and the
    (k+1)-th router logit (softmax keeps their order)."""
    gaps = []

    def hook(mod, inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        top = torch.topk(logits.double(), top_k + 1, dim=-1).values
        gaps.append((top[..., top_k - 1] - top[..., top_k]).min().item())

    hooks = []
    for name, mod in model.named_modules():
        if name.endswith(("mlp.gate", "block_sparse_moe.gate")):
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return min(gaps)


def main(out_root):
    torch.set_num_threads(2)
    for case, (cfg_cls, model_cls, over) in CASES.items():
        cfg = cfg_cls(**{**COMMON, **over}, attn_implementation="eager",
                      experts_implementation="eager")
        gen = torch.Generator().manual_seed(20261205)
        model = model_cls(cfg).to(torch.float32).eval()
        randomise(model, gen)
        out = os.path.join(out_root, case)
        model.save_pretrained(out, safe_serialization=True)
        write_tokenizer(out, cfg.vocab_size)
        model = model.to(torch.float64)
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0]
            logprobs = torch.log_softmax(logits, dim=-1)
        margin = routing_margin(model, ids, cfg.num_experts_per_tok)
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump({
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "prompt": PROMPT,
                "min_routing_margin": margin,
                "logprobs": [[round(v, 7) for v in row] for row in logprobs.tolist()],
            }, f)
        print(case, "saved to", out, "routing margin", margin, "argmax", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main(sys.argv[1])
