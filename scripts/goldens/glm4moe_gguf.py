"""The random GLM-4.5 checkpoint (`tests/data/moe/glm4_moe`, made by
`glm4_moe_random.py`) as a `glm4moe` GGUF file laid out as llama.cpp's
converter writes one.

Tensor names come from the `gguf` package's own map (`TensorNameMap` for
`MODEL_ARCH.GLM4_MOE`, after the converter's rename of
`e_score_correction_bias` to `e_score_correction.bias`), so they are
llama.cpp's, not this project's guess: experts stacked one 3-D tensor a
projection (`ffn_*_exps`, experts outermost), the router's selection bias
`exp_probs_b.bias`, the shared expert `ffn_*_shexp`, the MTP layer under
`blk.3.nextn.*` with `block_count` counting it (`nextn_predict_layers` 1),
RoPE's rotated width as `rope.dimension_count`. Every tensor is F32, so the
file holds the checkpoint's values and its golden (`glm4_moe/golden.json`,
the model's and the MTP layer's log-softmax) applies unchanged.

Run once with the `gguf` package, torch and safetensors; the output is
committed and tests never run this:

    PYTHONPATH=<site-packages> python3 scripts/goldens/glm4moe_gguf.py crates/kiln-models/tests/data/moe
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


def main(root):
    src = os.path.join(root, "glm4_moe")
    cfg = json.load(open(os.path.join(src, "config.json")))
    sd = load_file(os.path.join(src, "model.safetensors"))
    layers, nextn = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    names = gguf.TensorNameMap(MODEL_ARCH.GLM4_MOE, layers + nextn)
    out = os.path.join(root, "gguf", "glm4moe.gguf")
    w = gguf.GGUFWriter(out, "glm4moe")
    head_dim = cfg["head_dim"]
    w.add_block_count(layers + nextn)
    w.add_nextn_predict_layers(nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    written = set()
    experts = {}
    for name, t in sd.items():
        # Experts one by one in the checkpoint; llama.cpp stacks them.
        parts = name.split(".")
        if ".mlp.experts." in name:
            layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
            experts.setdefault((layer, proj), {})[e] = t
            continue
        hf = name.replace("e_score_correction_bias", "e_score_correction.bias")
        g = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        w.add_tensor(g, t.astype(np.float32))
        written.add(name)
    add_stacked_experts(w, names, experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", out, len(written), "tensors and", len(experts), "expert stacks")


if __name__ == "__main__":
    main(sys.argv[1])
