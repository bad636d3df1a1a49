//! What happens to one request's logits each step: sample, detokenize, match
//! stop strings and stop tokens, apply the repetition guards and the length
//! limit. Shared by the single-request path and the engine loop, so both
//! finish and emit text the same way.

use kiln_sampling::{
    DeviceStep, FinishReason, History, RepetitionGuard, Sampled, Sampler, SamplingParams,
    StopMatcher, TokenId,
};
use kiln_tensor::{SampleRow, SampledRow};
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
    /// Tokens the output format forced after this one (jump-forward), with
    /// their text: taken without a forward pass each, computed with the
    /// next step's chunk.
    pub forced: Vec<(TokenId, String)>,
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
    tokenizer: &'m kiln_text::Tokenizer,
    stops: StopMatcher,
    guard: RepetitionGuard,
    /// The output format's grammar, when the request asked for one.
    constraint: Option<kiln_structured::Constraint>,
    /// When the format applies only after a reasoning block: where the
    /// output stands with respect to it.
    gate: Option<Gate>,
    /// The constraint's mask for the next token, computed ahead (while the
    /// forward pass runs).
    mask: Option<kiln_structured::TokenMask>,
    /// Take the tokens the output format forces without sampling them.
    jump_forward: bool,
}

/// The tags of a reasoning block that an output format does not cover.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReasoningTags {
    pub open: String,
    pub close: String,
    /// The prompt ends inside an open block.
    pub opened: bool,
}

/// Where the output stands with respect to the reasoning block.
struct Gate {
    tags: ReasoningTags,
    /// Text generated so far (until the format applies).
    text: String,
    state: GateState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GateState {
    /// The output may still open a block.
    Before,
    Reasoning,
    /// Right after the block: blank tokens pass, anything else starts the
    /// answer (and must fit the format).
    Closed,
    /// The format applies.
    Answer,
}

impl Gate {
    fn new(tags: ReasoningTags) -> Gate {
        let state = if tags.opened {
            GateState::Reasoning
        } else {
            GateState::Before
        };
        Gate {
            tags,
            text: String::new(),
            state,
        }
    }

    /// Takes the next text; returns true when the answer began without a
    /// reasoning block (the tokens so far belong to the format).
    fn push(&mut self, delta: &str) -> bool {
        self.text.push_str(delta);
        if self.state == GateState::Before {
            let t = self.text.trim_start();
            if t.starts_with(&self.tags.open) {
                let skip = self.text.len() - t.len() + self.tags.open.len();
                self.text.drain(..skip);
                self.state = GateState::Reasoning;
            } else if !self.tags.open.starts_with(t) {
                self.state = GateState::Answer;
                return true;
            }
        }
        if self.state == GateState::Reasoning && self.text.contains(&self.tags.close) {
            self.state = GateState::Closed;
            self.text = String::new();
        }
        false
    }
}

/// A request's decoding state before it meets the model's tokenizer: what
/// costs time to build (the stop matcher, the sampler with its logit bias,
/// the repetition guard, the copied prompt) is built here, on the caller's
/// thread, so the engine loop only attaches it.
pub struct PreparedRequest {
    params: SamplingParams,
    max_new: usize,
    prompt: Vec<TokenId>,
    sampler: Sampler,
    stops: StopMatcher,
    guard: RepetitionGuard,
    constraint: Option<kiln_structured::Constraint>,
    gate: Option<Gate>,
    skip_special_tokens: bool,
}

impl PreparedRequest {
    /// State for a request of `prompt` that may generate up to `max_new`
    /// tokens, its output held to `constraint` (a compiled format) when given.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vocab_size: usize,
        prompt: &[u32],
        params: &SamplingParams,
        skip_special_tokens: bool,
        max_new: usize,
        entropy: u64,
        constraint: Option<kiln_structured::Constraint>,
        reasoning: Option<&ReasoningTags>,
    ) -> Result<Self> {
        Ok(PreparedRequest {
            gate: constraint
                .as_ref()
                .and(reasoning)
                .map(|t| Gate::new(t.clone())),
            constraint,
            sampler: Sampler::new(params.clone(), vocab_size, entropy)?,
            stops: StopMatcher::new(&params.stop),
            guard: RepetitionGuard::from_params(params),
            params: params.clone(),
            max_new,
            prompt: prompt.iter().map(|&t| TokenId(t)).collect(),
            skip_special_tokens,
        })
    }

