"""Random hybrid (recurrent + attention) text checkpoints and what transformers
computes on them.

Makes the test data of `crates/kiln-models/tests/qwen3_5.rs` and `lfm2.rs`:
- `qwen3_5`: a small random `Qwen3_5ForCausalLM` (`qwen3_5_text`: three
  gated-DeltaNet layers, then a gated full-attention layer with partial RoPE);
- `qwen3_5_moe`: the same layers with every feed-forward a sparse block (8
  experts, top 2 renormalized, a shared expert under a sigmoid gate; routers
  scaled so each token's experts are clearly apart: the script prints the
  smallest margin);
- `qwen3_next`: Qwen3-Next, the same layers with its DeltaNet projections
  grouped by key head and layer 1's feed-forward dense (`mlp_only_layers`);
- `lfm2`: a small random `Lfm2ForCausalLM` (gated short convolutions and GQA
  attention layers interleaved, the feed-forward size auto-adjusted);
every weight randomised, norms around their centre, saved with `save_pretrained`
as f32 safetensors, and the log-softmax of transformers' logits (eager
attention, float64, no cache) over a prompt; also the logits of decoding the
prompt's last 5 tokens one at a time after a cached prefill of the rest.

Run once with transformers >= 5.24 and CPU torch; the outputs are committed
and tests never run this:

    python3 scripts/goldens/hybrid_random.py crates/kiln-models/tests/data/hybrid
"""

import json
import os
import sys

import torch
import transformers
from transformers import (Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM,
                          Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)
from common import write_tokenizer  # scripts/goldens/common.py

CONFIG = {
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 40,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

MOE = {**{k: v for k, v in CONFIG.items() if k != "intermediate_size"},
       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
       "shared_expert_intermediate_size": 36}

NEXT = {**CONFIG, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 36, "mlp_only_layers": [1], "decoder_sparse_step": 1,
        "norm_topk_prob": True}

LFM2 = {
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 96,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": True,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "conv_L_cache": 3,
    "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention"],
    "max_position_embeddings": 1024,
    "norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

LFM2_MOE = {**{k: v for k, v in LFM2.items() if not k.startswith("block_")},
            "intermediate_size": 64, "moe_intermediate_size": 24, "num_dense_layers": 1,
            "num_experts": 8, "num_experts_per_tok": 2, "use_expert_bias": True,
            "routed_scaling_factor": 1.5, "norm_topk_prob": True}

PROMPT = [1, 17, 93, 5, 64, 11, 33, 8, 77, 90, 45, 3, 88, 19, 56, 60, 27, 71, 9, 42]


def randomise(model, gen, lfm2=False):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or (lfm2 and name.endswith("norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("expert_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "feed_forward.gate.weight")):
                # Routers: wide logits, so the top k is decided by a margin.
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                # Zero-centred norms scale by 1 + w.
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 4.0, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("conv1d.weight", "conv.conv.weight")):
                p.copy_(0.4 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def save(model, cfg, out):
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, cfg.vocab_size)
    model = model.to(torch.float64)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
        logprobs = torch.log_softmax(logits, dim=-1)
        # Prefill all but the last 5 tokens with a cache, then one token a step.
        split = len(PROMPT) - 5
        o = model(ids[:, :split], use_cache=True)
        cache = o.past_key_values
        steps = []
        for t in PROMPT[split:]:
            o = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(torch.log_softmax(o.logits[0, -1], dim=-1).tolist())
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump({
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "prompt": PROMPT,
            "logprobs": [[round(v, 7) for v in row] for row in logprobs.tolist()],
            "decode_from": split,
            "decode_logprobs": [[round(v, 7) for v in row] for row in steps],
        }, f)
    print("saved to", out, "argmax", logits.argmax(-1).tolist())
    print("decode vs full max diff", max(abs(a - b) for s, r in zip(steps, logprobs[split:].tolist())
                                          for a, b in zip(s, r)))


def main(root):
    torch.set_num_threads(2)
    which = sys.argv[2:] or ["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe"]
    if "qwen3_5" in which:
        cfg = Qwen3_5TextConfig(**CONFIG, attn_implementation="eager")
        gen = torch.Generator().manual_seed(20261206)
        model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
        randomise(model, gen)
        save(model, cfg, os.path.join(root, "qwen3_5"))
    if "qwen3_5_moe" in which:
        cfg = Qwen3_5MoeTextConfig(**MOE, attn_implementation="eager", experts_implementation="eager")
        gen = torch.Generator().manual_seed(20261208)
        model = Qwen3_5MoeForCausalLM(cfg).to(torch.float32).eval()
        randomise(model, gen)
        gaps = []
        hooks = [m.register_forward_hook(lambda mod, inp, out: gaps.append(
                     (lambda t: (t[..., 1] - t[..., 2]).min().item())(
                         torch.topk((out[0] if isinstance(out, tuple) else out).double(), 3, dim=-1).values)))
                 for n, m in model.named_modules() if n.endswith("mlp.gate")]
        with torch.no_grad():
            model(torch.tensor([PROMPT]), use_cache=False)
        for h in hooks:
            h.remove()
        print("qwen3_5_moe routing margin", min(gaps))
        save(model, cfg, os.path.join(root, "qwen3_5_moe"))
    if "qwen3_next" in which:
        cfg = Qwen3NextConfig(**NEXT, attn_implementation="eager", experts_implementation="eager")
        gen = torch.Generator().manual_seed(20261210)
        model = Qwen3NextForCausalLM(cfg).to(torch.float32).eval()
        randomise(model, gen)
        save(model, cfg, os.path.join(root, "qwen3_next"))
    if "lfm2_moe" in which:
        cfg = Lfm2MoeConfig(**LFM2_MOE, attn_implementation="eager", experts_implementation="eager")
        gen = torch.Generator().manual_seed(20261209)
        model = Lfm2MoeForCausalLM(cfg).to(torch.float32).eval()
        randomise(model, gen, lfm2=True)
        with torch.no_grad():  # (a buffer, not a parameter)
            for n, b in model.named_buffers():
                if n.endswith("expert_bias"):
                    b.copy_(0.3 * torch.randn(b.shape, generator=gen))
        save(model, cfg, os.path.join(root, "lfm2_moe"))
    if "lfm2" in which:
        cfg = Lfm2Config(**LFM2, attn_implementation="eager")
        gen = torch.Generator().manual_seed(20261207)
        model = Lfm2ForCausalLM(cfg).to(torch.float32).eval()
        randomise(model, gen, lfm2=True)
        save(model, cfg, os.path.join(root, "lfm2"))


if __name__ == "__main__":
    main(sys.argv[1])
