//! The step scheduler: admission, the per-step token plan, preemption by recompute,
//! and the bookkeeping after each step.
//!
//! The engine drives it in a loop: [`Scheduler::schedule`] plans a step, the model
//! runs it, [`Scheduler::update`] records the sampled tokens, and the engine calls
//! [`Scheduler::finish`] for requests its stop checks ended. Each step maps requests
//! to token counts under one token budget, so prompt chunks and decodes share a
//! step; there are no prefill and decode phases.
//!
//! A step is planned in three passes, each in queue order (priority class, then
//! arrival): running requests with one token left (decodes), then the other running
//! requests (prompt chunks, as many tokens as the budget allows), then waiting
//! requests are admitted while the budget, the running cap and the free blocks
//! allow (the queue head blocks the rest, so admission is strictly in order; no
//! admission happens in a step that preempted). When a running request needs a
//! block and none is free, the running request last in queue order (lowest
//! priority, newest) is preempted: its blocks are released (its full blocks stay
//! cached), its computed count drops to 0 and it waits again with its generated
//! tokens kept, ahead of every later arrival of its class. It recomputes its
//! prompt and output when readmitted, hitting its own cached blocks. A request that
//! fits the pool alone always makes progress, because the request first in queue
//! order is never preempted while another runs.
//!
//! Everything is deterministic: the same calls give the same plans.

use std::collections::{BTreeMap, BTreeSet};

use kiln_sampling::TokenId;

use crate::block_pool::BlockId;
use crate::config::SchedulerConfig;
use crate::error::{ConfigError, SchedulerError, SubmitError};
use crate::hash::BlockHash;
use crate::kv_manager::KvManager;
use crate::output::{
    FinishedRequest, ScheduledRequest, SchedulerOutput, SchedulerStats, UpdateOutput,
};
use crate::request::{QueueKey, Request, RequestId, RequestInfo, RequestState, RequestStatus};

/// Counters that are not derived from the queues or the pool.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    num_preemptions: u64,
    num_prompt_tokens: u64,
    num_generated_tokens: u64,
    num_steps: u64,
    num_finished: u64,
    num_cancelled: u64,
    num_draft_tokens: u64,
    num_accepted_draft_tokens: u64,
    num_speculative_decodes: u64,
}

/// What the step in flight asked of one request.
#[derive(Debug, Clone)]
struct InFlight {
    wants_logits: bool,
    /// The request's first position in the step.
    start: usize,
    /// The drafts verified in the step (after the request's last known token).
    draft: Vec<TokenId>,
    /// The step writes the request's recurrent state to its spare slot.
    spare: bool,
}

/// A step being planned.
struct StepPlan {
    entries: Vec<(RequestId, usize)>,
    /// The drafts of the speculative decodes among the entries (their
    /// counts include them).
    drafts: BTreeMap<RequestId, Vec<TokenId>>,
    budget: usize,
    preempted: Vec<RequestId>,
}

impl StepPlan {
    fn contains(&self, id: RequestId) -> bool {
        self.entries.iter().any(|&(entry_id, _)| entry_id == id)
    }
}

/// The scheduler: the waiting and running requests, their KV blocks, and the step
/// protocol. It owns no tensors and is driven by one thread.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvManager,
    requests: BTreeMap<RequestId, RequestState>,
    waiting: BTreeSet<QueueKey>,
    running: BTreeSet<QueueKey>,
    /// The step awaiting its update: what each scheduled request computes.
    in_flight: Option<BTreeMap<RequestId, InFlight>>,
    /// Draft tokens proposed for the next step's decodes ([`Scheduler::propose`]).
    proposals: BTreeMap<RequestId, Vec<TokenId>>,
    next_arrival: u64,
    counters: Counters,
}