    /// The tokens this request may still generate at most.
    pub fn max_new(&self) -> usize {
        self.max_new
    }
}

impl<'m> TokenProcessor<'m> {
    /// State for a request of `prompt` that may generate up to `max_new`
    /// tokens, its output held to `constraint` (a compiled format) when given.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &'m LoadedModel,
        prompt: &[u32],
        params: &SamplingParams,
        skip_special_tokens: bool,
        max_new: usize,
        entropy: u64,
        constraint: Option<kiln_structured::Constraint>,
        reasoning: Option<&ReasoningTags>,
    ) -> Result<Self> {
        let prepared = PreparedRequest::new(
            model.model.config().vocab_size,
            prompt,
            params,
            skip_special_tokens,
            max_new,
            entropy,
            constraint,
            reasoning,
        )?;
        Ok(Self::attach(model, prepared))
    }

    /// Binds a prepared request to the model's tokenizer and stop tokens
    /// (no allocation proportional to the request).
    pub fn attach(model: &'m LoadedModel, p: PreparedRequest) -> Self {
        TokenProcessor {
            gate: p.gate,
            mask: None,
            jump_forward: true,
            constraint: p.constraint,
            sampler: p.sampler,
            detok: IncrementalDetokenizer::new(&model.tokenizer, p.skip_special_tokens),
            tokenizer: &model.tokenizer,
            stops: p.stops,
            guard: p.guard,
            params: p.params,
            eos: &model.eos_token_ids,
            max_new: p.max_new,
            prompt: p.prompt,
            generated: Vec::new(),
        }
    }

    /// Whether tokens the output format forces are taken at once (on by
    /// default; never when log-probabilities are asked for, since forced
    /// tokens are not sampled).
    pub fn set_jump_forward(&mut self, on: bool) {
        self.jump_forward = on;
    }

    pub fn generated(&self) -> &[TokenId] {
        &self.generated
    }

    pub fn prompt(&self) -> &[TokenId] {
        &self.prompt
    }

    /// The prompt and the output so far, as one sequence.
    pub fn context(&self) -> Vec<TokenId> {
        self.prompt.iter().chain(&self.generated).copied().collect()
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    /// Whether the next token may be taken as the argmax computed on the
    /// device ([`TokenProcessor::on_argmax`]).
    pub fn wants_plain_argmax(&self) -> bool {
        self.active_constraint().is_none() && self.params.is_plain_argmax()
    }

    /// The constraint, when it applies to the next token.
    fn active_constraint(&self) -> Option<&kiln_structured::Constraint> {
        let gated = self
            .gate
            .as_ref()
            .is_some_and(|g| !matches!(g.state, GateState::Closed | GateState::Answer));
        self.constraint.as_ref().filter(|_| !gated)
    }

    /// Right after the reasoning block, where blank tokens pass freely.
    fn after_reasoning(&self) -> bool {
        self.gate
            .as_ref()
            .is_some_and(|g| g.state == GateState::Closed)
    }

    /// Whether the next token is the argmax of the constrained logits (the
    /// backend may take it with the mask of [`TokenProcessor::mask_words`]).
    pub fn wants_masked_argmax(&self) -> bool {
        self.active_constraint().is_some()
            && !self.after_reasoning()
            && self.params.is_plain_argmax()
    }

    /// The prepared mask as device words (after [`TokenProcessor::prepare_mask`]).
    pub fn mask_words(&self) -> Option<Vec<u32>> {
        let c = self.active_constraint()?;
        Some(c.mask_words(self.mask.as_ref()?))
    }

    /// Process the token the backend picked under this request's mask
    /// (only for requests that [`TokenProcessor::wants_masked_argmax`]).
    pub fn on_masked_argmax(&mut self, token: u32, logprob: f32) -> Result<TokenOutcome> {
        self.mask = None;
        if let Some(c) = self.constraint.as_mut() {
            c.commit(token)?;
        }
        let outcome = self.process(Sampled {
            token: TokenId(token),
            logprob,
            top: Vec::new(),
        })?;
        self.jump(outcome)
    }

    /// Whether the next token may be sampled where the logits are, from
    /// [`TokenProcessor::device_row`]'s data: any parameters the device
    /// sampler takes, but not right after a reasoning block (where blank
    /// tokens pass the format's mask, which the host path handles).
    pub fn wants_device_sample(&self) -> bool {
        !self.after_reasoning() && self.sampler.device_supported()
    }

    /// The next token's device sampling data (penalty counts brought up to
    /// date, the draw's number read but not yet consumed), with the prepared
    /// mask as device words when the output format applies; `None` when that
    /// mask is not ready (the row samples on the host, which computes it).
    pub fn device_row(&mut self) -> Result<Option<(DeviceStep, Option<Vec<u32>>)>> {
        let mask = match self.active_constraint() {
            Some(c) => match self.mask.as_ref() {
                Some(m) => Some(c.mask_words(m)),
                None => return Ok(None),
            },
            None => None,
        };
        let step = self
            .sampler
            .device_step(&History::new(&self.prompt, &self.generated))?;
        Ok(Some((step, mask)))
    }

    /// Process the token the backend sampled from [`TokenProcessor::device_row`]'s
    /// data (only for requests that [`TokenProcessor::wants_device_sample`]):
    /// consumes the draw's number, commits the token to the output format
    /// and takes what the format forces after it, as [`TokenProcessor::on_logits`].
    pub fn on_device_sample(&mut self, row: SampledRow) -> Result<TokenOutcome> {
        self.sampler.finish_device_step();
        if self.active_constraint().is_some() {
            self.mask = None;
            if let Some(c) = self.constraint.as_mut() {
                c.commit(row.token)?;
            }
            if let Some(g) = self.gate.as_mut() {
                g.state = GateState::Answer;
            }
        }
        let outcome = self.process(Sampled {
            token: TokenId(row.token),
            logprob: row.logprob,
            top: row.top.into_iter().map(|(t, l)| (TokenId(t), l)).collect(),
        })?;
        self.jump(outcome)
    }

    /// Cuts guessed next tokens where the output format stops allowing
    /// them (a speculative decode verifies only what could be accepted).
    /// Left whole while a reasoning block decides where the format starts.
    pub fn trim_draft(&mut self, draft: &mut Vec<TokenId>) {
        let gated = self
            .gate
            .as_ref()
            .is_some_and(|g| g.state != GateState::Answer);
        if gated {
            return;
        }
        if let Some(c) = self.constraint.as_mut() {
            let ids: Vec<u32> = draft.iter().map(|t| t.0).collect();
            draft.truncate(c.valid_prefix(&ids));
        }
    }

    /// Whether [`TokenProcessor::prepare_mask`] has work to do.
    pub fn needs_mask(&self) -> bool {
        self.active_constraint().is_some() && self.mask.is_none()
    }

    /// Computes the constraint's mask for the next token ahead of its
    /// logits (the engine runs this while the forward pass runs).
    pub fn prepare_mask(&mut self) -> Result<()> {
        if self.needs_mask() {
            if let Some(c) = self.constraint.as_mut() {
                self.mask = Some(c.allowed()?);
            }
        }
        Ok(())
    }

    /// Sample the next token from `logits` (overwritten) and process it;
    /// a constrained request samples only what its grammar allows.
    pub fn on_logits(&mut self, logits: &mut [f32]) -> Result<TokenOutcome> {
        let active = self.active_constraint().is_some();
        let blanks_pass = self.after_reasoning();
        if active {
            self.prepare_mask()?;
            if let (Some(c), Some(mask)) = (self.constraint.as_ref(), self.mask.take()) {
                let kept: Vec<(usize, f32)> = if blanks_pass {
                    let ids = c.blank_ids().iter().map(|&id| id as usize);
                    ids.filter(|&id| id < logits.len())
                        .map(|id| (id, logits[id]))
                        .collect()
                } else {
                    Vec::new()
                };
                c.apply(&mask, logits);
                for (id, l) in kept {
                    logits[id] = l;
                }
            }
        }
        let sampled = self
            .sampler
            .sample(logits, &History::new(&self.prompt, &self.generated))?;
        if let (true, Some(c)) = (active, self.constraint.as_mut()) {
            let blank = blanks_pass && c.blank_ids().contains(&sampled.token.0);
            if !blank {
                c.commit(sampled.token.0)?;
                if let Some(g) = self.gate.as_mut() {
                    g.state = GateState::Answer;
                }
            }
        }
        let outcome = self.process(sampled)?;
        self.jump(outcome)
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
            self.pass_gate(token)?;
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
            forced: Vec::new(),
        })
    }

    /// Jump-forward: while the output format allows exactly one next token,
    /// take it (lossless: sampling could pick nothing else), up to the
    /// finish; the mask of the first unforced position is kept for the next
    /// step.
    fn jump(&mut self, mut outcome: TokenOutcome) -> Result<TokenOutcome> {
        let wanted = self.jump_forward
            && self.params.logprobs.is_none()
            && self
                .gate
                .as_ref()
                .is_none_or(|g| g.state == GateState::Answer);
        if !wanted || self.active_constraint().is_none() {
            return Ok(outcome);
        }
        while outcome.finish.is_none() {
            let Some(c) = self.constraint.as_mut() else {
                break;
            };
            if c.is_finished() {
                break;
            }
            let (forced, mask) = c.forced()?;
            let Some(token) = forced else {
                self.mask = Some(mask);
                break;
            };
            c.commit(token)?;
            let o = self.process(Sampled {
                token: TokenId(token),
                logprob: 0.0,
                top: Vec::new(),
            })?;
            outcome.forced.push((TokenId(token), o.text));
            outcome.finish = o.finish;
        }
        Ok(outcome)
    }

    /// Follows the output through the reasoning block; an answer that began
    /// without one is fed to the constraint from its first token.
    fn pass_gate(&mut self, token: TokenId) -> Result<()> {
        let Some(gate) = self.gate.as_mut() else {
            return Ok(());
        };
        if !matches!(gate.state, GateState::Before | GateState::Reasoning) {
            return Ok(());
        }
        // Each token's own text: the tags are plain ASCII, and the
        // detokenizer may hold text back.
        let bytes = self.tokenizer.token_bytes(token.0).unwrap_or_default();
        if !gate.push(&String::from_utf8_lossy(&bytes)) {
            return Ok(());
        }
        // The tokens so far are blanks and the deviating one.
        if let Some(c) = self.constraint.as_mut() {
            for t in &self.generated {
                if !c.blank_ids().contains(&t.0) {
                    c.commit(t.0)?;
                }
            }
        }
        Ok(())
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

/// A backend's sampling row for `step` under `mask`.
pub(crate) fn sample_row<'a>(step: &'a DeviceStep, mask: Option<&'a [u32]>) -> SampleRow<'a> {
    SampleRow {
        temperature: step.temperature,
        top_k: step.top_k,
        top_p: step.top_p,
        min_p: step.min_p,
        u: step.u,
        logit_bias: &step.logit_bias,
        repetition_penalty: step.repetition_penalty,
        frequency_penalty: step.frequency_penalty,
        presence_penalty: step.presence_penalty,
        penalties: &step.penalties,
        mask,
        top_logprobs: step.top_logprobs,
    }
}
