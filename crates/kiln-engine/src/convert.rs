//! GGUF → Hugging Face safetensors directory (config, generation config,
//! tokenizer with chat template, weights): the reference's GGUF import.

use std::path::Path;

use kiln_formats::{GgufWeights, SafetensorsDtype};
use kiln_text::Tokenizer;
use serde_json::json;

use crate::error::Result;

/// Convert the GGUF file `input` into a Hugging Face directory `output`.
/// With `SafetensorsDtype::F32` the weights are exactly the dequantized GGUF
/// weights, so both load to the same model.
pub fn gguf_to_hf_dir(input: &Path, output: &Path, dtype: SafetensorsDtype) -> Result<()> {
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
