//! The loop thread's side of the engine: [`Loop`] owns the scheduler, the
//! KV cache and the requests in flight, takes [`Command`]s between steps and
//! runs each step (schedule, one forward pass, sample on the device or the
//! host, send events); embedding passes run between steps.

use super::*;

mod speculate;

/// A group's block table as the backend reads it: the entries a sliding
/// window freed name the first held block (the kernels never read them).
fn backend_table(t: &kiln_scheduler::BlockTable) -> Vec<u32> {
    let fill = t.blocks.first().map_or(0, |b| b.0);
    std::iter::repeat_n(fill, t.first)
        .chain(t.blocks.iter().map(|b| b.0))
        .collect()
}

/// A step's logits on the host, or the ids the device picked.
enum Logits {
    Full(Vec<f32>),
    /// Every row sampled on the device (`None`: no token was possible).
    Picked(Vec<Option<SampledRow>>),
    /// The device's pick of every row, and the host logits of some: row
    /// `r`'s are block `index[r]` of `host`.
    Mixed {
        picked: Vec<Option<SampledRow>>,
        host: Vec<f32>,
        index: Vec<Option<usize>>,
    },
}

/// A request the loop is serving.
struct Active<'m> {
    proc: TokenProcessor<'m>,
    /// The LoRA adapter its rows run with.
    adapter: Option<Arc<kiln_tensor::LoraAdapter>>,
    want_logprobs: bool,
    events: Sender<Event>,
    /// The caller dropped its stream.
    abandoned: Arc<AtomicBool>,
    submitted: Instant,
    first_step: Option<Instant>,
    first_token: Option<Instant>,
    /// Its speculation: prediction, draft length, counts.
    spec: SpecState,
}

pub(in crate::engine) struct Loop<'m> {
    model: &'m LoadedModel,
    scheduler: Scheduler,
    cache: kiln_tensor::KvCache,
    block_size: usize,
    active: HashMap<RequestId, Active<'m>>,
    pub(in crate::engine) next_id: u64,
    num_steps: u64,
    step_seconds_total: f64,
    last_step_seconds: f64,
    decode_steps: u64,
    decode_step_seconds_total: f64,
    decode_step_tokens: u64,
    masks: MaskStats,
    /// Embedding jobs waiting for blocks, oldest first.
    embeds: VecDeque<EmbedJob>,
    embed_passes: u64,
    embed_inputs: u64,
    embed_seconds: f64,
    /// The model's cumulative expert load after each of the last steps,
    /// oldest first (empty for a dense model).
    expert_loads: VecDeque<Vec<Vec<u64>>>,
    /// Whether the backend samples rows where the logits are (until it
    /// first says it cannot).
    device_sampler: bool,
    /// How requests speculate.
    pub(in crate::engine) speculative: SpeculativeConfig,
    /// The draft model (`--speculative draft`).
    pub(in crate::engine) draft: Option<DraftModel<'m>>,
    /// The model's multi-token-prediction head (`--speculative mtp`).
    pub(in crate::engine) mtp: Option<crate::mtp::MtpProposer<'m>>,
    /// After an injected fault, the supervisor restarts the loop once this
    /// is released (the test hook's gate).
    #[cfg(feature = "fault-injection")]
    pub(in crate::engine) restart_hold: Option<Receiver<()>>,
}

/// Counters of the output-format masks computed alongside forward passes.
#[derive(Debug, Default)]
struct MaskStats {
    steps: u64,
    count: u64,
    seconds: f64,
    wait_seconds: f64,
}