impl Scheduler {
    /// A scheduler with an empty pool of `config.num_blocks` blocks. Fails if a limit
    /// is 0 or the KV layout cannot be served (recurrent layers).
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        for (name, value) in [
            ("max_model_len", config.max_model_len),
            ("max_num_batched_tokens", config.max_num_batched_tokens),
            ("max_num_seqs", config.max_num_seqs),
            ("max_waiting", config.max_waiting),
        ] {
            if value == 0 {
                return Err(ConfigError::MustBePositive { name });
            }
        }
        if config.state_slots != 0 && config.state_slots < config.max_num_seqs {
            return Err(ConfigError::TooFewStateSlots {
                state_slots: config.state_slots,
                max_num_seqs: config.max_num_seqs,
            });
        }
        let bs = config.kv_cache.block_size.max(1);
        if config.state_slots > 0 && config.state_checkpoint_tokens % bs != 0 {
            return Err(ConfigError::MustBePositive {
                name: "state_checkpoint_tokens (a positive multiple of the block size)",
            });
        }
        let states = (config.state_slots > 0).then_some(crate::kv_manager::StateConfig {
            running: config.state_slots,
            snapshots: config.state_snapshots,
            interval: config.state_checkpoint_tokens,
            spares: config.state_spare_slots,
        });
        let kv = KvManager::new(config.kv_cache.clone(), config.num_blocks, states)?;
        Ok(Scheduler {
            config,
            kv,
            requests: BTreeMap::new(),
            waiting: BTreeSet::new(),
            running: BTreeSet::new(),
            in_flight: None,
            proposals: BTreeMap::new(),
            next_arrival: 0,
            counters: Counters::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV bookkeeping, read-only: block tables, the pool and its counters.
    pub fn kv_manager(&self) -> &KvManager {
        &self.kv
    }

    #[cfg(test)]
    pub(crate) fn kv_manager_mut(&mut self) -> &mut KvManager {
        &mut self.kv
    }

    /// Lends `n` free blocks for work outside the scheduled requests (an
    /// embedding pass, whose keys and values live only for that pass): all
    /// or nothing, `None` when fewer are free or a step is in flight. The
    /// blocks are never registered in the prefix cache; give them back with
    /// [`Scheduler::take_back_blocks`] before the next [`Scheduler::schedule`].
    pub fn lend_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.in_flight.is_some() {
            return None;
        }
        self.kv.lend(n)
    }

    /// Takes back blocks [`Scheduler::lend_blocks`] lent.
    pub fn take_back_blocks(&mut self, blocks: &[BlockId]) {
        self.kv.take_back(blocks);
    }

    /// Queues a request, or refuses it at once: [`SubmitError::TooLong`] and
    /// [`SubmitError::ExceedsPool`] when it could never run, with the numbers;
    /// [`SubmitError::Busy`] when the waiting queue is full. Invalid requests are
    /// refused before a full queue is reported, so a client is never told to retry
    /// a request that cannot succeed.
    pub fn submit(&mut self, request: Request) -> Result<(), SubmitError> {
        let Request {
            id,
            prompt_token_ids,
            max_tokens,
            priority,
            cache_salt,
            adapter_id,
        } = request;
        if self.requests.contains_key(&id) {
            return Err(SubmitError::DuplicateId { id });
        }
        if prompt_token_ids.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        let num_prompt_tokens = prompt_token_ids.len();
        if num_prompt_tokens.saturating_add(max_tokens) > self.config.max_model_len {
            return Err(SubmitError::TooLong {
                prompt_tokens: num_prompt_tokens,
                max_tokens,
                max_model_len: self.config.max_model_len,
            });
        }
        // The last generated token is sampled but never computed, so it needs no KV.
        let blocks_needed = self.config.kv_cache.max_blocks_for(
            num_prompt_tokens + max_tokens - 1,
            self.config.max_num_batched_tokens,
        );
        if blocks_needed > self.config.num_blocks {
            return Err(SubmitError::ExceedsPool {
                blocks_needed,
                pool_blocks: self.config.num_blocks,
            });
        }
        if self.waiting.len() >= self.config.max_waiting {
            return Err(SubmitError::Busy {
                waiting: self.waiting.len(),
                max_waiting: self.config.max_waiting,
            });
        }
        let order = QueueKey {
            priority,
            arrival: self.next_arrival,
            id,
        };
        self.next_arrival += 1;
        self.waiting.insert(order);
        self.requests.insert(
            id,
            RequestState {
                token_ids: prompt_token_ids,
                num_prompt_tokens,
                max_tokens,
                root_hash: BlockHash::root(adapter_id, cache_salt.as_deref()),
                num_computed_tokens: 0,
                num_cached_tokens: None,
                num_preemptions: 0,
                status: RequestStatus::Waiting,
                order,
            },
        );
        Ok(())
    }

    /// Proposes `draft`, guessed tokens after the last one of running request
    /// `id`, for verification in its next decode: that step computes the last
    /// known token and the drafts (cut to what the budget, `max_tokens` and the
    /// free blocks allow — drafts never preempt anything; with none left the
    /// decode is plain), and [`Scheduler::update`] takes the sampled tokens,
    /// keeps the KV of the drafts they confirm and gives back the rest. A
    /// request with a prompt chunk still to compute and a waiting one ignore
    /// proposals, and so do the requests of a model with recurrent layers
    /// unless spare state slots are configured
    /// ([`SchedulerConfig::state_spare_slots`]: their state cannot step
    /// back). A later proposal replaces an earlier one.
    pub fn propose(&mut self, id: RequestId, draft: Vec<TokenId>) {
        let stateful = self.config.state_slots > 0;
        if (stateful && self.config.state_spare_slots == 0) || self.in_flight.is_some() {
            return;
        }
        let decoding = self
            .requests
            .get(&id)
            .is_some_and(|r| r.status == RequestStatus::Running && r.num_remaining_tokens() == 1);
        if decoding && !draft.is_empty() {
            self.proposals.insert(id, draft);
        }
    }

    /// Plans the next step (see the module docs). An empty output starts no step;
    /// otherwise the step is in flight until [`Scheduler::update`], and scheduling
    /// again before that is [`SchedulerError::StepInFlight`].
    pub fn schedule(&mut self) -> Result<SchedulerOutput, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(SchedulerError::StepInFlight);
        }
        let mut plan = StepPlan {
            entries: Vec::new(),
            budget: self.config.max_num_batched_tokens,
            preempted: Vec::new(),
            drafts: BTreeMap::new(),
        };
        let order: Vec<QueueKey> = self.running.iter().copied().collect();
        for key in &order {
            if plan.budget == 0 {
                break;
            }
            if self.running.contains(key) && self.requests[&key.id].num_remaining_tokens() == 1 {
                self.schedule_running(*key, 1, &mut plan);
            }
        }
        for key in &order {
            if plan.budget == 0 {
                break;
            }
            if !self.running.contains(key) || plan.contains(key.id) {
                continue;
            }
            let num_new_tokens = self.requests[&key.id]
                .num_remaining_tokens()
                .min(plan.budget);
            if num_new_tokens > 0 {
                self.schedule_running(*key, num_new_tokens, &mut plan);
            }
        }
        // Drafts extend the decodes with what the running requests' own
        // tokens left of the budget and the free blocks, before admissions.
        // (Proposals are for one step: those no decode takes are dropped.)
        let mut proposals = std::mem::take(&mut self.proposals);
        for key in &order {
            if plan.budget == 0 || proposals.is_empty() {
                break;
            }
            if let Some(draft) = proposals.remove(&key.id) {
                if self.running.contains(key) && plan.contains(key.id) {
                    self.schedule_speculative(*key, draft, &mut plan);
                }
            }
        }
        if plan.preempted.is_empty() {
            self.admit_waiting(&mut plan);
        }
        Ok(self.emit(plan))
    }

    /// Schedules `num_new_tokens` for running request `key`, preempting from the
    /// back of the running set until its blocks fit (possibly itself).
    fn schedule_running(&mut self, key: QueueKey, num_new_tokens: usize, plan: &mut StepPlan) {
        loop {
            let num_computed = self.requests[&key.id].num_computed_tokens;
            if self
                .kv
                .allocate_for(key.id, num_computed, num_new_tokens)
                .is_ok()
            {
                plan.entries.push((key.id, num_new_tokens));
                plan.budget -= num_new_tokens;
                return;
            }
            let victim = *self
                .running
                .last()
                .expect("the request being scheduled is running; this is a bug");
            self.preempt(victim, plan);
            if victim == key {
                return;
            }
        }
    }

    /// Extends decode `key` (planned with its one token) by its drafts, cut
    /// to the budget, its `max_tokens` and the blocks free now (drafts never
    /// preempt); the drafts that do not fit are dropped.
    fn schedule_speculative(
        &mut self,
        key: QueueKey,
        mut draft: Vec<TokenId>,
        plan: &mut StepPlan,
    ) {
        // A request with recurrent state writes it to a spare slot, or
        // decodes without guesses.
        let spare = self.kv.has_states();
        if spare && self.kv.spare_slot(key.id).is_none() {
            return;
        }
        let req = &self.requests[&key.id];
        // Accepting every draft gives one more token: at most max_tokens.
        let room = req.max_tokens - req.num_output_tokens();
        draft.truncate(room.saturating_sub(1).min(plan.budget));
        let num_computed = req.num_computed_tokens;
        // The blocks the decode holds already have room for this many.
        let bs = self.kv.block_size();
        let held = (num_computed + 1).div_ceil(bs) * bs - num_computed - 1;
        while !draft.is_empty() {
            if draft.len() <= held
                || self
                    .kv
                    .allocate_for(key.id, num_computed, 1 + draft.len())
                    .is_ok()
            {
                let entry = plan
                    .entries
                    .iter_mut()
                    .find(|(id, _)| *id == key.id)
                    .expect("the decode is planned; this is a bug");
                entry.1 += draft.len();
                plan.budget -= draft.len();
                plan.drafts.insert(key.id, draft);
                return;
            }
            draft.truncate(held);
        }
        if spare {
            self.kv.spare_done(key.id, false);
        }
    }

    /// Moves running request `key` back to the waiting queue, releasing its blocks
    /// and taking it out of the plan (refunding its budget).
    fn preempt(&mut self, key: QueueKey, plan: &mut StepPlan) {
        self.running.remove(&key);
        self.kv.free(key.id);
        let req = self
            .requests
            .get_mut(&key.id)
            .expect("running requests are known; this is a bug");
        req.num_computed_tokens = 0;
        req.status = RequestStatus::Waiting;
        req.num_preemptions += 1;
        self.waiting.insert(key);
        self.counters.num_preemptions += 1;
        if let Some(pos) = plan.entries.iter().position(|&(id, _)| id == key.id) {
            let (_, num_new_tokens) = plan.entries.remove(pos);
            plan.budget += num_new_tokens;
        }
        plan.preempted.push(key.id);
    }

    /// Admits waiting requests in queue order while budget, running cap and blocks
    /// allow, each with its cached prefix and a first chunk.
    fn admit_waiting(&mut self, plan: &mut StepPlan) {
        while plan.budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&key) = self.waiting.first() else {
                break;
            };
            let req = self
                .requests
                .get_mut(&key.id)
                .expect("waiting requests are known; this is a bug");
            let Ok(admission) = self
                .kv
                .admit(key.id, &req.token_ids, req.root_hash, plan.budget)
            else {
                break;
            };
            self.waiting.remove(&key);
            self.running.insert(key);
            req.status = RequestStatus::Running;
            req.num_computed_tokens = admission.num_cached_tokens;
            if req.num_cached_tokens.is_none() {
                req.num_cached_tokens = Some(admission.num_cached_tokens);
                self.counters.num_prompt_tokens += req.num_prompt_tokens as u64;
            }
            plan.entries.push((key.id, admission.num_new_tokens));
            plan.budget -= admission.num_new_tokens;
        }
    }

    /// Turns the plan into the output and marks its tokens computed.
    fn emit(&mut self, mut plan: StepPlan) -> SchedulerOutput {
        let mut scheduled = Vec::with_capacity(plan.entries.len());
        let mut in_flight = BTreeMap::new();
        let mut num_batched_tokens = 0;
        for (id, num_new_tokens) in plan.entries {
            let req = self
                .requests
                .get_mut(&id)
                .expect("planned requests are known; this is a bug");
            let start = req.num_computed_tokens;
            let draft = plan.drafts.remove(&id).unwrap_or_default();
            let end = start + num_new_tokens - draft.len();
            let wants_logits = end == req.token_ids.len();
            let mut state_restore = self.kv.take_restore(id);
            let mut state_slot = self.kv.state_slot(id);
            // A speculative decode with recurrent state starts from the
            // request's slot and writes its spare (kept by `update` when
            // every draft is accepted).
            let spare = !draft.is_empty() && state_slot.is_some();
            if spare {
                let out = self.kv.spare_slot(id);
                state_restore = state_restore.or(state_slot);
                state_slot = out;
            }
            let state_snapshots = self.kv.plan_snapshots(
                id,
                req.root_hash,
                &req.token_ids,
                req.num_prompt_tokens,
                start,
                end,
            );
            scheduled.push(ScheduledRequest {
                id,
                num_computed_tokens: start,
                num_new_tokens,
                new_token_ids: req.token_ids[start..end]
                    .iter()
                    .chain(&draft)
                    .copied()
                    .collect(),
                block_tables: self.kv.block_tables(id).unwrap_or_default().to_vec(),
                state_slot,
                state_restore,
                state_snapshots,
                wants_logits,
                num_draft_tokens: draft.len(),
            });
            req.num_computed_tokens = end + draft.len();
            if !draft.is_empty() {
                self.counters.num_speculative_decodes += 1;
                self.counters.num_draft_tokens += draft.len() as u64;
            }
            in_flight.insert(
                id,
                InFlight {
                    wants_logits,
                    start,
                    draft,
                    spare,
                },
            );
            num_batched_tokens += num_new_tokens;
        }
        if !scheduled.is_empty() {
            self.in_flight = Some(in_flight);
            self.counters.num_steps += 1;
        }
        SchedulerOutput {
            scheduled,
            preempted: plan.preempted,
            num_batched_tokens,
            block_size: self.kv.block_size(),
        }
    }

    /// Completes the step in flight with the engine's sampled tokens: exactly one
    /// token for each request whose step wanted logits, none for the others (such
    /// requests may be left out). Results for requests finished or cancelled since
    /// the step was scheduled are ignored. Registers the blocks the step filled in
    /// the prefix cache, appends the tokens, and finishes requests that reached
    /// `max_tokens`. On error nothing changed and the step stays in flight.
    pub fn update(
        &mut self,
        results: &[(RequestId, Vec<TokenId>)],
    ) -> Result<UpdateOutput, SchedulerError> {
        let step = self
            .in_flight
            .as_ref()
            .ok_or(SchedulerError::NoStepInFlight)?;
        let mut sampled: BTreeMap<RequestId, &[TokenId]> = BTreeMap::new();
        for (id, token_ids) in results {
            let Some(&InFlight { wants_logits, .. }) = step.get(id) else {
                return Err(SchedulerError::NotScheduled { id: *id });
            };
            if sampled.insert(*id, token_ids).is_some() {
                return Err(SchedulerError::DuplicateResult { id: *id });
            }
            // A sampling step gives its token and possibly more that an
            // output format forced (jump-forward); they are computed with
            // the next step's chunk. A step that only computed prompt
            // tokens gives none.
            let expected = usize::from(wants_logits);
            let ok = if wants_logits {
                !token_ids.is_empty()
            } else {
                token_ids.is_empty()
            };
            if self.is_running(*id) && !ok {
                return Err(SchedulerError::WrongTokenCount {
                    id: *id,
                    expected,
                    got: token_ids.len(),
                });
            }
        }
        if let Some((&id, _)) = step
            .iter()
            .find(|&(id, f)| f.wants_logits && self.is_running(*id) && !sampled.contains_key(id))
        {
            return Err(SchedulerError::WrongTokenCount {
                id,
                expected: 1,
                got: 0,
            });
        }
        let step = self.in_flight.take().unwrap_or_default();
        self.kv.publish_snapshots();
        let mut out = UpdateOutput::default();
        for (id, flight) in step {
            if !self.is_running(id) {
                continue;
            }
            let req = self
                .requests
                .get_mut(&id)
                .expect("running requests are known; this is a bug");
            if !flight.draft.is_empty() {
                // The sampled tokens confirm the drafts they repeat (the last
                // one is always new: it was never computed); the KV of the
                // rest was written but is dropped.
                let tokens = sampled.get(&id).copied().unwrap_or_default();
                let accepted = tokens
                    .iter()
                    .zip(&flight.draft)
                    .take_while(|(t, d)| t == d)
                    .count()
                    .min(tokens.len().saturating_sub(1));
                req.num_computed_tokens = flight.start + 1 + accepted;
                if flight.spare {
                    // The spare holds the state after every draft: the
                    // request's when all were accepted; else its slot still
                    // holds the state before the step, and the step's
                    // accepted tokens are computed again from there.
                    let all = accepted == flight.draft.len();
                    self.kv.spare_done(id, all);
                    if !all {
                        req.num_computed_tokens = flight.start;
                    }
                }
                self.kv.truncate(id, req.num_computed_tokens);
                self.counters.num_accepted_draft_tokens += accepted as u64;
            }
            // The sampled tokens first: a speculative decode's accepted
            // drafts are among them and computed.
            if let Some(token_ids) = sampled.get(&id) {
                req.token_ids.extend_from_slice(token_ids);
                self.counters.num_generated_tokens += token_ids.len() as u64;
            }
            self.kv
                .register_full_blocks(id, &req.token_ids, req.num_computed_tokens);
            self.kv.free_out_of_window(id, req.num_computed_tokens);
            if req.num_output_tokens() >= req.max_tokens {
                let finished = self
                    .remove(id, false)
                    .expect("the request is running; this is a bug");
                out.finished_by_length.push(finished);
            }
        }
        Ok(out)
    }

    /// Removes a request the engine finished (stop token, stop string, ...) and
    /// frees its blocks at once; its full blocks stay cached.
    pub fn finish(&mut self, id: RequestId) -> Result<FinishedRequest, SchedulerError> {
        self.remove(id, false)
    }

    /// Removes a request whose client went away, waiting or running, and frees its
    /// blocks at once. This is safe between `schedule` and `update`: the step in
    /// flight writes only blocks the request owned alone, nothing registers them,
    /// and its results are ignored by the update.
    pub fn cancel(&mut self, id: RequestId) -> Result<FinishedRequest, SchedulerError> {
        self.remove(id, true)
    }

    fn remove(
        &mut self,
        id: RequestId,
        cancelled: bool,
    ) -> Result<FinishedRequest, SchedulerError> {
        let mut req = self
            .requests
            .remove(&id)
            .ok_or(SchedulerError::UnknownRequest { id })?;
        match req.status {
            RequestStatus::Waiting => self.waiting.remove(&req.order),
            RequestStatus::Running => self.running.remove(&req.order),
        };
        self.kv.free(id);
        if cancelled {
            self.counters.num_cancelled += 1;
        } else {
            self.counters.num_finished += 1;
        }
        Ok(FinishedRequest {
            id,
            num_prompt_tokens: req.num_prompt_tokens,
            num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
            output_token_ids: req.token_ids.split_off(req.num_prompt_tokens),
            num_preemptions: req.num_preemptions,
        })
    }

    fn is_running(&self, id: RequestId) -> bool {
        self.requests
            .get(&id)
            .is_some_and(|r| r.status == RequestStatus::Running)
    }

    /// A snapshot of an unfinished request's progress.
    pub fn request(&self, id: RequestId) -> Option<RequestInfo> {
        self.requests.get(&id).map(RequestState::info)
    }

    /// The tokens an unfinished request has generated so far.
    pub fn output_token_ids(&self, id: RequestId) -> Option<&[TokenId]> {
        self.requests
            .get(&id)
            .map(|r| &r.token_ids[r.num_prompt_tokens..])
    }

    /// Requests waiting now.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running now.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// True while any request is waiting or running.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty()
    }

    /// True between a non-empty `schedule` and its `update`.
    pub fn is_step_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The counters for the server.
    pub fn stats(&self) -> SchedulerStats {
        let pool = self.kv.pool();
        SchedulerStats {
            num_waiting: self.waiting.len(),
            num_running: self.running.len(),
            num_blocks_used: pool.num_used_blocks(),
            num_blocks_total: pool.num_blocks(),
            num_blocks_cached: pool.num_cached_blocks(),
            prefix_cache: self.kv.prefix_cache_stats(),
            num_evictions: pool.stats().num_evictions,
            num_preemptions: self.counters.num_preemptions,
            num_prompt_tokens: self.counters.num_prompt_tokens,
            num_generated_tokens: self.counters.num_generated_tokens,
            num_steps: self.counters.num_steps,
            num_finished: self.counters.num_finished,
            num_cancelled: self.counters.num_cancelled,
            num_draft_tokens: self.counters.num_draft_tokens,
            num_accepted_draft_tokens: self.counters.num_accepted_draft_tokens,
            num_speculative_decodes: self.counters.num_speculative_decodes,
        }
    }

    /// Checks the scheduler's invariants on top of the KV manager's: each request is
    /// in exactly its status's set, the running cap holds, waiting requests hold no
    /// blocks and running ones hold exactly the blocks their computed tokens need.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        if self.waiting.len() + self.running.len() != self.requests.len() {
            return Err("queue sizes do not add up".to_string());
        }
        if self.running.len() > self.config.max_num_seqs {
            return Err("too many running requests".to_string());
        }
        let bs = self.kv.block_size();
        for (id, req) in &self.requests {
            let tables = self.kv.block_tables(*id);
            match req.status {
                RequestStatus::Waiting => {
                    if !self.waiting.contains(&req.order) || tables.is_some() {
                        return Err(format!("waiting request {id} is misfiled or holds blocks"));
                    }
                }
                RequestStatus::Running => {
                    let expected = req.num_computed_tokens.div_ceil(bs);
                    // Every table covers the computed tokens and holds every block
                    // a later query can read.
                    let sized = tables.is_some_and(|tables| {
                        tables.len() == self.kv.spec().groups.len()
                            && tables.iter().zip(&self.kv.spec().groups).all(|(t, g)| {
                                t.len() == expected
                                    && t.first
                                        <= g.kind
                                            .first_needed_block_idx(bs, req.num_computed_tokens)
                            })
                    });
                    if !self.running.contains(&req.order) || !sized {
                        return Err(format!("running request {id} is misfiled or mis-sized"));
                    }
                }
            }
            if req.num_output_tokens() >= req.max_tokens
                || req.num_computed_tokens > req.token_ids.len()
            {
                return Err(format!("request {id} overran its tokens"));
            }
        }
        Ok(())
    }
}
