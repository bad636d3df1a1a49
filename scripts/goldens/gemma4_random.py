"""Random Gemma 4 text checkpoints and what transformers computes on them.

Makes the test data of `crates/kiln-models/tests/gemma4.rs`: for each config
below, a random `Gemma4ForCausalLM` (every norm weight and `layer_scalar`
randomised, so a `1 + w` or scaling bug shows), saved with `save_pretrained`
as f32 safetensors, and the log-softmax of transformers' logits (eager
attention, float64, no cache) over a prompt longer than the sliding window.

Run once with transformers >= 5.24 and CPU torch; the outputs are committed
and tests never run this:

    PYTHONPATH=<site-packages with torch, transformers> \
        python3 scripts/goldens/gemma4_random.py crates/kiln-models/tests/data/gemma4
"""

import json
import os
import sys

import torch
import transformers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from common import write_tokenizer  # scripts/goldens/common.py

BASE = {
    "vocab_size": 128,
    "vocab_size_per_layer_input": 128,
    "hidden_size": 64,
    "hidden_size_per_layer_input": 8,
    "intermediate_size": 32,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                    "sliding_attention", "sliding_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 4,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0},
    },
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

CONFIGS = {
    # K = V on the full layers (one global KV head, no v_proj), the last
    # three layers reading the caches of layers 1 and 2, double-wide MLPs
    # there, per-layer embeddings.
    "shared_kv": {"attention_k_eq_v": True, "num_global_key_value_heads": 1,
                  "num_kv_shared_layers": 3, "use_double_wide_mlp": True},
    # E2B/E4B style: v_proj on the full layers with the sliding layers' KV
    # heads, no sharing, no per-layer embeddings.
    "plain": {"attention_k_eq_v": False, "num_kv_shared_layers": 0,
              "hidden_size_per_layer_input": 0, "use_double_wide_mlp": False},
}

PROMPT = [2, 17, 93, 5, 64, 101, 33, 8, 77, 120, 45, 3, 88, 19, 56, 110, 27, 71, 9, 99]


def randomise(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def main(out_root):
    torch.set_num_threads(2)
    for case, over in CONFIGS.items():
        cfg = Gemma4TextConfig(**{**BASE, **over}, attn_implementation="eager")
        gen = torch.Generator().manual_seed(20261202)
        model = Gemma4ForCausalLM(cfg).to(torch.float32).eval()
        randomise(model, gen)
        out = os.path.join(out_root, case)
        model.save_pretrained(out, safe_serialization=True)
        write_tokenizer(out, cfg.vocab_size)
        model = model.to(torch.float64)
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            logits = model(ids, use_cache=False).logits[0]
            logprobs = torch.log_softmax(logits, dim=-1)
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump({
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "prompt": PROMPT,
                "logprobs": [[round(v, 7) for v in row] for row in logprobs.tolist()],
            }, f)
        print(case, "saved to", out, "argmax", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main(sys.argv[1])
