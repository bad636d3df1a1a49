//! LoRA adapters from PEFT directories (`adapter_config.json` and
//! `adapter_model.safetensors`), checked against the model they adapt.
//!
//! What is read: `r`, `lora_alpha`, `use_rslora` (scale `alpha / √r`
//! instead of `alpha / r`), and every `lora_A` / `lora_B` pair in the
//! weights, named `base_model.model.<module>.lora_A.weight` (the module as
//! the base model's weights name it). What is refused, by name: DoRA,
//! trained biases, `modules_to_save`, `fan_in_fan_out`, per-module rank or
//! alpha patterns, layer replication, trainable tokens, QALoRA, aLoRA,
//! embedding adapters, and modules the model's family does not adapt
//! ([`crate::CausalLm::lora_targets`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

use kiln_tensor::{LoraAdapter, LoraProj};
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::CausalLm;

/// A distinct id for every adapter loaded in this process.
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

fn bad(path: &Path, what: impl Into<String>) -> ModelError {
    ModelError::Config {
        key: path.display().to_string(),
        what: what.into(),
    }
}

/// The adapter in PEFT directory `dir`, named `name`, on `model`'s backend.
pub fn load_peft(dir: &Path, name: &str, model: &dyn CausalLm) -> Result<LoraAdapter> {
    let backend = model.backend();
    if !backend.supports_lora() {
        return Err(bad(
            dir,
            format!(
                "the {} backend does not run LoRA adapters yet",
                backend.name()
            ),
        ));
    }
    let targets = model.lora_targets();
    if targets.is_empty() {
        return Err(bad(
            dir,
            format!(
                "the {} family does not run LoRA adapters yet",
                model.config().model_type
            ),
        ));
    }
    let config_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| bad(&config_path, format!("cannot read: {e}")))?;
    let c: Value =
        serde_json::from_str(&text).map_err(|e| bad(&config_path, format!("not JSON: {e}")))?;
    let (rank, scale) = scale_of(&c, &config_path)?;
    let weights_path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&weights_path).map_err(|e| {
        bad(
            &weights_path,
            format!("cannot read ({e}); Kiln reads adapters saved as safetensors"),
        )
    })?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(&weights_path, format!("not safetensors: {e}")))?;
    let mut pairs: HashMap<String, [Option<(Vec<usize>, Vec<f32>)>; 2]> = HashMap::new();
    for (key, view) in st.tensors() {
        let Some(rest) = key.strip_prefix("base_model.model.") else {
            return Err(bad(&weights_path, format!("{key}: not a PEFT LoRA weight")));
        };
        let (module, which) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
            (m, 0)
        } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
            (m, 1)
        } else {
            return Err(bad(
                &weights_path,
                format!("{key}: Kiln runs lora_A/lora_B weights only (no biases, embeddings or saved modules)"),
            ));
        };
        let data = to_f32(&view).ok_or_else(|| {
            bad(
                &weights_path,
                format!("{key}: dtype {:?} is not F32, F16 or BF16", view.dtype()),
            )
        })?;
        pairs.entry(module.to_string()).or_default()[which] = Some((view.shape().to_vec(), data));
    }
    if pairs.is_empty() {
        return Err(bad(&weights_path, "no LoRA weights"));
    }
    let mut projs = HashMap::new();
    let mut num_bytes = 0u64;
    for (module, [a, b]) in pairs {
        let (Some((sa, a)), Some((sb, b))) = (a, b) else {
            return Err(bad(
                &weights_path,
                format!("{module}: lora_A and lora_B must come in pairs"),
            ));
        };
        let target = targets.iter().find(|t| t.name == module).ok_or_else(|| {
            bad(
                &weights_path,
                format!(
                    "{module} is not a projection this model adapts (it adapts the attention and MLP projections of each layer)"
                ),
            )
        })?;
        let r = rank;
        if sa != [r, target.in_dim] || sb != [target.out_dim, r] {
            return Err(bad(
                &weights_path,
                format!(
                    "{module}: lora_A {sa:?} and lora_B {sb:?} are not rank {r} (`r`) of a [{} -> {}] projection",
                    target.in_dim, target.out_dim
                ),
            ));
        }
        let proj = LoraProj {
            a: backend.upload(&sa, &a)?,
            b: backend.upload(&sb, &b)?,
            scale,
        };
        // As the backend holds them (bf16 on CUDA, f32 on the CPU).
        num_bytes += (proj.a.num_elements() * proj.a.dtype().size_in_bytes()
            + proj.b.num_elements() * proj.b.dtype().size_in_bytes()) as u64;
        projs.insert(module, proj);
    }
    Ok(LoraAdapter {
        name: name.to_string(),
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        projs,
        num_bytes,
    })
}

