//! `kiln quantize`: a Hugging Face checkpoint or a float GGUF written as a
//! GGUF in a block format that Kiln and llama.cpp both load.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use kiln_formats::QuantMix;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// A Hugging Face model directory (llama, mistral, qwen2, qwen3) or a
    /// GGUF file whose float matrices are re-stored.
    pub input: PathBuf,
    /// The GGUF file to write.
    pub output: PathBuf,
    /// The block format of the matrices: q8_0, q4_0, q4_k, q5_k, q6_k (or
    /// f16, bf16; int8 and int4 name q8_0 and q4_0), or q4_k_m (llama.cpp's
    /// mix of Q4_K and Q6_K).
    #[arg(long = "type", value_parser = QuantMix::parse)]
    pub quant_type: QuantMix,
}

/// A format `kiln quantize` and `--quantize` write, by its GGML name.
pub fn parse_quant_type(s: &str) -> Result<kiln_quant::QuantFormat, String> {
    kiln_quant::parse_quantize_type(s)
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    let start = std::time::Instant::now();
    let r = kiln_engine::quantize::quantize_to_gguf(&a.input, &a.output, a.quant_type)?;
    let counts: Vec<String> = r
        .tensors_by_type
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    eprintln!(
        "wrote {} ({} GGUF, {} tensors: {}; {:.1} MB of tensor data) in {:.1} s",
        a.output.display(),
        r.arch,
        r.tensors_by_type.values().sum::<usize>(),
        counts.join(", "),
        r.tensor_bytes as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
