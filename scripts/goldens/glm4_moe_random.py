"""A random GLM-4.5 (`glm4_moe`) checkpoint with its DeepSeek-style
multi-token-prediction layer, and what transformers computes on both.

Makes `crates/kiln-models/tests/data/moe/glm4_moe` (read by `tests/moe.rs`
with the other sparse families and by `tests/mtp.rs`): three layers, the
first dense (`first_k_dense_replace`), the others sparse with 16 experts in
4 groups (the best 2 groups kept, top 4 of their experts, sigmoid scores
picked with a random `e_score_correction_bias`, renormalized, scaled by
`routed_scaling_factor`) and an ungated shared expert; q/k/v biases, QK-norm
and RoPE over half of each head. `num_nextn_predict_layers: 1`: the MTP
layer as GLM-4.5 checkpoints ship it, `model.layers.3.{enorm, hnorm,
eh_proj, shared_head.norm}` and a sparse decoder block (`nextn_golden.py`:
made, named and run by transformers' own `MtpModel`).

Golden (float64, eager attention, no cache): the model's log-softmax over
the prompt and the MTP layer's at depths 1 and 2 (`nextn_golden.py`). The script
prints the smallest routing margins (group scores and kept keys): a test
tolerance means nothing if f32 rounding could flip a choice.

Run once with transformers >= 5.25 and CPU torch; the outputs are committed
and tests never run this:

    PYTHONPATH=<site-packages with torch, transformers> \\
        python3 scripts/goldens/glm4_moe_random.py crates/kiln-models/tests/data/moe
"""

import json
import os
import sys

import torch
import transformers
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
import nextn_golden  # noqa: E402
from common import sigmoid_routing_margins, write_tokenizer  # noqa: E402

CONFIG = {
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 40,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_bias": True,
    "use_qk_norm": True,
    "moe_intermediate_size": 24,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "routed_scaling_factor": 2.5,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "num_mtp_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
PROMPT = [1, 17, 93, 5, 64, 11, 33, 8, 77, 90, 45, 3, 88, 19, 56, 60, 27, 71, 9, 42]


def randomise(module, gen, skip=()):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(skip):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") and p.shape[0] > 1:
                # Routers: logits of a few units, so sigmoids are not flat.
                p.copy_(0.35 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def margins(module, run):
    return sigmoid_routing_margins(module, run, CONFIG["num_experts_per_tok"], CONFIG["n_group"],
                                   CONFIG["topk_group"])


def main(root):
    torch.set_num_threads(2)
    out = os.path.join(root, "glm4_moe")
    cfg = Glm4MoeConfig(**CONFIG, attn_implementation="eager", experts_implementation="eager")
    gen = torch.Generator().manual_seed(20261208)
    model = Glm4MoeForCausalLM(cfg).to(torch.float32).eval()
    randomise(model, gen)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, cfg.vocab_size)

    # The MTP layer, built and randomised by transformers, saved beside the
    # model under the checkpoint names GLM-4.5 uses.
    mtp = nextn_golden.add_layer(model, Glm4MoeForCausalLM, out, lambda m, skip: randomise(m, gen, skip),
                                 CONFIG["moe_intermediate_size"])
    fields, depth2 = nextn_golden.golden(model, mtp, PROMPT)
    ids = torch.tensor([PROMPT])
    margin = margins(model, lambda: model(ids, use_cache=False))
    margin_mtp = margins(mtp, depth2)
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump({
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "prompt": PROMPT,
            "min_routing_margin": margin,
            "min_routing_margin_mtp": margin_mtp,
            **fields,
        }, f)
    print("saved to", out, "routing margins", margin, "mtp", margin_mtp)


if __name__ == "__main__":
    main(sys.argv[1])
