"""The random DeepSeek checkpoints (`tests/data/moe/deepseek_v3`,
`deepseek_v2`, `deepseek_v2_grouped`, made by `deepseek_random.py`) as
`deepseek2` GGUF files laid out as llama.cpp's converter writes them.

Tensor names come from the `gguf` package's own map (`TensorNameMap` for
`MODEL_ARCH.DEEPSEEK2`); the converter's transforms, as llama.cpp's
`convert_hf_to_gguf.py` documents them: `kv_b_proj` split per head into
`attn_k_b` (the key rows, transposed: `[heads, kv_lora_rank, nope]`) and
`attn_v_b` (`[heads, value, kv_lora_rank]`) for its absorbed attention;
experts stacked one 3-D tensor a projection; MTP layers left out; the
metadata of that MQA form (one KV head, `key_length` = latent + rope,
`value_length` = latent, the model's own sizes as `key_length_mla` /
`value_length_mla`), sigmoid or softmax gating, groups, and YaRN's
`mscale_all_dim` as `yarn_log_multiplier` = a tenth of it. Every tensor is
F32, so each file holds its checkpoint's values and the checkpoint's golden
(its `golden.json` logprobs) applies unchanged.

`deepseek_v2_legacy.gguf` is the V2 checkpoint as converters wrote it before
the absorbed layout (`attn_kv_b` whole, the model's own KV heads and
lengths).

Run once with the `gguf` package and safetensors; the outputs are committed
and tests never run this:

    PYTHONPATH=<site-packages> python3 scripts/goldens/deepseek2_gguf.py crates/kiln-models/tests/data/moe
"""

import json
import os
import sys

import numpy as np
import gguf
from gguf.constants import MODEL_ARCH
from safetensors.numpy import load_file

sys.path.insert(0, os.path.dirname(__file__))
from common import add_stacked_experts  # noqa: E402

CASES = ["deepseek_v3", "deepseek_v2", "deepseek_v2_grouped"]


def write(root, case, legacy=False):
    """`legacy`: as converters wrote files before llama.cpp's absorbed
    attention (`attn_kv_b` whole; the KV heads and key/value lengths the
    model's own, no `*_length_mla`)."""
    src = os.path.join(root, case)
    cfg = json.load(open(os.path.join(src, "config.json")))
    sd = load_file(os.path.join(src, "model.safetensors"))
    layers = cfg["num_hidden_layers"]
    v3 = cfg["model_type"] == "deepseek_v3"
    names = gguf.TensorNameMap(MODEL_ARCH.DEEPSEEK2, layers)
    out = os.path.join(root, "gguf", f"{case}{'_legacy' if legacy else ''}.gguf")
    w = gguf.GGUFWriter(out, "deepseek2")
    heads, c = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, value = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads if legacy else 1)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(c)
    if legacy:
        w.add_key_length(nope + rope)
        w.add_value_length(value)
    else:
        w.add_key_length(c + rope)
        w.add_value_length(c)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(value)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if v3 and cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.get("n_group", 1) > 1:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_rope_dimension_count(rope)
    rp = cfg["rope_parameters"]
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
        w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    experts = {}
    for name, t in sd.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= layers:
            continue  # the MTP layer: llama.cpp's converter leaves it out
        if ".mlp.experts." in name:
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = t
            continue
        if name.endswith("kv_b_proj.weight") and not legacy:
            kv_b = t.reshape(heads, nope + value, c)
            k_b = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))
            v_b = np.ascontiguousarray(kv_b[:, nope:, :])
            for part, data in (("k_b_proj", k_b), ("v_b_proj", v_b)):
                g = names.get_name(name.replace("kv_b_proj", part), try_suffixes=(".weight",))
                assert g is not None, name
                w.add_tensor(g, data.astype(np.float32))
            continue
        hf = name.replace("e_score_correction_bias", "e_score_correction.bias")
        g = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        w.add_tensor(g, t.astype(np.float32))
    add_stacked_experts(w, names, experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", out)


def main(root):
    for case in CASES:
        write(root, case)
    write(root, "deepseek_v2", legacy=True)


if __name__ == "__main__":
    main(sys.argv[1])
