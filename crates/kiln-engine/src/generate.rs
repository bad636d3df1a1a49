//! Generation of one request: prefill, then sample → detokenize → stop
//! checks → decode, streaming each token to a callback.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kiln_sampling::{
    FinishReason, History, RepetitionGuard, Sampled, Sampler, SamplingParams, StopMatcher, TokenId,
};
use kiln_tensor::ForwardBatch;
use kiln_text::IncrementalDetokenizer;

use crate::error::{EngineError, Result};
use crate::load::LoadedModel;

/// Tokens per KV block.
const BLOCK_SIZE: usize = 16;

/// One generation request: prompt token ids and sampling parameters.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Drop special tokens (other than stop tokens, which are never emitted) from the text.
    pub skip_special_tokens: bool,
}

/// One generated token, as streamed.
#[derive(Debug)]
pub struct TokenEvent<'a> {
    pub token: TokenId,
    /// Text released by this token (possibly empty while a UTF-8 character or
    /// a possible stop string is incomplete).
    pub text: &'a str,
    pub sampled: &'a Sampled,
}

/// Wall-clock phases of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt forward pass through the first sampled token.
    pub prefill_seconds: f64,
    /// Every later token.
    pub decode_seconds: f64,
}

impl Timings {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_seconds.max(1e-9)
    }

    /// Decode rate over the tokens after the first.
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Per token, when the request asked for logprobs.
    pub logprobs: Vec<Sampled>,
    pub timings: Timings,
}

/// Entropy for unseeded requests: time mixed with a process-wide counter.
fn entropy() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
}

impl LoadedModel {
    /// Generate for `req`, calling `on_token` for every token; returning
    /// `ControlFlow::Break` from it cancels the request.
    pub fn generate(
        &self,
        req: &GenerationRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let cfg = self.model.config();
        let ctx = self.context_length();
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.prompt.len() >= ctx {
            return Err(EngineError::PromptTooLong {
                prompt_tokens: req.prompt.len(),
                context_length: ctx,
            });
        }
        let mut sampler = Sampler::new(req.params.clone(), cfg.vocab_size, entropy())?;
        let max_new = req
            .params
            .max_tokens
            .unwrap_or(usize::MAX)
            .min(ctx - req.prompt.len());
        let guard = RepetitionGuard::from_params(&req.params);
        let mut stops = StopMatcher::new(&req.params.stop);
        let mut detok = IncrementalDetokenizer::new(&self.tokenizer, req.skip_special_tokens);
        let prompt_ids: Vec<TokenId> = req.prompt.iter().map(|&t| TokenId(t)).collect();
        let mut generated: Vec<TokenId> = Vec::new();
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let mut timings = Timings {
            prompt_tokens: req.prompt.len(),
            ..Timings::default()
        };

        let start = Instant::now();
        let blocks = (req.prompt.len() + max_new).div_ceil(BLOCK_SIZE);
        let mut cache = self.model.new_kv_cache(blocks, BLOCK_SIZE)?;
        let prefill = ForwardBatch::single(&req.prompt, 0, BLOCK_SIZE, req.prompt.len() - 1);
        let mut logits = self.model.forward(&prefill, &mut cache)?;
        let mut decode_start = None;
        let finish_reason = loop {
            let mut row = self.model.backend().to_host(&logits)?;
            let sampled = sampler.sample(&mut row, &History::new(&prompt_ids, &generated))?;
            let token = sampled.token;
            generated.push(token);
            if decode_start.is_none() {
                timings.prefill_seconds = start.elapsed().as_secs_f64();
                decode_start = Some(Instant::now());
            }
            let token_finish =
                req.params
                    .token_finish_reason(token, generated.len(), &self.eos_token_ids);
            // A stop token ends the turn; its text is never emitted.
            let mut released = String::new();
            let mut finish = None;
            if token_finish != Some(FinishReason::Stop) {
                let delta = detok.push(token.0)?;
                let out = stops.push(&delta);
                released = out.text;
                if let Some(idx) = out.stop_idx {
                    finish = Some(FinishReason::StopString(idx));
                }
            }
            finish = finish.or(token_finish);
            if finish.is_none() && guard.is_enabled() {
                finish = guard.check(&generated);
            }
            if finish.is_none() && generated.len() >= max_new {
                finish = Some(FinishReason::Length);
            }
            if let Some(f) = finish {
                if !matches!(f, FinishReason::StopString(_)) {
                    // Flush what the detokenizer and the stop matcher held back.
                    let tail = detok.finish()?;
                    let out = stops.push(&tail);
                    released.push_str(&out.text);
                    if out.stop_idx.is_none() {
                        released.push_str(&stops.finish());
                    }
                }
            }
            text.push_str(&released);
            let event = TokenEvent {
                token,
                text: &released,
                sampled: &sampled,
            };
            let flow = on_token(&event);
            if req.params.logprobs.is_some() {
                logprobs.push(sampled);
            }
            if let Some(f) = finish {
                break f;
            }
            if flow.is_break() {
                break FinishReason::Cancelled;
            }
            let pos = req.prompt.len() + generated.len() - 1;
            logits = self.model.forward(
                &ForwardBatch::single(&[token.0], pos, BLOCK_SIZE, 0),
                &mut cache,
            )?;
        };
        timings.generated_tokens = generated.len();
        timings.decode_seconds = decode_start
            .map(|d| d.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        Ok(Generation {
            token_ids: generated.into_iter().map(|t| t.0).collect(),
            text,
            finish_reason,
            logprobs,
            timings,
        })
    }
}
