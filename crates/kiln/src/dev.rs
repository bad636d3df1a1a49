//! `kiln dev`: developer tools. `random-checkpoint` writes a Hugging Face
//! safetensors directory with random weights (normal(0, 0.02), norms 1) and
//! a given tokenizer, for fast tests and large-shape benchmarks.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kiln_formats::{FormatError, GgufFile, HostTensor, StoredTensor, WeightSource};
use kiln_models::{tensor_shapes, ModelConfig};
use kiln_text::Tokenizer;
use serde_json::{json, Value};

#[derive(Subcommand, Debug)]
pub enum DevCommand {
    /// Write a safetensors checkpoint with random weights.
    RandomCheckpoint(RandomArgs),
}

#[derive(Args, Debug)]
pub struct RandomArgs {
    /// A preset shape: tiny, smollm2-135m, llama3-8b.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// A config.json to use instead of a preset (merged over it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where the tokenizer comes from: a GGUF file or a directory with tokenizer.json.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Weight dtype on disk: f32 or bf16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
}

pub fn run(cmd: DevCommand) -> Result<()> {
    match cmd {
        DevCommand::RandomCheckpoint(a) => random_checkpoint(a),
    }
}

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
        other => bail!("unknown preset {other:?} (tiny, smollm2-135m, llama3-8b)"),
    };
    Ok(merge(common, &shape))
}

fn merge(mut base: Value, over: &Value) -> Value {
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
}

impl RandomWeights {
    pub fn new(config: &ModelConfig, seed: u64) -> Result<Self> {
        Ok(RandomWeights {
            path: PathBuf::from("<random>"),
            shapes: tensor_shapes(config)?,
            seed,
        })
    }
}

/// splitmix64: a small, well-mixed generator for reproducible weights.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
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
        let data = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else {
            let mut state = self.seed ^ name_hash(name);
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                // Box–Muller: two normals from two uniforms.
                let u1 = ((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
                let r = (-2.0 * u1.ln()).sqrt() * 0.02;
                let t = 2.0 * std::f64::consts::PI * u2;
                out.push((r * t.cos()) as f32);
                if out.len() < n {
                    out.push((r * t.sin()) as f32);
                }
            }
            out
        };
        Ok(HostTensor::new(shape, data))
    }
}

pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if path.is_dir() {
        Ok(Tokenizer::from_hf_dir(path)?)
    } else {
        let f = GgufFile::open(path)?;
        Ok(Tokenizer::from_gguf(&f.metadata)?)
    }
}

fn random_checkpoint(a: RandomArgs) -> Result<()> {
    let tokenizer = load_tokenizer(&a.tokenizer)
        .with_context(|| format!("tokenizer from {}", a.tokenizer.display()))?;
    let mut config = preset(&a.preset)?;
    if let Some(p) = &a.config {
        let text = std::fs::read_to_string(p).with_context(|| p.display().to_string())?;
        config = merge(
            config,
            &serde_json::from_str(&text).with_context(|| p.display().to_string())?,
        );
    }
    config["vocab_size"] = json!(tokenizer.vocab_size());
    if let Some(b) = tokenizer.bos_id() {
        config["bos_token_id"] = json!(b);
    }
    if let Some(e) = tokenizer.eos_id() {
        config["eos_token_id"] = json!(e);
    }
    let cfg = ModelConfig::from_hf(&config)?;
    let weights = RandomWeights::new(&cfg, a.seed)?;
    let dtype = crate::convert::parse_dtype(&a.dtype)?;
    let gen = json!({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")});
    kiln_formats::write_hf_dir(&a.out, &config, Some(&gen), &weights, dtype)?;
    tokenizer.save_hf(&a.out)?;
    eprintln!(
        "wrote {} ({} tensors)",
        a.out.display(),
        weights.shapes.len()
    );
    Ok(())
}
