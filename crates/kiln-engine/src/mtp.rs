//! The multi-token-prediction proposer (`--speculative mtp`): the head a
//! checkpoint ships ([`kiln_models::CausalLm::mtp_forward`]) guesses from
//! the target's own final hidden states, as vLLM and SGLang run Qwen3.5's
//! and DeepSeek's heads.
//!
//! After each step that returned hidden states, the head runs once over
//! every request's rows whose states stand (a prompt chunk's, a decode's, a
//! speculative decode's last known token and accepted drafts), each paired
//! with the token after it, which writes the head's own keys and values
//! (its paged KV, apart from the target's); the last row of a request in
//! decode gives the first guess, and each further guess is one more pass
//! fed with the head's output and the guess before. The guesses wait for
//! the next step, which verifies them like any other proposer's.
//!
//! A request whose prompt came partly from the prefix cache has no hidden
//! states for the cached tokens: the head's keys begin where the target's
//! computation did. RoPE makes attention depend only on position
//! differences, so the head's positions count from there. A gap (the head
//! skipped steps while the batch was too large to speculate) starts the
//! head's keys over in the same way; its guesses are then poorer, never
//! wrong — the target verifies them.

use std::collections::HashMap;

use kiln_sampling::TokenId;
use kiln_scheduler::RequestId;
use kiln_tensor::{ForwardBatch, KvCache, Tensor};

use crate::load::LoadedModel;

/// A request's rows of one step, as the head reads them.
pub(crate) struct StepRows<'a> {
    pub id: RequestId,
    /// The request's first row in the step's batch, and its position.
    pub row: usize,
    pub pos: usize,
    /// Rows (from the first) whose hidden states stand.
    pub valid: usize,
    /// The request's prompt and output after the step.
    pub context: &'a [TokenId],
    /// Tokens to guess for the next step (0: none).
    pub guesses: usize,
}

struct HeadSeq {
    blocks: Vec<u32>,
    /// The target position of the head's index 0.
    offset: usize,
    /// Positions `offset..offset + len` have the head's keys.
    len: usize,
}

pub(crate) struct MtpProposer<'m> {
    model: &'m LoadedModel,
    cache: KvCache,
    block_size: usize,
    free: Vec<u32>,
    seqs: HashMap<RequestId, HeadSeq>,
    /// The guesses of the last step, for the next.
    guesses: HashMap<RequestId, Vec<TokenId>>,
    /// Each pass's logits (tests compare them).
    #[cfg(test)]
    logits: Vec<Vec<f32>>,
}

impl<'m> MtpProposer<'m> {
    /// The head of `model` with a pool of `num_blocks` blocks of `block_size`.
    pub(crate) fn new(
        model: &'m LoadedModel,
        num_blocks: usize,
        block_size: usize,
    ) -> crate::Result<Self> {
        let cache = model.model.new_mtp_cache(num_blocks, block_size)?;
        Ok(MtpProposer {
            model,
            cache,
            block_size,
            free: (0..num_blocks as u32).rev().collect(),
            seqs: HashMap::new(),
            guesses: HashMap::new(),
            #[cfg(test)]
            logits: Vec::new(),
        })
    }

    /// Forgets the requests not in `live` (their blocks return to the pool).
    pub(crate) fn retain(&mut self, live: impl Fn(&RequestId) -> bool) {
        crate::speculative::retain_seqs(&mut self.seqs, &mut self.free, &live, |s| &mut s.blocks);
        self.guesses.retain(|id, _| live(id));
    }

    /// The guesses the last step made for request `id`.
    pub(crate) fn take(&mut self, id: RequestId) -> Option<Vec<TokenId>> {
        self.guesses.remove(&id)
    }

    fn drop_seq(&mut self, id: RequestId) {
        if let Some(mut s) = self.seqs.remove(&id) {
            self.free.append(&mut s.blocks);
        }
    }