/// Bytes the adapter in PEFT directory `dir` takes once loaded (its
/// matrices as f32), read from the weights file's header alone.
pub fn peft_bytes(dir: &Path) -> Result<u64> {
    let path = dir.join("adapter_model.safetensors");
    let mut f = std::fs::File::open(&path).map_err(|e| bad(&path, format!("cannot read: {e}")))?;
    let mut len = [0u8; 8];
    std::io::Read::read_exact(&mut f, &mut len).map_err(|e| bad(&path, e.to_string()))?;
    let n = u64::from_le_bytes(len);
    if n > 64 << 20 {
        return Err(bad(&path, "not safetensors (header too large)"));
    }
    let mut header = vec![0u8; n as usize];
    std::io::Read::read_exact(&mut f, &mut header).map_err(|e| bad(&path, e.to_string()))?;
    let v: Value =
        serde_json::from_slice(&header).map_err(|e| bad(&path, format!("not safetensors: {e}")))?;
    let elements: u64 = v
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| *k != "__metadata__")
        .filter_map(|(_, t)| {
            t.get("shape")?
                .as_array()
                .map(|s| s.iter().filter_map(Value::as_u64).product::<u64>())
        })
        .sum();
    Ok(4 * elements)
}

/// The rank and the scale of every module (`alpha / r`, or `alpha / √r`
/// with rsLoRA), after refusing what Kiln does not run.
fn scale_of(c: &Value, path: &Path) -> Result<(usize, f32)> {
    let flag = |k: &str| c.get(k).and_then(Value::as_bool) == Some(true);
    if let Some(t) = c.get("peft_type").and_then(Value::as_str) {
        if t != "LORA" {
            return Err(bad(
                path,
                format!("peft_type {t:?}: Kiln runs LORA adapters"),
            ));
        }
    }
    for key in ["use_dora", "fan_in_fan_out", "lora_bias", "use_qalora"] {
        if flag(key) {
            return Err(bad(path, format!("`{key}` is not supported")));
        }
    }
    for key in [
        "layer_replication",
        "trainable_token_indices",
        "target_parameters",
        "alora_invocation_tokens",
    ] {
        if c.get(key).is_some_and(|v| !v.is_null()) {
            return Err(bad(path, format!("`{key}` is not supported")));
        }
    }
    if let Some(bias) = c.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(bad(
                path,
                format!("bias {bias:?}: Kiln runs adapters without trained biases"),
            ));
        }
    }
    if c.get("modules_to_save").is_some_and(|v| !v.is_null()) {
        return Err(bad(path, "`modules_to_save` is not supported"));
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if c.get(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(bad(
                path,
                format!("`{key}` (per-module ranks) is not supported"),
            ));
        }
    }
    let r = c
        .get("r")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0 && r <= 4096)
        .ok_or_else(|| bad(path, "`r` must be an integer from 1 to 4096"))? as usize;
    let alpha = c
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .map(|a| a as f32)
        .unwrap_or(8.0);
    let scale = if flag("use_rslora") {
        alpha / (r as f32).sqrt()
    } else {
        alpha / r as f32
    };
    Ok((r, scale))
}

fn to_f32(view: &safetensors::tensor::TensorView<'_>) -> Option<Vec<f32>> {
    let d = view.data();
    Some(match view.dtype() {
        safetensors::Dtype::F32 => d
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        safetensors::Dtype::F16 => d
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::BF16 => d
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}
