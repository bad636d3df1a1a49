//! Kiln as a library: load a model on the CPU, render a chat with its
//! template, and stream a greedy answer.
//!
//!     cargo run --release -p kiln-engine --example chat -- models/SmolLM2-135M-Instruct.Q4_1.gguf
use std::ops::ControlFlow;
use std::sync::Arc;

use kiln_engine::{GenerationRequest, LoadedModel};
use kiln_sampling::SamplingParams;
use kiln_tensor::cpu::CpuBackend;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: chat MODEL.gguf")?;
    let model = LoadedModel::load(path.as_ref(), Arc::new(CpuBackend::new()))?;
    let messages =
        serde_json::json!([{"role": "user", "content": "What is the capital of France?"}]);
    let prompt = model.render_chat(&messages, true)?;
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(64),
        ..SamplingParams::default()
    };
    let request = GenerationRequest::new(model.tokenizer.encode(&prompt, false)?, params);
    let answer = model.generate(&request, &mut |token| {
        print!("{}", token.text);
        ControlFlow::Continue(())
    })?;
    println!(
        "\n({} tokens, {:?})",
        answer.token_ids.len(),
        answer.finish_reason
    );
    Ok(())
}
