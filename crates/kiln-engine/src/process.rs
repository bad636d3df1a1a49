//! What happens to one request's logits each step: sample, detokenize, match
//! stop strings and stop tokens, apply the repetition guards and the length
//! limit. Shared by the single-request path and the engine loop, so both
//! finish and emit text the same way.

use kiln_sampling::{
    FinishReason, History, RepetitionGuard, Sampled, Sampler, SamplingParams, StopMatcher, TokenId,
};
use kiln_text::IncrementalDetokenizer;

use crate::error::Result;
use crate::load::LoadedModel;

/// One step's outcome for one request.
#[derive(Debug)]
pub struct TokenOutcome {
    pub sampled: Sampled,
    /// Text released by this token (possibly empty); on a finish it includes
    /// whatever the detokenizer and the stop matcher held back.
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// Per-request decoding state.
pub struct TokenProcessor<'m> {
    params: SamplingParams,
    eos: &'m [TokenId],
    max_new: usize,
    prompt: Vec<TokenId>,
    generated: Vec<TokenId>,
    sampler: Sampler,
    detok: IncrementalDetokenizer<'m>,
    stops: StopMatcher,
    guard: RepetitionGuard,
    /// The output format's grammar, when the request asked for one.
    constraint: Option<kiln_structured::Constraint>,
}

impl<'m> TokenProcessor<'m> {
    /// State for a request of `prompt` that may generate up to `max_new`
    /// tokens, its output constrained to `format` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &'m LoadedModel,
        prompt: &[u32],
        params: &SamplingParams,
        skip_special_tokens: bool,
        max_new: usize,
        entropy: u64,
        format: Option<&kiln_structured::Format>,
    ) -> Result<Self> {
        let constraint = format.map(|f| model.constraint(f)).transpose()?;
        Ok(TokenProcessor {
            constraint,
            sampler: Sampler::new(params.clone(), model.model.config().vocab_size, entropy)?,
            detok: IncrementalDetokenizer::new(&model.tokenizer, skip_special_tokens),
            stops: StopMatcher::new(&params.stop),
            guard: RepetitionGuard::from_params(params),
            params: params.clone(),
            eos: &model.eos_token_ids,
            max_new,
            prompt: prompt.iter().map(|&t| TokenId(t)).collect(),
            generated: Vec::new(),
        })
    }

    pub fn generated(&self) -> &[TokenId] {
        &self.generated
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    /// Whether the next token may be taken as the argmax computed on the
    /// device ([`TokenProcessor::on_argmax`]).
    pub fn wants_plain_argmax(&self) -> bool {
        self.constraint.is_none() && self.params.is_plain_argmax()
    }

    /// Sample the next token from `logits` (overwritten) and process it;
    /// a constrained request samples only what its grammar allows.
    pub fn on_logits(&mut self, logits: &mut [f32]) -> Result<TokenOutcome> {
        if let Some(c) = self.constraint.as_mut() {
            c.mask_logits(logits)?;
        }
        let sampled = self
            .sampler
            .sample(logits, &History::new(&self.prompt, &self.generated))?;
        if let Some(c) = self.constraint.as_mut() {
            c.commit(sampled.token.0)?;
        }
        self.process(sampled)
    }

    /// Process the argmax token the backend picked (only for requests that
    /// [`TokenProcessor::wants_plain_argmax`]).
    pub fn on_argmax(&mut self, token: u32, logprob: f32) -> Result<TokenOutcome> {
        self.process(Sampled {
            token: TokenId(token),
            logprob,
            top: Vec::new(),
        })
    }

    fn process(&mut self, sampled: Sampled) -> Result<TokenOutcome> {
        let token = sampled.token;
        self.generated.push(token);
        let token_finish = self
            .params
            .token_finish_reason(token, self.generated.len(), self.eos);
        // A stop token ends the turn; its text is never emitted.
        let mut text = String::new();
        let mut finish = None;
        if token_finish != Some(FinishReason::Stop) {
            let delta = self.detok.push(token.0)?;
            let out = self.stops.push(&delta);
            text = out.text;
            if let Some(idx) = out.stop_idx {
                finish = Some(FinishReason::StopString(idx));
            }
        }
        finish = finish.or(token_finish);
        if finish.is_none() && self.guard.is_enabled() {
            finish = self.guard.check(&self.generated);
        }
        if finish.is_none() && self.generated.len() >= self.max_new {
            finish = Some(FinishReason::Length);
        }
        if let Some(f) = finish {
            if !matches!(f, FinishReason::StopString(_)) {
                text.push_str(&self.flush()?);
            }
        }
        Ok(TokenOutcome {
            sampled,
            text,
            finish,
        })
    }

    /// Text held back by the detokenizer and the stop matcher, released when
    /// generation ends for a reason other than a stop string.
    pub fn flush(&mut self) -> Result<String> {
        let tail = self.detok.finish()?;
        let out = self.stops.push(&tail);
        let mut text = out.text;
        if out.stop_idx.is_none() {
            text.push_str(&self.stops.finish());
        }
        Ok(text)
    }
}