impl<'m> Loop<'m> {
    /// A loop over `state` whose first request gets id `next_id`.
    pub(in crate::engine) fn new(
        model: &'m LoadedModel,
        (scheduler, cache): (Scheduler, kiln_tensor::KvCache),
        block_size: usize,
        next_id: u64,
    ) -> Self {
        Loop {
            model,
            scheduler,
            cache,
            block_size,
            active: HashMap::new(),
            next_id,
            num_steps: 0,
            step_seconds_total: 0.0,
            last_step_seconds: 0.0,
            decode_steps: 0,
            decode_step_seconds_total: 0.0,
            decode_step_tokens: 0,
            masks: MaskStats::default(),
            embeds: VecDeque::new(),
            embed_passes: 0,
            embed_inputs: 0,
            embed_seconds: 0.0,
            expert_loads: {
                // The load before the first step: the window's baseline.
                let now = model.model.expert_load();
                if now.is_empty() {
                    VecDeque::new()
                } else {
                    VecDeque::from([now])
                }
            },
            device_sampler: true,
            speculative: SpeculativeConfig::default(),
            draft: None,
            mtp: None,
            #[cfg(feature = "fault-injection")]
            restart_hold: None,
        }
    }

    /// After a step: the model's cumulative expert load joins the window
    /// (a dense model has none to keep).
    fn note_expert_load(&mut self) {
        if self.expert_loads.is_empty() {
            return;
        }
        if self.expert_loads.len() > EXPERT_WINDOW_STEPS {
            self.expert_loads.pop_front();
        }
        self.expert_loads.push_back(self.model.model.expert_load());
    }

    /// Tokens each expert was routed over the window's steps.
    fn recent_expert_tokens(&self) -> Vec<Vec<u64>> {
        let (Some(old), Some(new)) = (self.expert_loads.front(), self.expert_loads.back()) else {
            return Vec::new();
        };
        new.iter()
            .zip(old)
            .map(|(n, o)| n.iter().zip(o).map(|(a, b)| a.saturating_sub(*b)).collect())
            .collect()
    }

