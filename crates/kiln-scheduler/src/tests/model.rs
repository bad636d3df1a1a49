//! A simulated engine and model that check the scheduler's KV bookkeeping end to end.
//!
//! The "KV" of position `p` of a request is a fingerprint of the request's root
//! (salt, adapter) and all its tokens up to `p`. Each step the model checks every
//! slot it reads (all earlier positions, cache hits included) holds the fingerprint
//! the request expects, writes the new positions (only into blocks no one else
//! references), and samples the next token greedily from the last fingerprint. A
//! wrong block table, a wrongly shared block or a stale cache hit changes what is
//! read, so outputs equal [`reference_output`] only if the bookkeeping is right.
//!
//! Speculative decodes verify their drafts as an engine does: row `j` samples a
//! token from the fingerprint after the last known token and the first `j`
//! drafts, and the drafts are taken while they equal what is sampled; the KV a
//! rejected draft wrote holds a wrong fingerprint, which a later read catches
//! unless the scheduler gave its slot back and the next step rewrote it.

use std::collections::{BTreeMap, HashMap};

use kiln_sampling::TokenId;

use super::rng::Rng;
use crate::{Request, RequestId, RequestStatus, Scheduler, SchedulerOutput};

/// Tokens the simulated model can sample.
const VOCAB: u64 = 40;

fn mix(state: u64, token: TokenId) -> u64 {
    let mut z = state ^ u64::from(token.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 29)
}

fn sample(fingerprint: u64) -> TokenId {
    TokenId((fingerprint % VOCAB) as u32)
}

/// The root fingerprint of a request's extra keys, mirroring `BlockHash::root`.
pub(crate) fn root_fingerprint(request: &Request) -> u64 {
    let salt = request.cache_salt.as_deref().map_or(0, |s| {
        s.bytes().fold(1, |fp, b| mix(fp, TokenId(u32::from(b))))
    });
    let adapter = request.adapter_id.map_or(0, |a| u64::from(a.0) + 1);
    mix(mix(salt, TokenId(u32::MAX)), TokenId(adapter as u32))
}

/// What the request generates when it runs alone with no cache: the oracle.
pub(crate) fn reference_output(root: u64, prompt: &[TokenId], max_tokens: usize) -> Vec<TokenId> {
    let mut fingerprint = prompt.iter().fold(root, |fp, &t| mix(fp, t));
    let mut out = Vec::with_capacity(max_tokens);
    for _ in 0..max_tokens {
        let token = sample(fingerprint);
        out.push(token);
        fingerprint = mix(fingerprint, token);
    }
    out
}

/// The engine's view of one unfinished request.
#[derive(Debug, Clone)]
pub(crate) struct SimRequest {
    pub(crate) root: u64,
    pub(crate) prompt: Vec<TokenId>,
    pub(crate) output: Vec<TokenId>,
    pub(crate) max_tokens: usize,
}

impl SimRequest {
    fn token(&self, pos: usize) -> TokenId {
        match pos.checked_sub(self.prompt.len()) {
            None => self.prompt[pos],
            Some(i) => self.output[i],
        }
    }
}

/// The simulated engine: known requests and the KV slots.
#[derive(Debug, Default)]
pub(crate) struct SimEngine {
    pub(crate) requests: BTreeMap<RequestId, SimRequest>,
    /// The fingerprint in each (group, slot).
    slots: HashMap<(usize, usize), u64>,
    /// Outputs of requests finished by length, checked against the oracle.
    pub(crate) completed: BTreeMap<RequestId, Vec<TokenId>>,
}

impl SimEngine {
    /// Submits `request` and, when accepted, tracks it.
    pub(crate) fn submit(&mut self, sched: &mut Scheduler, request: Request) -> bool {
        let sim = SimRequest {
            root: root_fingerprint(&request),
            prompt: request.prompt_token_ids.clone(),
            output: Vec::new(),
            max_tokens: request.max_tokens,
        };
        let id = request.id;
        let accepted = sched.submit(request).is_ok();
        if accepted {
            self.requests.insert(id, sim);
        }
        accepted
    }

