//! Random-weight checkpoints: config presets and a [`WeightSource`] that
//! makes deterministic normal(0, 0.02) weights (norms scaling by 1 + normal(0, 0.1)) for every tensor a
//! family expects. Used for fast tests and large-shape benchmarks.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use kiln_formats::{FormatError, HostTensor, StoredTensor, WeightSource};
use serde_json::{json, Value};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::registry::tensor_shapes;

/// Config presets. The vocabulary size is filled from the tokenizer.
pub fn preset(name: &str) -> Result<Value> {
    let common = json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": false, "torch_dtype": "bfloat16"});
    let shape = match name {
        "tiny" => json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "tie_word_embeddings": true}),
        "smollm2-135m" => {
            json!({"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": true})
        }
        "llama3-8b" => {
            json!({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": false})
        }
        other => {
            return Err(ModelError::Config {
                key: "preset".into(),
                what: format!("unknown preset {other:?} (tiny, smollm2-135m, llama3-8b)"),
            })
        }
    };
    Ok(merge(common, &shape))
}

pub fn merge(mut base: Value, over: &Value) -> Value {
    if let (Some(b), Some(o)) = (base.as_object_mut(), over.as_object()) {
        for (k, v) in o {
            b.insert(k.clone(), v.clone());
        }
    }
    base
}

/// A weight source that makes deterministic random tensors on demand.
pub struct RandomWeights {
    path: PathBuf,
    shapes: Vec<(String, Vec<usize>)>,
    seed: u64,
    /// The mean of stored norm weights: 1 where the model multiplies by the
    /// weight, 0 where it multiplies by `1 + w` (Gemma), so either way a
    /// norm scales by about 1 and deep random checkpoints stay well
    /// conditioned enough for a bf16 oracle.
    norm_mean: f64,
    /// Per-head q and k norm weights about `head_dim^-1/4` (Gemma 4, whose
    /// attention has scale 1): scores of about unit spread, as trained
    /// models keep them. At 1 they would spread by `sqrt(head_dim)`, and a
    /// softmax that sharp turns bf16 rounding into different winners.
    unit_scale_attention: bool,
    /// The spread of projection matrices (`*proj.weight`) instead of 0.02
    /// ([`RandomWeights::with_proj_std`]).
    proj_std: Option<f64>,
}

impl RandomWeights {
    /// Random weights for every tensor `config` needs, from `seed`.
    pub fn new(config: &ModelConfig, seed: u64) -> Result<Self> {
        Ok(RandomWeights {
            path: PathBuf::from("<random>"),
            shapes: tensor_shapes(config)?,
            seed,
            norm_mean: match config.family {
                crate::families::FamilyConfig::Gemma3(_) => 0.0,
                _ => 1.0,
            },
            unit_scale_attention: matches!(config.family, crate::families::FamilyConfig::Gemma4(_)),
            proj_std: None,
        })
    }

    /// Projection matrices drawn with spread `std` (0.01 keeps a deep
    /// random network out of the chaotic regime where bf16 and f32 logits
    /// part: the 8B benchmark shape's setting).
    pub fn with_proj_std(mut self, std: f64) -> Self {
        self.proj_std = Some(std);
        self
    }
}

/// splitmix64: a small, well-mixed generator for reproducible weights.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// `n` normal(mean, std) values from the splitmix64 stream at `s0`, two a
/// Box–Muller pair. splitmix64 is a counter (the state before call `i` is
/// `s0 + i·GOLDEN`), so chunks of the stream are made in parallel: the
/// same values one pass makes.
fn normals(s0: u64, n: usize, mean: f64, std: f64) -> Vec<f32> {
    const CHUNK: usize = 1 << 16;
    let mut data = vec![0f32; n];
    data.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let mut state = s0.wrapping_add((ci as u64 * CHUNK as u64).wrapping_mul(GOLDEN));
            for pair in chunk.chunks_mut(2) {
                let u1 = ((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let t = 2.0 * std::f64::consts::PI * u2;
                pair[0] = (mean + r * t.cos()) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (mean + r * t.sin()) as f32;
                }
            }
        });
    data
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl WeightSource for RandomWeights {
    fn path(&self) -> &Path {
        &self.path
    }

    fn tensors(&self) -> Vec<StoredTensor> {
        self.shapes
            .iter()
            .map(|(n, s)| StoredTensor {
                name: n.clone(),
                shape: s.clone(),
                dtype: "F32".into(),
                num_bytes: 4 * s.iter().product::<usize>() as u64,
            })
            .collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.shapes.iter().any(|(n, _)| n == name)
    }

    fn load_f32(&self, name: &str) -> Result<HostTensor, FormatError> {
        let shape = self
            .shapes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.clone())
            .ok_or_else(|| FormatError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        let n: usize = shape.iter().product();
        // Norm weights (and Gemma 4's layer scalars) scale by 1 + N(0, 0.1):
        // close to the usual init, but not all equal, so a checkpoint
        // exercises how each is applied.
        let qk_norm = name.ends_with("q_norm.weight") || name.ends_with("k_norm.weight");
        let (mean, std) = if qk_norm && self.unit_scale_attention {
            let m = (n as f64).powf(-0.25);
            (m, 0.1 * m)
        } else if name.ends_with("norm.weight") {
            (self.norm_mean, 0.1)
        } else if name.ends_with("layer_scalar") {
            (1.0, 0.1)
        } else {
            (0.0, 0.02)
        };
        let std = if name.ends_with("proj.weight") {
            self.proj_std.unwrap_or(std)
        } else {
            std
        };
        let data = normals(self.seed ^ name_hash(name), n, mean, std);
        Ok(HostTensor::new(shape, data))
    }
}

impl RandomWeights {
    /// How many tensors the checkpoint has.
    pub fn num_tensors(&self) -> usize {
        self.shapes.len()
    }
}

#[cfg(test)]
mod normals_tests {
    use super::*;

    #[test]
    fn parallel_chunks_continue_the_one_stream() {
        // One pass over the stream, as the generator was first written.
        let (s0, n) = (0x1234_5678_9abc_def0u64, 3 * (1 << 16) + 5);
        let mut state = s0;
        let mut want = Vec::with_capacity(n);
        while want.len() < n {
            let u1 = ((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            let u2 = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            let r = (-2.0 * u1.ln()).sqrt() * 0.02;
            let t = 2.0 * std::f64::consts::PI * u2;
            want.push((r * t.cos()) as f32);
            if want.len() < n {
                want.push((r * t.sin()) as f32);
            }
        }
        assert_eq!(normals(s0, n, 0.0, 0.02), want);
    }
}