    pub(in crate::engine) fn run(&mut self, commands: &Receiver<Command>) {
        loop {
            // Take every waiting command; block only when there is no work.
            loop {
                let cmd = if self.scheduler.has_unfinished_requests() || !self.embeds.is_empty() {
                    match commands.try_recv() {
                        Ok(c) => c,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => return,
                    }
                } else {
                    match commands.recv_timeout(Duration::from_secs(3600)) {
                        Ok(c) => c,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                };
                match cmd {
                    Command::Submit {
                        request,
                        prepared,
                        events,
                        abandoned,
                        reply,
                    } => {
                        let admitted = self.admit(request, prepared, events, abandoned);
                        let _ = reply.send(admitted);
                    }
                    Command::Stats { reply } => {
                        let _ = reply.send(EngineStats {
                            scheduler: self.scheduler.stats(),
                            num_steps: self.num_steps,
                            step_seconds_total: self.step_seconds_total,
                            last_step_seconds: self.last_step_seconds,
                            decode_steps: self.decode_steps,
                            decode_step_seconds_total: self.decode_step_seconds_total,
                            decode_step_tokens: self.decode_step_tokens,
                            mask_steps: self.masks.steps,
                            masks: self.masks.count,
                            mask_seconds_total: self.masks.seconds,
                            mask_wait_seconds_total: self.masks.wait_seconds,
                            embed_passes: self.embed_passes,
                            embed_inputs: self.embed_inputs,
                            embed_seconds_total: self.embed_seconds,
                            expert_tokens: self.recent_expert_tokens(),
                            expert_steps: self.expert_loads.len().saturating_sub(1) as u64,
                            device: self.model.model.backend().name().to_string(),
                            weight_bytes: self
                                .model
                                .model
                                .weight_bytes()
                                .map(|w| w.0.clone())
                                .unwrap_or_default(),
                            device_memory: self.model.model.backend().device_memory(),
                        });
                    }
                    Command::Embed(job) => self.queue_embed(job),
                    Command::Shutdown => return,
                    #[cfg(feature = "fault-injection")]
                    Command::InjectPanic { hold } => {
                        self.restart_hold = Some(hold);
                        panic!("injected engine fault (the `fault-injection` test hook)");
                    }
                }
            }
            self.run_embeds();
            self.step();
        }
    }

    /// Queues an embedding job, or refuses it at once when its inputs could
    /// never have the blocks they need.
    fn queue_embed(&mut self, job: EmbedJob) {
        let need = embed::blocks_needed(self.model, &job.inputs, self.block_size);
        let total = self.scheduler.kv_manager().pool().num_blocks();
        if need > total {
            let _ = job.reply.send(Err(EngineError::InvalidRequest(format!(
                "the inputs need {need} KV blocks of {} tokens at once, more than the pool's {total}; \
                 send fewer or shorter inputs",
                self.block_size
            ))));
            return;
        }
        self.embeds.push_back(job);
    }

    /// Embeds queued jobs, oldest first, in passes of up to the step token
    /// budget, each over blocks the scheduler lends for the pass; stops at
    /// the first job the pool cannot hold now (it waits for blocks that
    /// running requests give back).
    fn run_embeds(&mut self) {
        let budget = self.scheduler.config().max_num_batched_tokens;
        while !self.embeds.is_empty() {
            // Jobs taken together: at least one, then while the budget lasts.
            let (mut take, mut tokens) = (0, 0);
            for job in &self.embeds {
                let t: usize = job.inputs.iter().map(|i| i.ids.len()).sum();
                if take > 0 && tokens + t > budget {
                    break;
                }
                take += 1;
                tokens += t;
            }
            let jobs: Vec<EmbedJob> = self.embeds.drain(..take).collect();
            let inputs: Vec<EmbedInput> =
                jobs.iter().flat_map(|j| j.inputs.iter().cloned()).collect();
            let need = embed::blocks_needed(self.model, &inputs, self.block_size);
            let Some(blocks) = self.scheduler.lend_blocks(need) else {
                // Not now: back to the front, in order.
                for job in jobs.into_iter().rev() {
                    self.embeds.push_front(job);
                }
                if take > 1 {
                    // A smaller pass may fit: retry with the first job alone.
                    let first = self.embeds.pop_front().expect("just pushed; this is a bug");
                    let need = embed::blocks_needed(self.model, &first.inputs, self.block_size);
                    if let Some(blocks) = self.scheduler.lend_blocks(need) {
                        self.embed_pass(vec![first], blocks);
                        continue;
                    }
                    self.embeds.push_front(first);
                }
                return;
            };
            self.embed_pass(jobs, blocks);
        }
    }

    /// One embedding pass over lent `blocks`, which go back after it.
    fn embed_pass(&mut self, jobs: Vec<EmbedJob>, blocks: Vec<kiln_scheduler::BlockId>) {
        let started = Instant::now();
        let inputs: Vec<EmbedInput> = jobs.iter().flat_map(|j| j.inputs.iter().cloned()).collect();
        let ids: Vec<u32> = blocks.iter().map(|b| b.0).collect();
        let head = jobs[0].head.clone();
        let result = embed::embed_in(self.model, &head, &inputs, &mut self.cache, &ids);
        self.scheduler.take_back_blocks(&blocks);
        self.embed_passes += 1;
        self.embed_inputs += inputs.len() as u64;
        self.embed_seconds += started.elapsed().as_secs_f64();
        match result {
            Ok(mut vectors) => {
                for job in jobs {
                    let rest = vectors.split_off(job.inputs.len());
                    let _ = job.reply.send(Ok(std::mem::replace(&mut vectors, rest)));
                }
            }
            Err(e) => {
                let message = e.to_string();
                for job in jobs {
                    let _ = job.reply.send(Err(EngineError::Failed(message.clone())));
                }
            }
        }
    }

    fn admit(
        &mut self,
        request: GenerationRequest,
        prepared: PreparedRequest,
        events: Sender<Event>,
        abandoned: Arc<AtomicBool>,
    ) -> Result<u64> {
        let id = RequestId(self.next_id);
        let max_tokens = prepared.max_new();
        let mut proc = TokenProcessor::attach(self.model, prepared);
        proc.set_jump_forward(request.jump_forward);
        let prompt: Vec<TokenId> = request.prompt.iter().map(|&t| TokenId(t)).collect();
        let mut sreq = Request::new(id, prompt, max_tokens);
        sreq.priority = Priority(request.priority);
        sreq.cache_salt = request.cache_salt.clone();
        sreq.adapter_id = request.adapter.as_ref().map(|a| AdapterId(a.id));
        self.scheduler.submit(sreq)?;
        self.next_id += 1;
        self.active.insert(
            id,
            Active {
                proc,
                adapter: request.adapter,
                want_logprobs: request.params.logprobs.is_some(),
                events,
                abandoned,
                submitted: Instant::now(),
                first_step: None,
                first_token: None,
                spec: SpecState::new(
                    request
                        .prediction
                        .map(|p| p.into_iter().map(TokenId).collect()),
                ),
            },
        );
        Ok(id.0)
    }

    fn step(&mut self) {
        let started = Instant::now();
        let decode_tokens = self.step_inner();
        if let Some(n) = decode_tokens {
            self.decode_steps += 1;
            self.decode_step_tokens += n as u64;
            self.decode_step_seconds_total += started.elapsed().as_secs_f64();
        }
    }

    /// Cancels the requests whose caller dropped its stream, before the
    /// step is scheduled: a queued one is never prefilled.
    fn drop_abandoned(&mut self) {
        let gone: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.abandoned.load(Ordering::Acquire))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            let _ = self.scheduler.cancel(id);
            self.active.remove(&id);
        }
    }

    /// One step; returns the number of sequences when it was a pure decode step.
    fn step_inner(&mut self) -> Option<usize> {
        self.drop_abandoned();
        self.propose_drafts();
        let mut out = match self.scheduler.schedule() {
            Ok(o) => o,
            Err(e) => {
                self.fail_all(&format!("scheduler: {e}"));
                return None;
            }
        };
        if out.scheduled.is_empty() {
            return None;
        }
        // The rows of one adapter side by side (base rows first, each
        // adapter's in scheduling order): one run of rows per adapter, so
        // the GPU adds each projection's deltas in one segment per adapter.
        // Results go back by request id, so the order is the engine's to pick.
        let adapter_of = |a: Option<&Active<'_>>| a.and_then(|a| a.adapter.as_ref()).map(|a| a.id);
        if out
            .scheduled
            .iter()
            .any(|s| adapter_of(self.active.get(&s.id)).is_some())
        {
            out.scheduled
                .sort_by_key(|s| adapter_of(self.active.get(&s.id)));
        }
        let pure_decode = out
            .scheduled
            .iter()
            .all(|s| s.new_token_ids.len() == 1 && s.wants_logits)
            .then_some(out.scheduled.len());
        let now = Instant::now();
        let mut batch = ForwardBatch {
            block_size: self.block_size,
            ..ForwardBatch::default()
        };
        for s in &out.scheduled {
            if let Some(a) = self.active.get_mut(&s.id) {
                a.first_step.get_or_insert(now);
            }
            let tokens: Vec<u32> = s.new_token_ids.iter().map(|t| t.0).collect();
            let tables = s.block_tables.iter().map(backend_table).collect();
            let start = batch.token_ids.len();
            let last_rows = s.wants_logits && s.num_draft_tokens == 0;
            batch.push_seq_groups(&tokens, s.num_computed_tokens, tables, last_rows);
            if s.wants_logits && s.num_draft_tokens > 0 {
                // A speculative decode: the logits after its last known
                // token and after each draft.
                let end = start + tokens.len();
                batch
                    .logits_rows
                    .extend((end - 1 - s.num_draft_tokens..end).map(|r| r as u32));
            }
            if let Some(slot) = s.state_slot {
                batch.states.push(kiln_tensor::SeqState {
                    slot,
                    restore_from: s.state_restore,
                    snapshots: s.state_snapshots.clone(),
                });
            }
            if let Some(adapter) = self.active.get(&s.id).and_then(|a| a.adapter.as_ref()) {
                batch.lora.push(adapter, start..start + tokens.len());
            }
        }
        // Rows the device can sample (the (masked) argmax, or any
        // parameters its sampler takes) are sampled there: only ids cross to
        // the host; the others' logits are copied.
        // A row of logits for each request that samples, and one more for
        // each draft of a speculative decode (verified by the argmax
        // kernels or on the host, row after row).
        let mut kinds: Vec<RowKind> = Vec::new();
        let mut row_ids: Vec<RequestId> = Vec::new();
        for s in out.scheduled.iter().filter(|s| s.wants_logits) {
            let kind = match self.active.get(&s.id) {
                Some(a) if a.proc.wants_plain_argmax() => RowKind::Argmax,
                _ if s.num_draft_tokens > 0 => RowKind::Host,
                Some(a) if a.proc.wants_masked_argmax() => RowKind::Masked,
                Some(a) if self.device_sampler && a.proc.wants_device_sample() => RowKind::Sampled,
                _ => RowKind::Host,
            };
            for _ in 0..=s.num_draft_tokens {
                kinds.push(kind);
                row_ids.push(s.id);
            }
        }
        // The masks of constrained requests are computed on other threads
        // while the forward pass runs.
        let mask_ids: Vec<RequestId> = out
            .scheduled
            .iter()
            .filter(|s| s.wants_logits)
            .map(|s| s.id)
            .filter(|id| self.active.get(id).is_some_and(|a| a.proc.needs_mask()))
            .collect();
        // The MTP head reads the step's hidden states while the batch is
        // small enough to speculate and some request in it is not resting.
        let with_hidden = self.mtp.is_some()
            && out.scheduled.len() <= self.speculative.max_batch
            && out
                .scheduled
                .iter()
                .any(|s| self.active.get(&s.id).is_some_and(|a| !a.spec.resting()));
        let model = self.model;
        let cache = &mut self.cache;
        let active = &mut self.active;
        let mut hidden = None;
        let (logits, mask_timing) = std::thread::scope(|scope| {
            let masks = (!mask_ids.is_empty()).then(|| {
                scope.spawn(|| {
                    let started = Instant::now();
                    let mut procs: Vec<&mut Active<'m>> = active
                        .iter_mut()
                        .filter(|(id, _)| mask_ids.contains(id))
                        .map(|(_, a)| a)
                        .collect();
                    // An error here comes back from `on_logits`.
                    procs.par_iter_mut().for_each(|a| {
                        let _ = a.proc.prepare_mask();
                    });
                    started.elapsed().as_secs_f64()
                })
            });
            let t = match with_hidden {
                true => model
                    .model
                    .forward_with_hidden(&batch, cache)
                    .map(|(l, h)| {
                        hidden = Some(h);
                        l
                    }),
                false => model.model.forward(&batch, cache),
            };
            let forward_done = Instant::now();
            let mask_seconds = masks.map(|h| h.join().unwrap_or(0.0));
            (
                t,
                mask_seconds.map(|s| (s, forward_done.elapsed().as_secs_f64())),
            )
        });
        // The masks are ready: the device argmax and sampler can use them.
        let mut masks: Vec<Option<Vec<u32>>> = vec![None; kinds.len()];
        let mut steps: Vec<Option<DeviceStep>> = vec![None; kinds.len()];
        for (row, id) in row_ids.iter().enumerate() {
            let Some(a) = self.active.get_mut(id) else {
                continue;
            };
            match kinds[row] {
                RowKind::Masked => masks[row] = a.proc.mask_words(),
                // A row whose data is not ready (or fails: the host path
                // reports it) samples on the host.
                RowKind::Sampled => match a.proc.device_row() {
                    Ok(Some((step, mask))) => {
                        steps[row] = Some(step);
                        masks[row] = mask;
                    }
                    _ => kinds[row] = RowKind::Host,
                },
                _ => {}
            }
        }
        let device_sampler = &mut self.device_sampler;
        let logits = logits.and_then(|t| {
            let logits = read_logits(model, &t, &kinds, &masks, &steps)?;
            if kinds.contains(&RowKind::Sampled) && !logits.1 {
                *device_sampler = false;
            }
            Ok(logits.0)
        });
        if let Some((seconds, wait)) = mask_timing {
            self.masks.steps += 1;
            self.masks.count += mask_ids.len() as u64;
            self.masks.seconds += seconds;
            self.masks.wait_seconds += wait;
        }
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                self.fail_all(&format!("forward pass: {e}"));
                return None;
            }
        };
        let step_seconds = now.elapsed().as_secs_f64();
        self.note_expert_load();
        self.num_steps += 1;
        self.step_seconds_total += step_seconds;
        self.last_step_seconds = step_seconds;
        let vocab = self.model.model.config().vocab_size;
        // Sample every request's rows (requests on the host in parallel):
        // a speculative decode's rows in order while its drafts are what
        // is sampled.
        let mut row_of: HashMap<RequestId, (usize, &[TokenId])> = HashMap::new();
        let mut next_row = 0;
        for s in out.scheduled.iter().filter(|s| s.wants_logits) {
            let drafts = &s.new_token_ids[s.new_token_ids.len() - s.num_draft_tokens..];
            row_of.insert(s.id, (next_row, drafts));
            next_row += 1 + s.num_draft_tokens;
        }
        let mut rows: Vec<(RequestId, usize, &[TokenId], &mut Active<'m>)> = self
            .active
            .iter_mut()
            .filter_map(|(id, a)| row_of.get(id).map(|&(row, d)| (*id, row, d, a)))
            .collect();
        let sampled: Vec<(RequestId, Vec<Result<TokenOutcome>>)> = rows
            .par_iter_mut()
            .map(|(id, first, drafts, a)| {
                let take = |a: &mut Active<'m>, pick: &Option<SampledRow>, row: usize| match (
                    kinds[row], pick,
                ) {
                    (_, None) => Err(SamplingError::NoCandidates.into()),
                    (RowKind::Masked, Some(p)) => a.proc.on_masked_argmax(p.token, p.logprob),
                    (RowKind::Sampled, Some(p)) => a.proc.on_device_sample(p.clone()),
                    (_, Some(p)) => a.proc.on_argmax(p.token, p.logprob),
                };
                let row_outcome = |a: &mut Active<'m>, row: usize| match &logits {
                    Logits::Picked(p) => take(a, &p[row], row),
                    Logits::Full(l) => a
                        .proc
                        .on_logits(&mut l[row * vocab..(row + 1) * vocab].to_vec()),
                    Logits::Mixed {
                        picked,
                        host,
                        index,
                    } => match index[row] {
                        Some(k) => a
                            .proc
                            .on_logits(&mut host[k * vocab..(k + 1) * vocab].to_vec()),
                        None => take(a, &picked[row], row),
                    },
                };
                let mut list = Vec::with_capacity(1);
                for j in 0..=drafts.len() {
                    let outcome = row_outcome(a, *first + j);
                    let more = matches!(&outcome, Ok(o) if o.finish.is_none()
                        && o.forced.is_empty()
                        && j < drafts.len()
                        && o.sampled.token == drafts[j]);
                    list.push(outcome);
                    if !more {
                        break;
                    }
                }
                (*id, list)
            })
            .collect();
        let mut outcomes: HashMap<RequestId, Vec<Result<TokenOutcome>>> =
            sampled.into_iter().collect();
        let mut results = Vec::new();
        let mut finished = Vec::new();
        // Rows whose hidden states stand, a request (the MTP head's).
        let mut valid: HashMap<RequestId, usize> = HashMap::new();
        for s in out.scheduled.iter().filter(|s| s.wants_logits) {
            let (Some(a), Some(list)) = (self.active.get_mut(&s.id), outcomes.remove(&s.id)) else {
                continue;
            };
            let mut tokens = Vec::new();
            let (mut sent, mut finish, mut failed) = (true, None, None);
            for outcome in list {
                let o = match outcome {
                    Ok(o) => o,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                };
                a.first_token.get_or_insert_with(Instant::now);
                tokens.push(o.sampled.token);
                tokens.extend(o.forced.iter().map(|(t, _)| *t));
                let event = Event::Token {
                    token_id: o.sampled.token.0,
                    text: o.text,
                    logprobs: a.want_logprobs.then_some(o.sampled),
                };
                // Tokens the format forced follow as events of their own.
                let forced = o.forced.into_iter().map(|(t, text)| Event::Token {
                    token_id: t.0,
                    text,
                    logprobs: None,
                });
                sent = sent
                    && std::iter::once(event)
                        .chain(forced)
                        .all(|e| a.events.send(e).is_ok());
                finish = o.finish;
            }
            if s.num_draft_tokens > 0 {
                let drafts = &s.new_token_ids[s.new_token_ids.len() - s.num_draft_tokens..];
                let accepted = tokens
                    .iter()
                    .zip(drafts)
                    .take_while(|(t, d)| t == d)
                    .count()
                    .min(tokens.len().saturating_sub(1));
                a.spec.verified(s.num_draft_tokens, accepted);
                valid.insert(s.id, s.new_token_ids.len() - s.num_draft_tokens + accepted);
            }
            if let Some(e) = failed {
                let _ = a.events.send(Event::Failed {
                    message: e.to_string(),
                    retryable: false,
                });
                finished.push((s.id, FinishReason::Cancelled));
                results.push((s.id, vec![TokenId(0)]));
                continue;
            }
            results.push((s.id, tokens));
            if !sent {
                // The client dropped its stream: cancel.
                finished.push((s.id, FinishReason::Cancelled));
            } else if let Some(f) = finish {
                finished.push((s.id, f));
            }
        }
        // Requests whose client went away while their prompt is still being
        // computed are noticed here.
        for s in out.scheduled.iter().filter(|s| !s.wants_logits) {
            if let Some(a) = self.active.get(&s.id) {
                if a.events.send(Event::Progress).is_err() {
                    finished.push((s.id, FinishReason::Cancelled));
                }
            }
        }
        let update = match self.scheduler.update(&results) {
            Ok(u) => u,
            Err(e) => {
                self.fail_all(&format!("scheduler update: {e}"));
                return None;
            }
        };
        if let Some(h) = hidden {
            self.run_mtp(&h, &out.scheduled, &batch.seqs, &valid, &finished);
        }
        for (id, reason) in finished {
            if reason == FinishReason::Cancelled {
                let _ = self.scheduler.cancel(id);
                self.active.remove(&id);
            } else if let Ok(f) = self.scheduler.finish(id) {
                self.send_finished(id, reason, f.num_cached_tokens);
            }
        }
        for f in update.finished_by_length {
            self.send_finished(f.id, FinishReason::Length, f.num_cached_tokens);
        }
        pure_decode
    }

    fn send_finished(&mut self, id: RequestId, reason: FinishReason, cached: usize) {
        let Some(mut a) = self.active.remove(&id) else {
            return;
        };
        // Text held back is flushed by the processor on every finish it
        // decides; a length limit found by the scheduler is flushed here.
        if reason == FinishReason::Length && !a.proc.generated().is_empty() {
            if let Ok(text) = a.proc.flush() {
                if !text.is_empty() {
                    let _ = a.events.send(Event::Token {
                        token_id: u32::MAX,
                        text,
                        logprobs: None,
                    });
                }
            }
        }
        let first_step = a.first_step.unwrap_or(a.submitted);
        let first_token = a.first_token.unwrap_or(first_step);
        let _ = a.events.send(Event::Finished {
            finish_reason: reason,
            usage: Usage {
                prompt_tokens: a.proc.prompt_len(),
                cached_tokens: cached,
                completion_tokens: a.proc.generated().len(),
                draft_tokens: a.spec.proposed,
                accepted_draft_tokens: a.spec.accepted,
            },
            timings: RequestTimings {
                queue_seconds: (first_step - a.submitted).as_secs_f64(),
                prefill_seconds: (first_token - first_step).as_secs_f64(),
                decode_seconds: first_token.elapsed().as_secs_f64(),
            },
        });
    }

    pub(in crate::engine) fn fail_all(&mut self, message: &str) {
        for (id, a) in self.active.drain() {
            let _ = a.events.send(Event::Failed {
                message: message.to_string(),
                retryable: true,
            });
            let _ = self.scheduler.cancel(id);
        }
    }
}

