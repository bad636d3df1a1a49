//! `kiln convert`: a GGUF file to a Hugging Face safetensors directory
//! (config, generation config, tokenizer with chat template, weights).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use kiln_formats::SafetensorsDtype;

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
    kiln_engine::convert::gguf_to_hf_dir(&a.input, &a.output, parse_dtype(&a.dtype)?)?;
    eprintln!("wrote {}", a.output.display());
    Ok(())
}
