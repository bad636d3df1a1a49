//! Speculative decoding: a proposer guesses a request's next tokens, the
//! scheduler computes them after the request's last known token in its
//! decode step ([`kiln_scheduler::Scheduler::propose`]), and the engine
//! verifies them with the request's own sampler, row by row: row `j`'s token
//! is sampled from the logits after the first `j` drafts, exactly as a plain
//! decode would sample it, and the drafts are taken while they equal what is
//! sampled. Every proposer here is deterministic (a point mass on its
//! guess), for which this is the standard accept/resample rule: a draft `x`
//! is kept with probability `p(x)`, and otherwise the token comes from `p`
//! without `x`, renormalized — so the output is distributed as without
//! speculation, and with greedy or seeded sampling it is the same tokens.
//!
//! Proposers: n-gram lookup over the request's prompt and output
//! (`--speculative ngram`), a draft model sharing the target's tokenizer
//! (`--speculative draft`: [`DraftModel`], greedy guesses, its own paged KV
//! in the same engine), and the request's own predicted output (OpenAI's
//! `prediction`), which any request may bring.
//!
//! The draft length adapts per request to its recent acceptance, and no
//! request speculates in a step while more than
//! [`SpeculativeConfig::max_batch`] requests run (a batch that large is
//! compute-bound, where verifying guesses costs more than it saves).

use std::collections::HashMap;

use kiln_sampling::TokenId;
use kiln_scheduler::RequestId;
use kiln_tensor::ForwardBatch;

use crate::load::LoadedModel;

/// Which proposer guesses the tokens of requests without a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpeculativeMethod {
    /// No speculation (requests with a prediction still use it).
    #[default]
    Off,
    /// Prompt lookup: the continuation of the latest earlier occurrence of
    /// the last few tokens, in the prompt and the output so far.
    Ngram,
    /// A smaller model with the same tokenizer guesses greedily.
    Draft,
    /// The model's own multi-token-prediction head guesses greedily
    /// ([`kiln_models::CausalLm::mtp_heads`]).
    Mtp,
}

impl std::str::FromStr for SpeculativeMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "none" => Ok(SpeculativeMethod::Off),
            "ngram" => Ok(SpeculativeMethod::Ngram),
            "draft" => Ok(SpeculativeMethod::Draft),
            "mtp" => Ok(SpeculativeMethod::Mtp),
            other => Err(format!(
                "unknown speculative method {other:?} (expected ngram, draft, mtp or off)"
            )),
        }
    }
}

/// How the engine speculates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// The most draft tokens a request verifies in one step.
    pub num_tokens: usize,
    /// Requests speculate only in steps where at most this many run.
    pub max_batch: usize,
    /// The longest and shortest suffix the n-gram lookup matches.
    pub ngram_max: usize,
    pub ngram_min: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            method: SpeculativeMethod::Off,
            num_tokens: DEFAULT_NUM_TOKENS,
            max_batch: DEFAULT_MAX_BATCH,
            ngram_max: 4,
            ngram_min: 2,
        }
    }
}

/// Draft tokens a step by default.
pub const DEFAULT_NUM_TOKENS: usize = 16;
/// Running requests above which no one speculates, by default.
pub const DEFAULT_MAX_BATCH: usize = 16;

/// One request's speculation: its prediction, its draft length and counts.
#[derive(Debug, Clone)]
pub(crate) struct SpecState {
    /// The predicted output, tokenized (OpenAI's `prediction`).
    prediction: Option<Vec<TokenId>>,
    /// Where the output stands in the prediction: the end of the last
    /// match used, moved by what was accepted.
    prediction_pos: usize,
    /// The smoothed fraction of drafts accepted, which sets the length.
    acceptance: f64,
    /// Drafts proposed and accepted over the request.
    pub(crate) proposed: usize,
    pub(crate) accepted: usize,
    /// The drafts in flight and the prediction position they came from.
    pending: Option<(usize, Option<usize>)>,
    /// Decode steps left without guesses, after acceptance fell below
    /// [`REST_BELOW`].
    rest: usize,
    /// Rests since a guess was last accepted: each doubles the next.
    rests: u32,
}

/// Smoothed acceptance under which a request stops guessing for
/// [`REST_STEPS`] decode steps (then tries again; each rest without an
/// accepted guess since doubles the next, up to 16 times as long): guesses
/// nearly never taken cost their verification rows and, for a draft model
/// or an MTP head, their proposing passes.
pub const REST_BELOW: f64 = 0.1;
pub const REST_STEPS: usize = 16;