/// How a row of logits is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowKind {
    /// The plain argmax, on the device when the backend can.
    Argmax,
    /// The argmax under the request's output-format mask.
    Masked,
    /// Sampled on the device from the request's [`DeviceStep`] (under its
    /// mask when the output format applies), when the backend can.
    Sampled,
    /// On the host, from the row's logits.
    Host,
}

/// The logits of a step as the rows need them: only the device's picks
/// for rows sampled there (`masks[row]` restricting `Masked` and `Sampled`
/// rows, `steps[row]` the parameters of `Sampled` ones) when the backend
/// samples, the host copy of the other rows. With a `Sampled` row, one
/// `sample_rows` call takes every device row (the argmax rows greedy);
/// without one, or when the backend has no sampler, the argmax kernels.
/// The flag says whether the backend's sampler ran.
fn read_logits(
    model: &LoadedModel,
    t: &kiln_tensor::Tensor,
    kinds: &[RowKind],
    masks: &[Option<Vec<u32>>],
    steps: &[Option<DeviceStep>],
) -> kiln_models::Result<(Logits, bool)> {
    let backend = model.model.backend().as_ref();
    let sampled = if kinds.contains(&RowKind::Sampled) {
        let rows: Vec<SampleRow<'_>> = (0..kinds.len())
            .map(|row| match (kinds[row], &steps[row]) {
                (RowKind::Sampled, Some(step)) => sample_row(step, masks[row].as_deref()),
                (RowKind::Masked, _) => SampleRow {
                    mask: masks[row].as_deref(),
                    ..SampleRow::GREEDY
                },
                // Host rows' picks are not used.
                _ => SampleRow::GREEDY,
            })
            .collect();
        backend
            .sample_rows(t, &rows)?
            .filter(|p| p.len() == kinds.len())
    } else {
        None
    };
    let device_sampled = sampled.is_some();
    let any_masked = kinds
        .iter()
        .zip(masks)
        .any(|(k, m)| *k == RowKind::Masked && m.is_some());
    // Rows the device could not take go to the host: masked rows without a
    // mask, every masked row when the backend has no masked argmax, and the
    // sampled rows when it has no sampler.
    let on_device = |row: usize| match kinds[row] {
        RowKind::Argmax => true,
        RowKind::Masked => (device_sampled || any_masked) && masks[row].is_some(),
        RowKind::Sampled => device_sampled && steps[row].is_some(),
        RowKind::Host => false,
    };
    let picked = match sampled {
        Some(p) => Some(p),
        None => argmax_picks(backend, t, kinds, masks, any_masked)?,
    };
    let Some(picked) = picked else {
        return Ok((Logits::Full(backend.to_host(t)?), device_sampled));
    };
    if (0..kinds.len()).all(on_device) {
        return Ok((Logits::Picked(picked), device_sampled));
    }
    let rows: Vec<u32> = (0..kinds.len() as u32)
        .filter(|&r| !on_device(r as usize))
        .collect();
    let mut index = vec![None; kinds.len()];
    for (k, &r) in rows.iter().enumerate() {
        index[r as usize] = Some(k);
    }
    let host = backend.to_host(&backend.gather_rows(t, &rows)?)?;
    let logits = Logits::Mixed {
        picked,
        host,
        index,
    };
    Ok((logits, device_sampled))
}

/// The device argmax of every row (masked rows under their masks), when
/// the backend has it and some row takes it.
fn argmax_picks(
    backend: &dyn kiln_tensor::Backend,
    t: &kiln_tensor::Tensor,
    kinds: &[RowKind],
    masks: &[Option<Vec<u32>>],
    any_masked: bool,
) -> kiln_models::Result<Option<Vec<Option<SampledRow>>>> {
    let argmax = if any_masked {
        let refs: Vec<Option<&[u32]>> = masks
            .iter()
            .zip(kinds)
            .map(|(m, k)| m.as_deref().filter(|_| *k == RowKind::Masked))
            .collect();
        backend.argmax_rows_masked(t, &refs)?
    } else if kinds.contains(&RowKind::Argmax) {
        backend.argmax_rows(t)?
    } else {
        None
    };
    Ok(argmax.filter(|p| p.len() == kinds.len()).map(|p| {
        p.into_iter()
            .map(|(token, logprob)| {
                Some(SampledRow {
                    token,
                    logprob,
                    top: Vec::new(),
                })
            })
            .collect()
    }))
}