    /// Runs the head over a step's rows (`hidden`: the step's final hidden
    /// states, every row) and guesses the next tokens of the requests that
    /// ask for them.
    pub(crate) fn after_step(
        &mut self,
        hidden: &Tensor,
        rows: &[StepRows<'_>],
    ) -> crate::Result<()> {
        self.guesses.clear();
        let bs = self.block_size;
        let mut batch = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        let mut hidden_rows: Vec<u32> = Vec::new();
        // Requests that guess: id, guesses wanted, head index of the first
        // guess's position.
        let mut guessing: Vec<(RequestId, usize, usize)> = Vec::new();
        for r in rows {
            // The last position with a next token to pair with.
            let end = (r.pos + r.valid).min(r.context.len().saturating_sub(1));
            let seq = self.seqs.entry(r.id).or_insert(HeadSeq {
                blocks: Vec::new(),
                offset: r.pos,
                len: 0,
            });
            if r.pos > seq.offset + seq.len {
                // A gap: the head's keys start over here.
                self.free.append(&mut seq.blocks);
                seq.offset = r.pos;
                seq.len = 0;
            }
            let first = r.pos.max(seq.offset + seq.len);
            if first >= end {
                continue;
            }
            let guesses = if end + 1 == r.context.len() {
                r.guesses
            } else {
                0
            };
            // Keys up to the last guess but one are written.
            let need = (end - seq.offset + guesses.saturating_sub(1)).div_ceil(bs);
            while seq.blocks.len() < need {
                match self.free.pop() {
                    Some(b) => seq.blocks.push(b),
                    None => break,
                }
            }
            if seq.blocks.len() < need {
                // No room: the request goes without the head for now.
                self.drop_seq(r.id);
                continue;
            }
            let tokens: Vec<u32> = r.context[first + 1..=end].iter().map(|t| t.0).collect();
            batch.push_seq(&tokens, first - seq.offset, seq.blocks.clone(), guesses > 0);
            let row0 = (r.row + first - r.pos) as u32;
            hidden_rows.extend(row0..row0 + tokens.len() as u32);
            seq.len = end - seq.offset;
            if guesses > 0 {
                guessing.push((r.id, guesses, seq.len));
            }
        }
        if batch.token_ids.is_empty() {
            return Ok(());
        }
        // (The head always returns at least one row.)
        if batch.logits_rows.is_empty() {
            batch.logits_rows.push(batch.token_ids.len() as u32 - 1);
        }
        let model = &self.model.model;
        let b = model.backend();
        let h = b.gather_rows(hidden, &hidden_rows)?;
        let (mut logits, mut out) = model.mtp_forward(&batch, &h, &mut self.cache)?;
        let mut alive: Vec<usize> = (0..guessing.len()).collect();
        let mut depth = 1;
        loop {
            if alive.is_empty() {
                break;
            }
            #[cfg(test)]
            self.logits.push(b.to_host(&logits)?);
            let picks = crate::speculative::argmax(model.as_ref(), &logits, alive.len())?;
            for (&g, pick) in alive.iter().zip(&picks) {
                self.guesses
                    .entry(guessing[g].0)
                    .or_default()
                    .push(TokenId(*pick));
            }
            // Those that want another guess: one more pass.
            let mut next = ForwardBatch {
                block_size: bs,
                ..ForwardBatch::default()
            };
            let mut from = Vec::new();
            let mut still = Vec::new();
            for (i, &g) in alive.iter().enumerate() {
                let (id, want, at) = guessing[g];
                if want <= depth {
                    continue;
                }
                let seq = &self.seqs[&id];
                next.push_seq(&[picks[i]], at + depth - 1, seq.blocks.clone(), true);
                from.push(i as u32);
                still.push(g);
            }
            if still.is_empty() {
                break;
            }
            let h = b.gather_rows(&out, &from)?;
            (logits, out) = model.mtp_forward(&next, &h, &mut self.cache)?;
            alive = still;
            depth += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kiln_tensor::cpu::CpuBackend;

    use super::*;

    fn load() -> LoadedModel {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../kiln-models/tests/data/hybrid/qwen3_5_mtp");
        LoadedModel::load(&dir, Arc::new(CpuBackend::new())).unwrap()
    }

    /// The head's guesses from scratch: one pass over every pair
    /// `(hidden[p], context[p + 1])` on a fresh cache, then a pass a guess.
    fn from_scratch(
        m: &LoadedModel,
        hidden: &[f32],
        context: &[TokenId],
        k: usize,
    ) -> (Vec<u32>, Vec<Vec<f32>>) {
        let (model, b) = (&m.model, m.model.backend());
        let hs = model.config().hidden_size;
        let n = context.len() - 1;
        let mut cache = model.new_mtp_cache(8, 16).unwrap();
        let pool = cache.spec;
        let tokens: Vec<u32> = context[1..].iter().map(|t| t.0).collect();
        let h = b.upload(&[n, hs], &hidden[..n * hs]).unwrap();
        let batch = ForwardBatch::single(&tokens, 0, &pool, n - 1);
        let (mut logits, mut out) = model.mtp_forward(&batch, &h, &mut cache).unwrap();
        let (mut guesses, mut seen) = (Vec::new(), Vec::new());
        for j in 0..k {
            seen.push(b.to_host(&logits).unwrap());
            let g = crate::speculative::argmax(model.as_ref(), &logits, 1).unwrap()[0];
            guesses.push(g);
            if j + 1 == k {
                break;
            }
            let batch = ForwardBatch::single(&[g], n + j, &pool, 0);
            (logits, out) = model.mtp_forward(&batch, &out, &mut cache).unwrap();
        }
        (guesses, seen)
    }

    /// The proposer's guesses for `id` and its passes' logits, against the
    /// head's from scratch.
    fn check(head: &mut MtpProposer<'_>, id: RequestId, want: (Vec<u32>, Vec<Vec<f32>>)) {
        let g = head.take(id).unwrap();
        assert_eq!(g.iter().map(|t| t.0).collect::<Vec<_>>(), want.0);
        let got = std::mem::take(&mut head.logits);
        assert_eq!(got.len(), want.1.len());
        for (a, b) in got.iter().zip(&want.1) {
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-4, "logits differ by {worst}");
        }
    }

    /// The proposer, fed step by step (a prompt in two chunks, then a
    /// speculative decode with one draft of three accepted), guesses what
    /// the head guesses from scratch over the same hidden states; a
    /// request that skipped a step starts over where its rows resume.
    #[test]
    fn incremental_guesses_are_the_heads_from_scratch() {
        let m = load();
        let (model, b) = (&m.model, m.model.backend());
        let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 96).collect();
        let mut cache = model.kv_cache_for_tokens(32, 16).unwrap();
        let pool = cache.spec;
        let mut head = MtpProposer::new(&m, 16, 16).unwrap();
        let id = RequestId(7);
        let mut all_hidden: Vec<f32> = Vec::new();
        let step = |cache: &mut KvCache, tokens: &[u32], start: usize| {
            let batch = ForwardBatch::single(tokens, start, &pool, 0);
            let (logits, hidden) = model.forward_with_hidden(&batch, cache).unwrap();
            (b.to_host(&logits).unwrap(), hidden)
        };
        let vocab = model.config().vocab_size;
        let argmax = |l: &[f32]| {
            l.iter()
                .enumerate()
                .fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a })
                .0 as u32
        };
        let ids = |v: &[u32]| v.iter().map(|&t| TokenId(t)).collect::<Vec<_>>();

