"""A random gpt-oss GGUF laid out as llama.cpp's converter writes it, and
what transformers computes on the same weights.

Makes `crates/kiln-models/tests/data/gpt_oss/gguf/gpt-oss.gguf` and its
`golden.json`: the model of `gpt_oss_random.py`'s `plain` checkpoint (same
config and seed) written as the `gpt-oss` GGUF architecture — experts split
into `ffn_{gate,up,down}_exps` (gate/up de-interleaved), stored in MXFP4
blocks by the `gguf` package's own quantizer, their biases as `[experts,
out]` tensors, the router `ffn_gate_inp` with its bias, `attn_sinks`, the
sliding window and YaRN in the metadata — and transformers' log-softmax
(eager, float64) of the model holding the experts' dequantized MXFP4
values (`gguf.quants.dequantize`), so file and reference hold the same
numbers.

    PYTHONPATH=<site-packages with torch, transformers, gguf> \
        python3 scripts/goldens/gpt_oss_gguf.py crates/kiln-models/tests/data/gpt_oss/gguf
"""

import os
import sys

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as Q
from transformers import GptOssConfig, GptOssForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_oss_random import CONFIG, golden, randomise  # noqa: E402


def mxfp4(a):
    data = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), Q.MXFP4)
    return data, gguf.quants.dequantize(data, Q.MXFP4).reshape(a.shape)


def main(out_dir):
    torch.set_num_threads(2)
    os.makedirs(out_dir, exist_ok=True)
    cfg = GptOssConfig(**CONFIG, attn_implementation="eager", experts_implementation="eager")
    gen = torch.Generator().manual_seed(20261207)
    model = GptOssForCausalLM(cfg).to(torch.float32).eval()
    randomise(model, gen)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    rp = cfg.rope_parameters
    w = gguf.GGUFWriter(os.path.join(out_dir, "gpt-oss.gguf"), "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    deq = {}
    i = cfg.intermediate_size
    for l in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{l}", f"blk.{l}"
        w.add_tensor(f"{b}.attn_norm.weight", sd[f"{p}.input_layernorm.weight"])
        w.add_tensor(f"{b}.post_attention_norm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        for hf, g in [("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")]:
            w.add_tensor(f"{b}.{g}.weight", sd[f"{p}.self_attn.{hf}.weight"])
            w.add_tensor(f"{b}.{g}.bias", sd[f"{p}.self_attn.{hf}.bias"])
        w.add_tensor(f"{b}.attn_sinks.weight", sd[f"{p}.self_attn.sinks"])
        w.add_tensor(f"{b}.ffn_gate_inp.weight", sd[f"{p}.mlp.router.weight"])
        w.add_tensor(f"{b}.ffn_gate_inp.bias", sd[f"{p}.mlp.router.bias"])
        gate_up = sd[f"{p}.mlp.experts.gate_up_proj"]  # [E, h, 2i], gate/up interleaved
        bias = sd[f"{p}.mlp.experts.gate_up_proj_bias"]
        gate, gv = mxfp4(gate_up[:, :, 0::2].transpose(0, 2, 1))  # [E, i, h]
        up, uv = mxfp4(gate_up[:, :, 1::2].transpose(0, 2, 1))
        down, dv = mxfp4(sd[f"{p}.mlp.experts.down_proj"].transpose(0, 2, 1))  # [E, h, i]
        for name, data in [("gate", gate), ("up", up), ("down", down)]:
            w.add_tensor(f"{b}.ffn_{name}_exps.weight", data, raw_dtype=Q.MXFP4)
        w.add_tensor(f"{b}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2]))
        w.add_tensor(f"{b}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
        w.add_tensor(f"{b}.ffn_down_exps.bias", sd[f"{p}.mlp.experts.down_proj_bias"])
        new = np.empty_like(gate_up)
        new[:, :, 0::2] = gv.transpose(0, 2, 1)
        new[:, :, 1::2] = uv.transpose(0, 2, 1)
        deq[f"{p}.mlp.experts.gate_up_proj"] = new
        deq[f"{p}.mlp.experts.down_proj"] = dv.transpose(0, 2, 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, v in deq.items():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(v)))
    golden(model, out_dir, "experts dequantized from the file's MXFP4 blocks by gguf-py")


if __name__ == "__main__":
    main(sys.argv[1])