impl SpecState {
    pub(crate) fn new(prediction: Option<Vec<TokenId>>) -> Self {
        SpecState {
            prediction: prediction.filter(|p| !p.is_empty()),
            prediction_pos: 0,
            acceptance: 0.8,
            proposed: 0,
            accepted: 0,
            pending: None,
            rest: 0,
            rests: 0,
        }
    }

    /// Whether this request guesses at all under `method`.
    pub(crate) fn active(&self, method: SpeculativeMethod) -> bool {
        self.prediction.is_some() || method != SpeculativeMethod::Off
    }

    /// Whether the request rests from guessing (its acceptance fell below
    /// [`REST_BELOW`]).
    pub(crate) fn resting(&self) -> bool {
        self.rest > 0
    }

    /// One decode step of the request: whether it guesses in it (a resting
    /// request counts its step instead).
    pub(crate) fn due(&mut self) -> bool {
        if self.rest > 0 {
            self.rest -= 1;
            return false;
        }
        true
    }

    /// The draft length its recent acceptance `a` pays for: about the
    /// expected run of accepted tokens, `a / (1 - a)`, plus one.
    fn length(&self, max: usize) -> usize {
        let a = self.acceptance.min(0.95);
        ((a / (1.0 - a)).round() as usize + 1).clamp(1, max)
    }

    /// Guesses the tokens after `context` (the prompt and the output so
    /// far): from the prediction when there is one, else by n-gram lookup
    /// when `config` asks for it. Empty when nothing matches.
    pub(crate) fn propose(
        &mut self,
        config: &SpeculativeConfig,
        prompt: &[TokenId],
        output: &[TokenId],
    ) -> Vec<TokenId> {
        let k = self.length(config.num_tokens.max(1));
        self.pending = None;
        if let Some(pred) = &self.prediction {
            if let Some(end) = match_in(pred, output, config.ngram_max, 1, self.prediction_pos) {
                let draft: Vec<TokenId> = pred[end..(end + k).min(pred.len())].to_vec();
                if !draft.is_empty() {
                    self.pending = Some((draft.len(), Some(end)));
                    return draft;
                }
            }
        }
        if config.method != SpeculativeMethod::Ngram {
            return Vec::new();
        }
        let draft = ngram_lookup(prompt, output, config.ngram_max, config.ngram_min.max(1), k);
        if !draft.is_empty() {
            self.pending = Some((draft.len(), None));
        }
        draft
    }

    /// The draft length for the next step, at most `max`.
    pub(crate) fn next_length(&self, max: usize) -> usize {
        self.length(max.max(1))
    }

    /// Notes `n` drafts a draft model proposed for the next step.
    pub(crate) fn drafted(&mut self, n: usize) {
        self.pending = (n > 0).then_some((n, None));
    }

    /// Records the verification of the drafts in flight: `accepted` of them
    /// were taken (a step that scheduled fewer than proposed counts those).
    pub(crate) fn verified(&mut self, scheduled: usize, accepted: usize) {
        let Some((_, from)) = self.pending.take() else {
            return;
        };
        if scheduled == 0 {
            return;
        }
        self.proposed += scheduled;
        self.accepted += accepted;
        let rate = accepted as f64 / scheduled as f64;
        self.acceptance = 0.7 * self.acceptance + 0.3 * rate;
        if accepted > 0 {
            self.rests = 0;
        }
        if self.acceptance < REST_BELOW {
            // Rest, then try again from a middling estimate.
            self.rest = REST_STEPS << self.rests.min(4);
            self.rests += 1;
            self.acceptance = 0.3;
        }
        if let Some(end) = from {
            self.prediction_pos = end + accepted;
        }
    }
}

/// The end of the occurrence of the last tokens of `output` in `corpus`
/// (the longest suffix of `ngram_max` down to `ngram_min` tokens that
/// occurs): the first one ending at or after `hint`, else the last one.
/// With an empty output, the corpus start.
fn match_in(
    corpus: &[TokenId],
    output: &[TokenId],
    ngram_max: usize,
    ngram_min: usize,
    hint: usize,
) -> Option<usize> {
    if output.is_empty() {
        return Some(0);
    }
    for n in (ngram_min..=ngram_max.min(output.len())).rev() {
        let suffix = &output[output.len() - n..];
        let mut best: Option<usize> = None;
        for start in 0..corpus.len().saturating_sub(n - 1) {
            if &corpus[start..start + n] == suffix {
                let end = start + n;
                if end >= hint {
                    best = Some(end);
                    break;
                }
                best = Some(end);
            }
        }
        if best.is_some() {
            return best;
        }
    }
    None
}