        // Chunk 1: no guesses (the prompt goes on).
        let (_, h1) = step(&mut cache, &prompt[..12], 0);
        all_hidden.extend(b.to_host(&h1).unwrap());
        let ctx = ids(&prompt);
        let rows = [StepRows {
            id,
            row: 0,
            pos: 0,
            valid: 12,
            context: &ctx,
            guesses: 3,
        }];
        head.after_step(&h1, &rows).unwrap();
        assert!(head.take(id).is_none(), "no guess before the prompt's end");

        // Chunk 2 ends the prompt: the first token is sampled, 3 guesses.
        let (l2, h2) = step(&mut cache, &prompt[12..], 12);
        all_hidden.extend(b.to_host(&h2).unwrap());
        let first = argmax(&l2[l2.len() - vocab..]);
        let mut ctx: Vec<TokenId> = ids(&prompt);
        ctx.push(TokenId(first));
        let rows = [StepRows {
            id,
            row: 0,
            pos: 12,
            valid: 8,
            context: &ctx,
            guesses: 3,
        }];
        head.after_step(&h2, &rows).unwrap();
        let g = head.guesses[&id].clone();
        check(&mut head, id, from_scratch(&m, &all_hidden, &ctx, 3));

        // A speculative decode of the last token and the 3 guesses; one is
        // accepted, the next token comes from the row after it.
        let mut fed = vec![first];
        fed.extend(g.iter().map(|t| t.0));
        let (l3, h3) = step(&mut cache, &fed, 20);
        let h3_host = b.to_host(&h3).unwrap();
        all_hidden.extend(&h3_host[..2 * model.config().hidden_size]);
        ctx.push(g[0]);
        ctx.push(TokenId(argmax(&l3[vocab..2 * vocab])));
        let rows = [StepRows {
            id,
            row: 0,
            pos: 20,
            valid: 2,
            context: &ctx,
            guesses: 2,
        }];
        head.after_step(&h3, &rows).unwrap();
        check(&mut head, id, from_scratch(&m, &all_hidden, &ctx, 2));

        // Rows already paired give nothing new.
        let rows = [StepRows {
            id,
            row: 1,
            pos: 21,
            valid: 1,
            context: &ctx,
            guesses: 1,
        }];
        head.after_step(&h3, &rows).unwrap();
        assert!(head.take(id).is_none(), "nothing new to pair");
        assert_eq!((head.seqs[&id].offset, head.seqs[&id].len), (0, 22));

        // After a gap (steps the head skipped), its keys start over where
        // the rows resume: one pair, at the head's index 0.
        let mut long = ctx.clone();
        long.extend([TokenId(3), TokenId(4), TokenId(5), TokenId(6)]);
        let rows = [StepRows {
            id,
            row: 1,
            pos: 25,
            valid: 1,
            context: &long,
            guesses: 1,
        }];
        head.after_step(&h3, &rows).unwrap();
        let hs = model.config().hidden_size;
        check(
            &mut head,
            id,
            from_scratch(&m, &h3_host[hs..2 * hs], &long[25..27], 1),
        );
        assert_eq!((head.seqs[&id].offset, head.seqs[&id].len), (25, 1));
        head.retain(|_| false);
        assert_eq!(head.free.len(), 16, "every block is back");
    }
}
