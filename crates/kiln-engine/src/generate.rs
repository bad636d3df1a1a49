//! Generation of one request: prefill, then sample → detokenize → stop
//! checks → decode, streaming each token to a callback.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kiln_sampling::{FinishReason, Sampled, SamplingParams, TokenId};
use kiln_tensor::ForwardBatch;

use crate::error::{EngineError, Result};
use crate::load::LoadedModel;
use crate::process::{TokenOutcome, TokenProcessor};

/// Tokens per KV block.
const BLOCK_SIZE: usize = 16;

/// One generation request: prompt token ids and sampling parameters.
#[derive(Debug, Clone, Default)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Drop special tokens (other than stop tokens, which are never emitted) from the text.
    pub skip_special_tokens: bool,
    /// Scheduling class: lower is more urgent (0 is the default).
    pub priority: i32,
    /// Requests with different salts never share cached KV blocks.
    pub cache_salt: Option<String>,
    /// Constrain the output to this format (JSON schema, regex, ...).
    pub format: Option<kiln_structured::Format>,
    /// The format applies after this reasoning block (when the model
    /// thinks), not to the reasoning itself.
    pub reasoning: Option<crate::process::ReasoningTags>,
    /// Take tokens the output format forces without a forward pass each
    /// (on in [`GenerationRequest::new`]).
    pub jump_forward: bool,
    /// The LoRA adapter the request runs with (none: the base model). Its
    /// id keys the request's prefix-cache blocks.
    pub adapter: Option<std::sync::Arc<kiln_tensor::LoraAdapter>>,
    /// The output the caller expects, tokenized (OpenAI's Predicted
    /// Outputs): the engine verifies it as draft tokens, so a close
    /// prediction makes decoding faster and never changes the output.
    pub prediction: Option<Vec<u32>>,
}

impl GenerationRequest {
    /// A request for `prompt` with `params`, skipping special tokens in the text.
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        GenerationRequest {
            prompt,
            params,
            skip_special_tokens: true,
            jump_forward: true,
            ..GenerationRequest::default()
        }
    }
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
pub(crate) fn entropy() -> u64 {
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
        let max_new = req
            .params
            .max_tokens
            .unwrap_or(usize::MAX)
            .min(ctx - req.prompt.len());
        let mut proc = TokenProcessor::new(
            self,
            &req.prompt,
            &req.params,
            req.skip_special_tokens,
            max_new,
            entropy(),
            req.format
                .as_ref()
                .map(|f| self.constraint(f))
                .transpose()?,
            req.reasoning.as_ref(),
        )?;
        // This loop feeds one token per step.
        proc.set_jump_forward(false);
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let mut timings = Timings {
            prompt_tokens: req.prompt.len(),
            ..Timings::default()
        };

        let start = Instant::now();
        let mut cache = self
            .model
            .kv_cache_for_tokens(req.prompt.len() + max_new, BLOCK_SIZE)?;
        // The prompt in chunks of the size the engine takes (and `kiln fit`
        // prices), so one request's activations stay bounded; each chunk's
        // last row's logits are computed, the last chunk's kept (on the
        // CPU a chunked prefill gives the same bits as one pass).
        let chunk = crate::memory::prefill_chunk(self.model.backend().device_memory().is_some());
        let n = req.prompt.len();
        let mut logits = None;
        // Every row of the one sequence runs with the request's adapter.
        let with_adapter = |mut b: ForwardBatch| {
            if let Some(adapter) = &req.adapter {
                b.lora.groups.push(kiln_tensor::LoraGroup {
                    adapter: adapter.clone(),
                    rows: vec![0..b.token_ids.len()],
                });
            }
            b
        };
        for s in (0..n).step_by(chunk) {
            let e = (s + chunk).min(n);
            let part = with_adapter(ForwardBatch::single(
                &req.prompt[s..e],
                s,
                &cache.spec,
                e - s - 1,
            ));
            logits = Some(self.model.forward(&part, &mut cache)?);
        }
        let mut logits = logits.expect("a prompt has at least one token");
        let mut decode_start = None;
        let finish_reason = loop {
            let backend = self.model.backend();
            let picked = if proc.wants_plain_argmax() {
                backend.argmax_rows(&logits)?
            } else {
                None
            };
            let device = match picked.as_deref() {
                Some(&[(token, logprob)]) => Some(proc.on_argmax(token, logprob)?),
                _ if proc.wants_device_sample() => {
                    device_sample(backend.as_ref(), &logits, &mut proc)?
                }
                _ => None,
            };
            let out = match device {
                Some(out) => out,
                None => proc.on_logits(&mut backend.to_host(&logits)?)?,
            };
            if decode_start.is_none() {
                timings.prefill_seconds = start.elapsed().as_secs_f64();
                decode_start = Some(Instant::now());
            }
            let token = out.sampled.token;
            text.push_str(&out.text);
            let flow = on_token(&TokenEvent {
                token,
                text: &out.text,
                sampled: &out.sampled,
            });
            if req.params.logprobs.is_some() {
                logprobs.push(out.sampled);
            }
            if let Some(f) = out.finish {
                break f;
            }
            if flow.is_break() {
                break FinishReason::Cancelled;
            }
            let pos = req.prompt.len() + proc.generated().len() - 1;
            logits = self.model.forward(
                &with_adapter(ForwardBatch::single(&[token.0], pos, &cache.spec, 0)),
                &mut cache,
            )?;
        };
        let generated: Vec<u32> = proc.generated().iter().map(|t| t.0).collect();
        timings.generated_tokens = generated.len();
        timings.decode_seconds = decode_start
            .map(|d| d.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        Ok(Generation {
            token_ids: generated,
            text,
            finish_reason,
            logprobs,
            timings,
        })
    }
}

/// The next token sampled where the logits are, when the backend can.
fn device_sample(
    backend: &dyn kiln_tensor::Backend,
    logits: &kiln_tensor::Tensor,
    proc: &mut TokenProcessor<'_>,
) -> Result<Option<TokenOutcome>> {
    let Some((step, mask)) = proc.device_row()? else {
        return Ok(None);
    };
    let row = crate::process::sample_row(&step, mask.as_deref());
    match backend.sample_rows(logits, &[row])?.as_deref() {
        Some([Some(sampled)]) => Ok(Some(proc.on_device_sample(sampled.clone())?)),
        Some([None]) => Err(kiln_sampling::SamplingError::NoCandidates.into()),
        _ => Ok(None),
    }
}
