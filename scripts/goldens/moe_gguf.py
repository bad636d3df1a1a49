"""Random Mixture-of-Experts GGUF files, laid out as llama.cpp's converter
writes them, and what transformers computes on the same weights.

Makes `crates/kiln-models/tests/data/moe/gguf/{qwen3moe,qwen2moe,mixtral}.gguf`
and their `*.json` goldens: a random model of each family whose expert
tensors are stored as llama.cpp stores them, one 3-D tensor a projection
(`blk.N.ffn_{gate,up,down}_exps.weight`, experts outermost) in Q8_0, the
router (`ffn_gate_inp`) and the rest in F32, the shared expert and its gate
(`ffn_*_shexp`, `ffn_gate_inp_shexp`) for qwen2moe, and Mixtral as the
`llama` architecture with `expert_count` and q/k rows permuted as llama.cpp
permutes them. The golden is transformers' log-softmax (float64, eager) of
the model with the experts' dequantized Q8_0 values, so the file and the
reference hold the same numbers.

Run once with transformers >= 5.24, CPU torch and the `gguf` package; the
outputs are committed and tests never run this:

    PYTHONPATH=<site-packages> python3 scripts/goldens/moe_gguf.py crates/kiln-models/tests/data/moe/gguf
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
import gguf
from gguf import GGMLQuantizationType as Q
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = {
    "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

CASES = {
    "qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                 {"intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "head_dim": 16}),
    "qwen2moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                 {"intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                  "norm_topk_prob": False}),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "rope_theta": 1e6}),
}

PROMPT = [1, 17, 93, 5, 64, 11, 33, 8, 77, 90, 45, 3, 88, 19, 56, 60]


def randomise(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") and p.shape[0] > 1:
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def q8(a):
    """Q8_0 bytes of `a` and the values they hold."""
    data = gguf.quants.quantize(a.astype(np.float32), Q.Q8_0)
    return data, gguf.quants.dequantize(data, Q.Q8_0).reshape(a.shape)


def llama_permute(w, n_head):
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write(case, cfg, model, path):
    arch = "llama" if case == "mixtral" else case
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_local_experts if case == "mixtral" else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if case != "mixtral":
        w.add_key_length(cfg.head_dim if case == "qwen3moe" else cfg.hidden_size // cfg.num_attention_heads)
        w.add_value_length(cfg.head_dim if case == "qwen3moe" else cfg.hidden_size // cfg.num_attention_heads)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if case == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    deq = {}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}"
        b = f"blk.{l}"
        w.add_tensor(f"{b}.attn_norm.weight", sd[f"{p}.input_layernorm.weight"])
        w.add_tensor(f"{b}.ffn_norm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        for hf, g in [("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")]:
            t = sd[f"{p}.self_attn.{hf}.weight"]
            if case == "mixtral" and hf in ("q_proj", "k_proj"):
                t = llama_permute(t, cfg.num_attention_heads if hf == "q_proj" else cfg.num_key_value_heads)
            w.add_tensor(f"{b}.{g}.weight", t)
            if f"{p}.self_attn.{hf}.bias" in sd:
                w.add_tensor(f"{b}.{g}.bias", sd[f"{p}.self_attn.{hf}.bias"])
        for n in ("q_norm", "k_norm"):
            if f"{p}.self_attn.{n}.weight" in sd:
                w.add_tensor(f"{b}.attn_{n}.weight", sd[f"{p}.self_attn.{n}.weight"])
        # transformers holds the experts fused in memory: gate_up_proj
        # [E, 2i, h] (gate rows first) and down_proj [E, h, i].
        moe = f"{p}.mlp"
        w.add_tensor(f"{b}.ffn_gate_inp.weight", sd[f"{moe}.gate.weight"])
        gate_up = sd[f"{moe}.experts.gate_up_proj"]
        i = gate_up.shape[1] // 2
        gate, values_g = q8(gate_up[:, :i])
        up, values_u = q8(gate_up[:, i:])
        down, values_d = q8(sd[f"{moe}.experts.down_proj"])
        for g, data in [("gate", gate), ("up", up), ("down", down)]:
            w.add_tensor(f"{b}.ffn_{g}_exps.weight", data, raw_dtype=Q.Q8_0)
        deq[f"{moe}.experts.gate_up_proj"] = np.concatenate([values_g, values_u], axis=1)
        deq[f"{moe}.experts.down_proj"] = values_d
        if case == "qwen2moe":
            for hf, g in [("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")]:
                data, values = q8(sd[f"{moe}.shared_expert.{hf}.weight"])
                w.add_tensor(f"{b}.ffn_{g}_shexp.weight", data, raw_dtype=Q.Q8_0)
                deq[f"{moe}.shared_expert.{hf}.weight"] = values
            # llama.cpp keeps the shared expert's gate as one vector.
            w.add_tensor(f"{b}.ffn_gate_inp_shexp.weight", sd[f"{moe}.shared_expert_gate.weight"].reshape(-1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


def routing_margin(model, ids, top_k):
    """The smallest gap, over layers and tokens, between the k-th and the
    (k+1)-th router logit: f32 rounding must not be able to flip a choice."""
    gaps = []

    def hook(mod, inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        top = torch.topk(logits.double(), top_k + 1, dim=-1).values
        gaps.append((top[..., top_k - 1] - top[..., top_k]).min().item())

    hooks = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return min(gaps)


def main(out_root):
    torch.set_num_threads(2)
    os.makedirs(out_root, exist_ok=True)
    for case, (cfg_cls, model_cls, over) in CASES.items():
        cfg = cfg_cls(**{**COMMON, **over}, attn_implementation="eager", experts_implementation="eager")
        gen = torch.Generator().manual_seed(20261206)
        model = model_cls(cfg).to(torch.float32).eval()
        randomise(model, gen)
        deq = write(case, cfg, model, os.path.join(out_root, f"{case}.gguf"))
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, v in deq.items():
                params[name].copy_(torch.from_numpy(np.ascontiguousarray(v)))
        model = model.to(torch.float64)
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0]
        logprobs = torch.log_softmax(logits, dim=-1)
        margin = routing_margin(model, ids, cfg.num_experts_per_tok)
        with open(os.path.join(out_root, f"{case}.json"), "w") as f:
            json.dump({
                "transformers": transformers.__version__, "torch": torch.__version__,
                "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "0.19",
                "prompt": PROMPT,
                "min_routing_margin": margin,
                "logprobs": [[round(v, 7) for v in row] for row in logprobs.tolist()],
            }, f)
        print(case, "routing margin", margin, "argmax", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main(sys.argv[1])
