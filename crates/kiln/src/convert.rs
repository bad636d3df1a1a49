//! `kiln convert`: a GGUF file to a Hugging Face safetensors directory
//! (config, generation config, tokenizer with chat template, weights).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use kiln_formats::{GgufWeights, SafetensorsDtype};
use kiln_text::Tokenizer;
use serde_json::json;

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// The GGUF file to convert.
    pub input: PathBuf,
    /// The directory to write.
    pub output: PathBuf,
    /// Weight dtype on disk: f32 (exact), bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

pub fn parse_dtype(s: &str) -> Result<SafetensorsDtype> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" => SafetensorsDtype::F32,
        "bf16" | "bfloat16" => SafetensorsDtype::BF16,
        "f16" | "float16" => SafetensorsDtype::F16,
        other => bail!("unknown dtype {other:?} (f32, bf16, f16)"),
    })
}

pub fn run(a: ConvertArgs) -> Result<()> {
    convert(&a.input, &a.output, parse_dtype(&a.dtype)?)?;
    eprintln!("wrote {}", a.output.display());
    Ok(())
}

/// Convert `input` (GGUF) to a Hugging Face directory at `output`.
pub fn convert(
    input: &std::path::Path,
    output: &std::path::Path,
    dtype: SafetensorsDtype,
) -> Result<()> {
    let weights = GgufWeights::open(input)?;
    let config = weights.hf_config()?;
    let tokenizer = Tokenizer::from_gguf(weights.metadata())?;
    let gen = json!({
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
    });
    kiln_formats::write_hf_dir(output, &config, Some(&gen), &weights, dtype)?;
    tokenizer.save_hf(output)?;
    Ok(())
}