/// Prompt lookup: the `k` tokens after the latest earlier occurrence of the
/// longest suffix (`ngram_max` down to `ngram_min` tokens) of the prompt
/// and output, searched in both.
pub(crate) fn ngram_lookup(
    prompt: &[TokenId],
    output: &[TokenId],
    ngram_max: usize,
    ngram_min: usize,
    k: usize,
) -> Vec<TokenId> {
    let len = prompt.len() + output.len();
    let at = |i: usize| {
        if i < prompt.len() {
            prompt[i]
        } else {
            output[i - prompt.len()]
        }
    };
    for n in (ngram_min..=ngram_max.min(len.saturating_sub(1))).rev() {
        // The latest occurrence that ends before the suffix itself.
        let suffix_start = len - n;
        let found = (0..suffix_start)
            .rev()
            .find(|&start| (0..n).all(|i| at(start + i) == at(suffix_start + i)));
        if let Some(start) = found {
            let end = start + n;
            return (end..(end + k).min(len)).map(at).collect();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<TokenId> {
        v.iter().map(|&t| TokenId(t)).collect()
    }

    #[test]
    fn ngram_lookup_continues_the_latest_longest_match() {
        // "1 2 3 9 ... 1 2 3 7 ... 2 3" : the suffix "2 3" last occurred
        // before "7", and the 3-gram "x 2 3" does not occur.
        let prompt = ids(&[1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5]);
        let output = ids(&[6, 2, 3]);
        assert_eq!(ngram_lookup(&prompt, &output, 4, 2, 3), ids(&[7, 8, 5]));
        // A 3-gram match beats the later 2-gram one.
        let output = ids(&[9, 1, 2, 3]);
        assert_eq!(ngram_lookup(&prompt, &output, 4, 2, 2), ids(&[7, 8]));
        // No match of at least ngram_min tokens: nothing.
        assert!(ngram_lookup(&prompt, &ids(&[42, 43]), 4, 2, 3).is_empty());
        // The continuation stops at the context's end.
        let output = ids(&[7, 8]);
        assert_eq!(ngram_lookup(&prompt, &output, 4, 2, 5), ids(&[5, 7, 8]));
    }

    #[test]
    fn predictions_follow_the_output_and_resync_after_an_edit() {
        let config = SpeculativeConfig::default();
        let pred = ids(&[10, 11, 12, 13, 14, 15, 16, 17, 18, 19]);
        let mut s = SpecState::new(Some(pred));
        // First token 10 was sampled: the rest of the prediction follows.
        let d = s.propose(&config, &[], &ids(&[10]));
        assert_eq!(d[..3], ids(&[11, 12, 13])[..]);
        s.verified(d.len(), 2);
        // The output replaced 13 by 99, then went on with 14: resync.
        let d = s.propose(&config, &[], &ids(&[10, 11, 12, 99, 14]));
        assert_eq!(d[0], TokenId(15));
        // An output that left the prediction proposes nothing (method off).
        assert!(s.propose(&config, &[], &ids(&[10, 42, 43])).is_empty());
        assert!(SpecState::new(None)
            .propose(&config, &[], &ids(&[1]))
            .is_empty());
    }

    #[test]
    fn the_length_follows_acceptance() {
        let mut s = SpecState::new(None);
        let start = s.length(8);
        for _ in 0..10 {
            s.pending = Some((8, None));
            s.verified(8, 0);
        }
        assert_eq!(s.length(8), 1);
        for _ in 0..30 {
            s.pending = Some((8, None));
            s.verified(8, 8);
        }
        assert!(s.length(8) > start.min(7), "{}", s.length(8));
        assert_eq!(s.proposed, 320);
        assert_eq!(s.accepted, 240);
    }

    #[test]
    fn a_request_whose_guesses_fail_rests_then_tries_again() {
        let mut s = SpecState::new(None);
        let mut failures = 0;
        while !s.resting() {
            assert!(s.due());
            s.pending = Some((1, None));
            s.verified(1, 0);
            failures += 1;
            assert!(failures < 20, "never rests");
        }
        // From 0.8: 0.56, 0.39, 0.27, 0.19, 0.13, 0.09 (< 0.1).
        assert_eq!(failures, 6);
        let skipped = (0..100).take_while(|_| !s.due()).count();
        assert_eq!(skipped, REST_STEPS);
        assert!(!s.resting());
        // Failing probes (from 0.3: 0.21, 0.15, 0.10, 0.07) rest twice as
        // long, and so on up to 16 times.
        for want in [2, 4, 8, 16, 16] {
            let mut probes = 0;
            while !s.resting() {
                assert!(s.due());
                s.pending = Some((1, None));
                s.verified(1, 0);
                probes += 1;
            }
            assert_eq!(probes, 4);
            let skipped = (0..1000).take_while(|_| !s.due()).count();
            assert_eq!(skipped, want * REST_STEPS);
        }
        // Accepted guesses keep it going.
        for _ in 0..10 {
            s.pending = Some((2, None));
            s.verified(2, 2);
            assert!(!s.resting() && s.due());
        }
    }
}

/// A draft model running beside the target in the same engine, with its
/// own paged KV: each step it catches every speculating request up on the
/// tokens it has not seen (the prompt the first time, then what the target
/// accepted) and guesses `k` tokens greedily, one batched forward pass per
/// guess over all those requests. A request's draft KV is kept between
/// steps; only the positions after the first token that differs from the
/// request's tokens are recomputed.
pub(crate) struct DraftModel<'m> {
    model: &'m LoadedModel,
    cache: kiln_tensor::KvCache,
    block_size: usize,
    free: Vec<u32>,
    seqs: HashMap<RequestId, DraftSeq>,
    /// Tokens one forward pass takes at most.
    budget: usize,
}

#[derive(Default)]
struct DraftSeq {
    blocks: Vec<u32>,
    /// The tokens whose KV the draft cache holds, in order.
    tokens: Vec<TokenId>,
}

impl<'m> DraftModel<'m> {
    /// A draft model with a pool of `num_blocks` blocks of `block_size`.
    pub(crate) fn new(
        model: &'m LoadedModel,
        num_blocks: usize,
        block_size: usize,
        budget: usize,
    ) -> crate::Result<Self> {
        let cache = model.model.new_cache(num_blocks, block_size, 0)?;
        Ok(DraftModel {
            model,
            cache,
            block_size,
            free: (0..num_blocks as u32).rev().collect(),
            seqs: HashMap::new(),
            budget: budget.max(1),
        })
    }

    /// Forgets the requests not in `live` (their blocks return to the pool).
    pub(crate) fn retain(&mut self, live: impl Fn(&RequestId) -> bool) {
        retain_seqs(&mut self.seqs, &mut self.free, live, |s| &mut s.blocks);
    }

    /// Guesses up to `k` tokens after each request's `context` (its prompt
    /// and output): the draft's greedy continuation. A request whose
    /// blocks the pool cannot give gets none.
    pub(crate) fn propose(
        &mut self,
        requests: &[(RequestId, Vec<TokenId>, usize)],
    ) -> crate::Result<HashMap<RequestId, Vec<TokenId>>> {
        let bs = self.block_size;
        // (id, context, k) of the requests that run, their seen prefix
        // made to agree with the context.
        let mut runs: Vec<(RequestId, &[TokenId], usize)> = Vec::new();
        for (id, context, k) in requests {
            if context.is_empty() || *k == 0 {
                continue;
            }
            let seq = self.seqs.entry(*id).or_default();
            let same = seq
                .tokens
                .iter()
                .zip(context.iter())
                .take_while(|(a, b)| a == b)
                .count();
            // The last context token is always fed, for its logits.
            seq.tokens.truncate(same.min(context.len() - 1));
            // Positions up to the last guess but one are written.
            let need = (context.len() + k - 1).div_ceil(bs);
            while seq.blocks.len() < need {
                match self.free.pop() {
                    Some(b) => seq.blocks.push(b),
                    None => break,
                }
            }
            if seq.blocks.len() >= need {
                runs.push((*id, context, *k));
            } else {
                // Not now: its blocks go back for the others.
                self.free.append(&mut seq.blocks);
                seq.tokens.clear();
            }
        }
        // Catch up on all but the last context token, in passes of the budget.
        loop {
            let mut batch = ForwardBatch {
                block_size: bs,
                ..ForwardBatch::default()
            };
            let mut fed = Vec::new();
            let mut room = self.budget;
            for (id, context, _) in &runs {
                let seq = &self.seqs[id];
                let behind = context.len() - 1 - seq.tokens.len();
                if behind == 0 || room == 0 {
                    continue;
                }
                let n = behind.min(room);
                room -= n;
                let start = seq.tokens.len();
                let toks: Vec<u32> = context[start..start + n].iter().map(|t| t.0).collect();
                batch.push_seq_groups(&toks, start, vec![seq.blocks.clone()], false);
                fed.push((*id, start + n));
            }
            if fed.is_empty() {
                break;
            }
            self.model.model.forward(&batch, &mut self.cache)?;
            for (id, end) in fed {
                let context = runs.iter().find(|r| r.0 == id).map(|r| r.1).unwrap_or(&[]);
                self.seqs
                    .get_mut(&id)
                    .map(|s| s.tokens = context[..end].to_vec());
            }
        }
        // Then one token a pass: the last context token, then each guess.
        let mut out: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
        let mut next: HashMap<RequestId, TokenId> = runs
            .iter()
            .map(|(id, c, _)| (*id, *c.last().expect("non-empty")))
            .collect();
        let max_k = runs.iter().map(|r| r.2).max().unwrap_or(0);
        for j in 0..max_k {
            let mut batch = ForwardBatch {
                block_size: bs,
                ..ForwardBatch::default()
            };
            let mut rows = Vec::new();
            for (id, _, k) in &runs {
                if j >= *k {
                    continue;
                }
                let seq = &self.seqs[id];
                let t = next[id];
                batch.push_seq_groups(&[t.0], seq.tokens.len(), vec![seq.blocks.clone()], true);
                rows.push(*id);
            }
            if rows.is_empty() {
                break;
            }
            let logits = self.model.model.forward(&batch, &mut self.cache)?;
            let picks = argmax(self.model.model.as_ref(), &logits, rows.len())?;
            for (id, pick) in rows.into_iter().zip(picks) {
                let seq = self.seqs.get_mut(&id).expect("a running draft");
                seq.tokens.push(next[&id]);
                out.entry(id).or_default().push(TokenId(pick));
                next.insert(id, TokenId(pick));
            }
        }
        Ok(out)
    }
}

/// Forgets the sequences of a proposer's own KV pool whose requests are
/// not in `live`, their blocks back on `free`.
pub(crate) fn retain_seqs<S>(
    seqs: &mut HashMap<RequestId, S>,
    free: &mut Vec<u32>,
    live: impl Fn(&RequestId) -> bool,
    blocks: impl Fn(&mut S) -> &mut Vec<u32>,
) {
    seqs.retain(|id, s| {
        let keep = live(id);
        if !keep {
            free.append(blocks(s));
        }
        keep
    });
}

/// The argmax of each of `rows` rows of `logits` (where the logits are
/// when the backend can, else on the host).
pub(crate) fn argmax(
    model: &dyn kiln_models::CausalLm,
    logits: &kiln_tensor::Tensor,
    rows: usize,
) -> crate::Result<Vec<u32>> {
    let backend = model.backend();
    if let Some(p) = backend.argmax_rows(logits)?.filter(|p| p.len() == rows) {
        return Ok(p.into_iter().map(|(t, _)| t).collect());
    }
    let host = backend.to_host(logits)?;
    let vocab = host.len() / rows.max(1);
    Ok(host
        .chunks(vocab.max(1))
        .map(|r| {
            r.iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
                    if v > b.1 {
                        (i, v)
                    } else {
                        b
                    }
                })
                .0 as u32
        })
        .collect())
}

/// Whether `draft` can propose tokens for `target`: the same vocabulary,
/// token for token, and a KV layout of one group (no sliding-window or
/// recurrent layers).
pub fn check_draft(target: &LoadedModel, draft: &LoadedModel) -> crate::Result<()> {
    let (t, d) = (&target.tokenizer, &draft.tokenizer);
    let bad = |why: String| Err(crate::EngineError::Config(format!("the draft model {why}")));
    if t.vocab_size() != d.vocab_size() {
        return bad(format!(
            "has a vocabulary of {} tokens, the target {}: they must share a tokenizer",
            d.vocab_size(),
            t.vocab_size()
        ));
    }
    if let Some(id) = (0..t.vocab_size() as u32).find(|&i| t.token_bytes(i) != d.token_bytes(i)) {
        return bad(format!(
            "spells token {id} {:?}, the target {:?}: they must share a tokenizer",
            d.id_to_token(id),
            t.id_to_token(id)
        ));
    }
    let groups = draft.model.config().kv_layout(16).0.groups.len();
    if groups != 1 || draft.model.state_bytes_per_seq() > 0 {
        return bad(
            "has sliding-window or recurrent layers; a draft model needs full attention throughout"
                .to_string(),
        );
    }
    Ok(())
}