    /// Runs the model over a step: checks reads, writes KV, samples.
    pub(crate) fn run_model(
        &mut self,
        sched: &Scheduler,
        output: &SchedulerOutput,
    ) -> Vec<(RequestId, Vec<TokenId>)> {
        let bs = output.block_size;
        let pool = sched.kv_manager().pool();
        let mut results = Vec::new();
        for s in &output.scheduled {
            let Some(req) = self.requests.get(&s.id) else {
                continue; // Cancelled after scheduling; the engine skips it.
            };
            // Logits come from the last computed row, so every entry computes a token.
            assert!(
                s.num_new_tokens >= 1,
                "request {} scheduled with no tokens",
                s.id
            );
            assert_eq!(s.new_token_ids.len(), s.num_new_tokens);
            let groups = &sched.kv_manager().spec().groups;
            assert_eq!(s.block_tables.len(), groups.len());
            let end = s.num_computed_tokens + s.num_new_tokens;
            // Positions from `known_end` on hold drafts.
            let known_end = end - s.num_draft_tokens;
            assert!(s.num_draft_tokens == 0 || s.wants_logits);
            let token = |pos: usize| {
                if pos < known_end {
                    req.token(pos)
                } else {
                    s.new_token_ids[pos - s.num_computed_tokens]
                }
            };
            let mut fingerprint = req.root;
            let mut fingerprints = Vec::with_capacity(end);
            for pos in 0..end {
                fingerprint = mix(fingerprint, token(pos));
                fingerprints.push(fingerprint);
            }
            for (g, (table, group)) in s.block_tables.iter().zip(groups).enumerate() {
                assert_eq!(s.slot_mapping(g, bs).len(), s.num_new_tokens);
                assert!(table.len() * bs >= end, "table {g} of {} too short", s.id);
                // The first key the chunk's first query reads in this group.
                let first_key = match group.kind {
                    crate::LayerKind::SlidingWindow { window } => {
                        (s.num_computed_tokens + 1).saturating_sub(window)
                    }
                    _ => 0,
                };
                let slot = |pos: usize| {
                    let block = table.get(pos / bs).unwrap_or_else(|| {
                        panic!("request {} reads freed block at {pos} (group {g})", s.id)
                    });
                    (g, block.index() * bs + pos % bs)
                };
                for pos in first_key..end {
                    if pos < s.num_computed_tokens {
                        assert_eq!(
                            self.slots.get(&slot(pos)),
                            Some(&fingerprints[pos]),
                            "request {} reads wrong KV at position {pos} (group {g})",
                            s.id
                        );
                    } else {
                        let block_id = table.get(pos / bs).expect("new tokens' blocks are held");
                        assert_eq!(pool.ref_count(block_id), 1, "write to a shared block");
                        assert_eq!(pool.block_hash(block_id), None, "write to a cached block");
                        if pos < known_end {
                            assert_eq!(
                                req.token(pos),
                                s.new_token_ids[pos - s.num_computed_tokens]
                            );
                        }
                        self.slots.insert(slot(pos), fingerprints[pos]);
                    }
                }
            }
            if s.wants_logits {
                // Verify the drafts: take them while they are what is sampled.
                let mut tokens = Vec::new();
                for j in 0..=s.num_draft_tokens {
                    let t = sample(fingerprints[known_end - 1 + j]);
                    tokens.push(t);
                    if j == s.num_draft_tokens || t != token(known_end + j) {
                        break;
                    }
                }
                results.push((s.id, tokens));
            }
        }
        results
    }

    /// Proposes drafts of 1 to 5 tokens for running decodes: the oracle's
    /// next tokens, one of them sometimes wrong.
    pub(crate) fn propose(&self, sched: &mut Scheduler, rng: &mut Rng) {
        for (&id, req) in &self.requests {
            let Some(info) = sched.request(id) else {
                continue;
            };
            let known = req.prompt.len() + req.output.len();
            if info.status != RequestStatus::Running || info.num_computed_tokens + 1 != known {
                continue;
            }
            let reference = reference_output(req.root, &req.prompt, req.max_tokens + 5);
            let k = rng.range(1, 6);
            let mut draft = reference[req.output.len()..req.output.len() + k].to_vec();
            if rng.chance(50) {
                let i = rng.below(k);
                draft[i] = TokenId((draft[i].0 + 1 + rng.below(3) as u32) % VOCAB as u32);
            }
            sched.propose(id, draft);
        }
    }

    /// Schedules, runs and updates one step, mirroring sampled tokens and checking
    /// finished outputs against the oracle. Returns false when nothing was scheduled.
    pub(crate) fn step(&mut self, sched: &mut Scheduler) -> bool {
        let output = sched.schedule().expect("no step in flight");
        if output.is_empty() {
            return false;
        }
        let results = self.run_model(sched, &output);
        self.apply(sched, &results);
        true
    }

    /// Updates the scheduler with `results` and mirrors them.
    pub(crate) fn apply(&mut self, sched: &mut Scheduler, results: &[(RequestId, Vec<TokenId>)]) {
        let update = sched.update(results).expect("valid step results");
        for (id, tokens) in results {
            if let Some(req) = self.requests.get_mut(id) {
                req.output.extend_from_slice(tokens);
            }
        }
        for done in update.finished_by_length {
            let req = self.requests.remove(&done.id).expect("tracked request");
            assert_eq!(done.output_token_ids, req.output);
            assert_eq!(
                req.output,
                reference_output(req.root, &req.prompt, req.max_tokens),
                "request {} generated a different output than alone",
                done.id
            );
            self.completed.insert(done.id, req.output);
        }
    }

    /// Ends request `id` early (a stop condition or a client going away); its output
    /// so far must be a prefix of the oracle's.
    pub(crate) fn end(&mut self, sched: &mut Scheduler, id: RequestId, cancel: bool) {
        let done = if cancel {
            sched.cancel(id)
        } else {
            sched.finish(id)
        };
        let done = done.expect("tracked request");
        let req = self.requests.remove(&id).expect("tracked request");
        assert_eq!(done.output_token_ids, req.output);
        let reference = reference_output(req.root, &req.prompt, req.max_tokens);
        assert!(reference.starts_with(&req.output), "request {id} diverged");
    }
}
