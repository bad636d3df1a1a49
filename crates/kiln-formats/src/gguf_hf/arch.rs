//! The config keys of the GGUF architectures whose metadata says more
//! than the shared keys ([`super::hf_config`]): gpt-oss, GLM-4.5
//! (`glm4moe`) and DeepSeek-V2/V3 (`deepseek2`).

use serde_json::{json, Map, Value};

use super::decimal_f64;
use crate::error::{FormatError, Result};
use crate::gguf::{GgufFile, GgufMetadata};

/// The keys of DeepSeek-style routing both `deepseek2` and `glm4moe` files
/// keep: shared experts, leading dense layers, expert groups.
pub(super) fn deepseek_moe_keys(
    md: &GgufMetadata,
    c: &mut Map<String, Value>,
    k: &dyn Fn(&str) -> String,
) -> Result<()> {
    for (key, gkey) in [
        ("n_shared_experts", "expert_shared_count"),
        ("first_k_dense_replace", "leading_dense_block_count"),
        ("n_group", "expert_group_count"),
        ("topk_group", "expert_group_used_count"),
    ] {
        if let Some(v) = md.u64(&k(gkey))? {
            c.insert(key.into(), json!(v));
        }
    }
    Ok(())
}

/// DeepSeek-V2/V3's keys: the latent attention's sizes (a file written for
/// llama.cpp's absorbed form gives them as `key_length_mla` and
/// `value_length_mla`; an older one's `key_length` / `value_length` are the
/// model's own), its routing, and YaRN (llama.cpp keeps `mscale_all_dim`
/// as a log multiplier of a tenth of it).
pub(super) fn deepseek2_config(
    md: &GgufMetadata,
    c: &mut Map<String, Value>,
    file: &GgufFile,
    model_type: &str,
    n_head: u64,
    head_dim: u64,
) -> Result<()> {
    let k = |s: &str| format!("deepseek2.{s}");
    let req = |s: &str| md.req_u64(&k(s));
    let rope = req("rope.dimension_count")?;
    let (qk, value) = match md.u64(&k("attention.key_length_mla"))? {
        Some(qk) => (qk, req("attention.value_length_mla")?),
        None => (head_dim, req("attention.value_length")?),
    };
    if rope > qk {
        return Err(FormatError::Metadata {
            path: md.path.clone(),
            key: k("rope.dimension_count"),
            what: format!("{rope} rotary dims of a {qk}-wide query head"),
        });
    }
    c.insert("qk_rope_head_dim".into(), json!(rope));
    c.insert("qk_nope_head_dim".into(), json!(qk - rope));
    c.insert("v_head_dim".into(), json!(value));
    c.insert("head_dim".into(), json!(rope));
    c.insert("kv_lora_rank".into(), json!(req("attention.kv_lora_rank")?));
    if let Some(r) = md.u64(&k("attention.q_lora_rank"))? {
        c.insert("q_lora_rank".into(), json!(r));
    }
    // The model's heads all keep their own keys and values in transformers'
    // terms; the file's one KV head is llama.cpp's absorbed form.
    c.insert("num_key_value_heads".into(), json!(n_head));
    if let Some(e) = md.u64(&k("expert_count"))? {
        c.insert("n_routed_experts".into(), json!(e));
    }
    let groups = md.u64(&k("expert_group_count"))?.unwrap_or(1);
    deepseek_moe_keys(md, c, &k)?;
    if model_type == "deepseek_v2" {
        let method = if groups > 1 {
            "group_limited_greedy"
        } else {
            "greedy"
        };
        c.insert("topk_method".into(), json!(method));
    }
    c.insert(
        "routed_scaling_factor".into(),
        json!(decimal_f64(md, &k("expert_weights_scale"))?.unwrap_or(1.0)),
    );
    if md.str(&k("rope.scaling.type"))? == Some("yarn") {
        let mul = decimal_f64(md, &k("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0);
        let mut y = json!({
            "rope_type": "yarn",
            "factor": decimal_f64(md, &k("rope.scaling.factor"))?.unwrap_or(1.0),
            "original_max_position_embeddings":
                md.u64(&k("rope.scaling.original_context_length"))?.unwrap_or(4096),
            "mscale": mul / 0.1,
            "mscale_all_dim": mul / 0.1,
        });
        for (key, gkey) in [
            ("beta_fast", "rope.scaling.yarn_beta_fast"),
            ("beta_slow", "rope.scaling.yarn_beta_slow"),
        ] {
            if let Some(b) = decimal_f64(md, &k(gkey))? {
                y[key] = json!(b);
            }
        }
        c.insert("rope_scaling".into(), y);
    }
    let has = |name: &str| file.tensors.iter().any(|t| t.name == name);
    c.insert(
        "attention_bias".into(),
        json!(has("blk.0.attn_kv_a_mqa.bias")),
    );
    c.insert(
        "num_nextn_predict_layers".into(),
        json!(md.u64(&k("nextn_predict_layers"))?.unwrap_or(0)),
    );
    Ok(())
}

/// GLM-4.5's keys: the DeepSeek-style routing (sigmoid gating, shared
/// experts, leading dense layers, the weights' scale, expert groups), the
/// rotated share of each head, the biases and QK-norm the tensors show,
/// and the MTP layers.
pub(super) fn glm4moe_config(
    md: &GgufMetadata,
    c: &mut Map<String, Value>,
    file: &GgufFile,
    head_dim: u64,
    nextn: u64,
) -> Result<()> {
    let k = |s: &str| format!("glm4moe.{s}");
    if let Some(f) = md.u64(&k("expert_gating_func"))? {
        // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
        if f != 2 {
            return Err(FormatError::Metadata {
                path: md.path.clone(),
                key: k("expert_gating_func"),
                what: format!("{f} (GLM-4.5 routes by sigmoid, 2)"),
            });
        }
    }
    if let Some(e) = md.u64(&k("expert_count"))? {
        c.insert("n_routed_experts".into(), json!(e));
    }
    deepseek_moe_keys(md, c, &k)?;
    if let Some(s) = decimal_f64(md, &k("expert_weights_scale"))? {
        c.insert("routed_scaling_factor".into(), json!(s));
    }
    if let Some(r) = md.u64(&k("rope.dimension_count"))? {
        c.insert(
            "partial_rotary_factor".into(),
            json!(r as f64 / head_dim.max(1) as f64),
        );
    }
    let has = |name: &str| file.tensors.iter().any(|t| t.name == name);
    c.insert("attention_bias".into(), json!(has("blk.0.attn_q.bias")));
    c.insert("use_qk_norm".into(), json!(has("blk.0.attn_q_norm.weight")));
    c.insert("num_nextn_predict_layers".into(), json!(nextn));
    Ok(())
}

/// gpt-oss's keys: the experts' size, the sliding window on even layers
/// (llama.cpp's pattern of 2), YaRN, biases.
pub(super) fn gpt_oss_config(
    md: &GgufMetadata,
    c: &mut Map<String, Value>,
    experts: u64,
) -> Result<()> {
    let k = |s: &str| format!("gpt-oss.{s}");
    if let Some(e) = md.u64(&k("expert_feed_forward_length"))? {
        c.insert("intermediate_size".into(), json!(e));
    }
    c.insert("num_local_experts".into(), json!(experts));
    let layers = md.req_u64(&k("block_count"))?;
    c.insert(
        "layer_types".into(),
        json!((0..layers)
            .map(|i| if i % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            })
            .collect::<Vec<_>>()),
    );
    if let Some(w) = md.u64(&k("attention.sliding_window"))? {
        c.insert("sliding_window".into(), json!(w));
    }
    c.insert("attention_bias".into(), json!(true));
    if md.str(&k("rope.scaling.type"))? == Some("yarn") {
        let mut rope = Map::new();
        rope.insert("rope_type".into(), json!("yarn"));
        if let Some(f) = decimal_f64(md, &k("rope.scaling.factor"))? {
            rope.insert("factor".into(), json!(f));
        }
        if let Some(n) = md.u64(&k("rope.scaling.original_context_length"))? {
            rope.insert("original_max_position_embeddings".into(), json!(n));
        }
        rope.insert("beta_fast".into(), json!(32.0));
        rope.insert("beta_slow".into(), json!(1.0));
        rope.insert("truncate".into(), json!(false));
        c.insert("rope_scaling".into(), Value::Object(rope));
    }
    Ok(())
}
