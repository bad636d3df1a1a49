//! The engine loop: one thread owns the scheduler, the KV cache and the
//! model, and runs steps (schedule → one forward over every scheduled
//! request → sample → update) while requests are in flight. Everything else
//! talks to it through an [`EngineHandle`]: `submit` returns a
//! [`RequestStream`] of [`Event`]s; dropping the stream cancels the request
//! and frees its blocks at the next step.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kiln_sampling::{DeviceStep, FinishReason, SamplingError, TokenId};
use kiln_scheduler::{
    AdapterId, Priority, Request, RequestId, RequestStatus, Scheduler, SchedulerConfig,
    SchedulerStats,
};
use kiln_tensor::{ForwardBatch, SampleRow, SampledRow};
use rayon::prelude::*;

use crate::embed::{self, EmbedInput, Embedder, EmbeddingHead};
use crate::error::{EngineError, Result};
use crate::events::{Event, RequestTimings, Usage};
use crate::generate::{entropy, GenerationRequest};
use crate::load::LoadedModel;
use crate::process::{sample_row, PreparedRequest, TokenOutcome, TokenProcessor};
use crate::speculative::{DraftModel, SpecState, SpeculativeConfig, SpeculativeMethod};

mod config;
pub mod remote;
mod run_loop;
mod supervise;

use run_loop::Loop;

pub use config::{EngineConfig, KvPlan};
pub use supervise::EngineStatus;
#[cfg(feature = "fault-injection")]
pub use supervise::FaultGate;

enum Command {
    Submit {
        request: GenerationRequest,
        /// The request's decoding state (its output format compiled, its
        /// stop matcher and sampler built), made on the caller's thread.
        prepared: PreparedRequest,
        events: Sender<Event>,
        /// Set when the caller drops its stream.
        abandoned: Arc<AtomicBool>,
        reply: SyncSender<Result<u64>>,
    },
    Stats {
        reply: SyncSender<EngineStats>,
    },
    /// Embed `inputs` in a pass of their own (see [`Loop::run_embeds`]).
    Embed(EmbedJob),
    Shutdown,
    /// The test hook: the loop panics on receipt and is restarted once
    /// `hold` is released or dropped.
    #[cfg(feature = "fault-injection")]
    InjectPanic {
        hold: Receiver<()>,
    },
}

/// Inputs to embed and where their embeddings go.
struct EmbedJob {
    head: Arc<EmbeddingHead>,
    inputs: Vec<EmbedInput>,
    reply: SyncSender<Result<Vec<Vec<f32>>>>,
}

/// What the engine loop counts: the scheduler's counters plus step times.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    pub scheduler: SchedulerStats,
    /// Forward steps run and their total and last wall time (forward pass
    /// and reading back its result).
    pub num_steps: u64,
    pub step_seconds_total: f64,
    pub last_step_seconds: f64,
    /// Steps where every request decoded one token: how many, their whole
    /// wall time (scheduling, forward, sampling, events) and tokens.
    pub decode_steps: u64,
    pub decode_step_seconds_total: f64,
    pub decode_step_tokens: u64,
    /// Output-format masks: steps that computed any, how many, the wall
    /// time spent computing them (alongside the forward pass), and the part
    /// of it the step waited for after the forward pass was done.
    pub mask_steps: u64,
    pub masks: u64,
    pub mask_seconds_total: f64,
    pub mask_wait_seconds_total: f64,
    /// Embedding passes run, the inputs they embedded and their wall time.
    pub embed_passes: u64,
    pub embed_inputs: u64,
    pub embed_seconds_total: f64,
    /// Tokens routed to each expert of each sparse layer over the last
    /// `expert_steps` forward steps (at most [`EXPERT_WINDOW_STEPS`]):
    /// the load balance `/stats` shows. Empty for a dense model.
    pub expert_tokens: Vec<Vec<u64>>,
    pub expert_steps: u64,
    /// Where the engine runs (the backend's name), what its weight
    /// matrices take by storage (empty: not counted), and the device's
    /// memory (none on the CPU) — read in the engine's process.
    pub device: String,
    pub weight_bytes: std::collections::BTreeMap<String, u64>,
    pub device_memory: Option<kiln_tensor::DeviceMemory>,
}

/// The forward steps the expert load balance covers.
pub const EXPERT_WINDOW_STEPS: usize = 32;

impl std::ops::Deref for EngineStats {
    type Target = SchedulerStats;
    fn deref(&self) -> &SchedulerStats {
        &self.scheduler
    }
}

/// The caller's side of the engine. Cloning is cheap; the engine stops when
/// every handle is dropped.
#[derive(Clone)]
pub struct EngineHandle {
    commands: Sender<Command>,
    model: Arc<LoadedModel>,
    /// The model's embedding head, read on first use.
    embedding_head: Arc<OnceLock<std::result::Result<Arc<EmbeddingHead>, String>>>,
    /// The LoRA adapters requests may name.
    adapters: Arc<crate::Adapters>,
    /// The served context length.
    context: usize,
    status: Arc<supervise::StatusCell>,
}

/// The events of one request. Dropping it cancels the request: one still
/// queued is removed before it is ever scheduled.
pub struct RequestStream {
    pub id: u64,
    events: Receiver<Event>,
    /// Set when the stream is dropped; the loop checks it every step.
    abandoned: Arc<AtomicBool>,
}

impl RequestStream {
    /// The next event, waiting for it; `None` after the last.
    pub fn next_event(&self) -> Option<Event> {
        self.events.recv().ok()
    }

    /// The next event, waiting at most `timeout`: `Err(())` when none came
    /// in time, `Ok(None)` after the last.
    #[allow(clippy::result_unit_err)]
    pub fn next_event_timeout(&self, timeout: Duration) -> Result<Option<Event>, ()> {
        match self.events.recv_timeout(timeout) {
            Ok(e) => Ok(Some(e)),
            Err(RecvTimeoutError::Timeout) => Err(()),
            Err(RecvTimeoutError::Disconnected) => Ok(None),
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.abandoned.store(true, Ordering::Release);
    }
}

impl Iterator for RequestStream {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.next_event()
    }
}

impl EngineHandle {
    /// The model the engine serves, for tokenizing and rendering templates.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    /// The longest sequence this engine serves (prompt and output): its
    /// configured context, at most the model's trained length.
    pub fn context_length(&self) -> usize {
        self.context
    }

    /// Submit a request. Refusals happen here, at once: a request that can
    /// never fit (with its numbers) or a full queue ([`EngineError::Busy`]).
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestStream> {
        match self.status() {
            EngineStatus::Running => {}
            EngineStatus::Restarting => return Err(EngineError::Restarting),
            EngineStatus::Stopped => return Err(EngineError::EngineStopped),
        }
        // Per-request work happens here, on the caller's thread, never on
        // the engine loop: a schema can take milliseconds to compile, and
        // stop strings and logit biases are copied into their matchers.
        if request.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let constraint = request
            .format
            .as_ref()
            .map(|f| self.model().constraint(f))
            .transpose()?;
        let max_tokens = request
            .params
            .max_tokens
            .unwrap_or(self.context.saturating_sub(request.prompt.len()).max(1));
        let prepared = PreparedRequest::new(
            self.model().model.config().vocab_size,
            &request.prompt,
            &request.params,
            request.skip_special_tokens,
            max_tokens,
            entropy(),
            constraint,
            request.reasoning.as_ref(),
        )?;
        let (events, rx) = mpsc::channel();
        let (reply, reply_rx) = mpsc::sync_channel(1);
        let abandoned = Arc::new(AtomicBool::new(false));
        self.commands
            .send(Command::Submit {
                request,
                prepared,
                events,
                abandoned: abandoned.clone(),
                reply,
            })
            .map_err(|_| EngineError::EngineStopped)?;
        let id = reply_rx.recv().map_err(|_| EngineError::EngineStopped)??;
        Ok(RequestStream {
            id,
            events: rx,
            abandoned,
        })
    }

    /// Whether the loop is serving, restarting after a failure, or gone.
    pub fn status(&self) -> EngineStatus {
        self.status.get()
    }

    /// How many times the loop failed and was restarted.
    pub fn num_restarts(&self) -> u64 {
        self.status.num_restarts()
    }

    /// The test hook behind the `fault-injection` feature: the loop panics
    /// between steps, failing every request it holds, and restarts once
    /// the returned gate is released. No request can reach it.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_panic(&self) -> Result<FaultGate> {
        let (gate, hold) = mpsc::sync_channel(1);
        self.commands
            .send(Command::InjectPanic { hold })
            .map_err(|_| EngineError::EngineStopped)?;
        Ok(FaultGate(gate))
    }

    /// The LoRA adapters requests may name ([`crate::Adapters`]).
    pub fn adapters(&self) -> &Arc<crate::Adapters> {
        &self.adapters
    }

    /// The model's embedding head (its sentence-transformers files, or the
    /// default for its kind), read once.
    pub fn embedding_head(&self) -> Result<Arc<EmbeddingHead>> {
        self.embedding_head
            .get_or_init(|| {
                EmbeddingHead::of(&self.model)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(EngineError::Config)
    }

    /// Tokenizes `text` (with the task prompt `prompt_name`) for
    /// [`EngineHandle::embed`], as [`Embedder::tokenize`] does.
    pub fn embed_input(
        &self,
        text: &str,
        prompt_name: Option<&str>,
        truncate: bool,
    ) -> Result<EmbedInput> {
        let head = self.embedding_head()?;
        Embedder::with_head(&self.model, (*head).clone()).tokenize(text, prompt_name, truncate)
    }

    /// Token ids for [`EngineHandle::embed`], checked as
    /// [`Embedder::input_ids`] does.
    pub fn embed_ids(&self, ids: &[u32], truncate: bool) -> Result<EmbedInput> {
        let head = self.embedding_head()?;
        Embedder::with_head(&self.model, (*head).clone()).input_ids(ids, truncate)
    }

    /// The embeddings of `inputs`, computed on the engine loop between
    /// steps, in a pass of their own whose keys and values use blocks the
    /// pool lends for that pass only (nothing is cached). Waits while the
    /// pool has too few free blocks; refuses at once inputs that could never
    /// fit it.
    pub fn embed(&self, inputs: Vec<EmbedInput>) -> Result<Vec<Vec<f32>>> {
        match self.status() {
            EngineStatus::Running => {}
            EngineStatus::Restarting => return Err(EngineError::Restarting),
            EngineStatus::Stopped => return Err(EngineError::EngineStopped),
        }
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let head = self.embedding_head()?;
        let (reply, rx) = mpsc::sync_channel(1);
        self.commands
            .send(Command::Embed(EmbedJob {
                head,
                inputs,
                reply,
            }))
            .map_err(|_| EngineError::EngineStopped)?;
        rx.recv().map_err(|_| EngineError::EngineStopped)?
    }

    /// Queue, pool, prefix-cache and step counters.
    pub fn stats(&self) -> Result<EngineStats> {
        let (reply, rx) = mpsc::sync_channel(1);
        self.commands
            .send(Command::Stats { reply })
            .map_err(|_| EngineError::EngineStopped)?;
        rx.recv().map_err(|_| EngineError::EngineStopped)
    }
}

/// The engine thread; dropping it stops the loop after the current step.
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Start the engine loop on its own thread, owning `model`. The loop is
    /// supervised: if it panics, the requests it held fail and it starts
    /// again with a fresh scheduler and KV pool (see [`EngineStatus`]).
    pub fn start(model: LoadedModel, config: EngineConfig) -> Result<Engine> {
        Engine::start_with(model, config, SpeculativeConfig::default())
    }

    /// [`Engine::start`] with speculative decoding as `speculative` says
    /// (requests with a prediction verify it under any setting). A model
    /// with recurrent layers keeps spare state slots for it
    /// ([`kiln_scheduler::SchedulerConfig::state_spare_slots`]).
    pub fn start_with(
        model: LoadedModel,
        config: EngineConfig,
        speculative: SpeculativeConfig,
    ) -> Result<Engine> {
        Engine::start_with_draft(model, config, speculative, None)
    }

    /// [`Engine::start_with`] with a draft model for
    /// [`SpeculativeMethod::Draft`]: it must share the target's tokenizer
    /// and attend fully in every layer ([`crate::speculative::check_draft`]);
    /// its KV pool holds as many tokens as the target's, at most what
    /// `max_batch` requests of the served context need.
    pub fn start_with_draft(
        model: LoadedModel,
        config: EngineConfig,
        speculative: SpeculativeConfig,
        draft: Option<LoadedModel>,
    ) -> Result<Engine> {
        match (&draft, speculative.method) {
            (None, SpeculativeMethod::Draft) => {
                return Err(EngineError::Config(
                    "--speculative draft needs a draft model (--draft-model PATH)".to_string(),
                ))
            }
            (Some(d), SpeculativeMethod::Draft) => crate::speculative::check_draft(&model, d)?,
            (None, SpeculativeMethod::Mtp) if model.model.mtp_heads() == 0 => {
                return Err(EngineError::Config(format!(
                    "--speculative mtp needs a model with a multi-token-prediction head; \
                     {} has none (Qwen3.5 and Qwen3-Next checkpoints ship one as `mtp.*`; \
                     conversions often drop it): use ngram or draft",
                    model.model.config().model_type
                )))
            }
            (Some(_), _) => {
                return Err(EngineError::Config(
                    "a draft model is used only with --speculative draft".to_string(),
                ))
            }
            _ => {}
        }
        let model = Arc::new(model);
        let draft = draft.map(Arc::new);
        let context = served_context(&model, &config);
        // The first pool is made here, so a configuration that cannot work
        // is refused at once.
        let first = fresh_state(&model, config, spare_state_slots(speculative))?;
        let (tx, rx) = mpsc::channel();
        let status = Arc::new(supervise::StatusCell::default());
        let shared = model.clone();
        let loop_status = status.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || {
                let draft = draft.as_deref();
                supervise::run(
                    &model,
                    (config, speculative, draft),
                    first,
                    &rx,
                    &loop_status,
                )
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            handle: EngineHandle {
                commands: tx,
                model: shared.clone(),
                embedding_head: Arc::new(OnceLock::new()),
                adapters: Arc::new(crate::Adapters::new(
                    shared,
                    crate::adapters::DEFAULT_MAX_LOADED,
                )),
                context,
                status,
            },
            thread: Some(thread),
        })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }
}

/// The served context: the configured one, at most the model's trained
/// length.
pub(super) fn served_context(model: &LoadedModel, config: &EngineConfig) -> usize {
    config
        .context_length
        .unwrap_or(model.context_length())
        .min(model.context_length())
        .max(1)
}

/// Spare recurrent-state slots a hybrid model's engine keeps for
/// speculative decodes: one for each request that may speculate at once
/// (with speculation off too: a request's Predicted Outputs speculate).
pub(super) fn spare_state_slots(speculative: SpeculativeConfig) -> usize {
    speculative.max_batch.max(1)
}

/// A scheduler and an empty KV pool for `config` (a hybrid model's state
/// with `spare_slots` spare slots for speculative decodes).
fn fresh_state(
    model: &LoadedModel,
    config: EngineConfig,
    spare_slots: usize,
) -> Result<(Scheduler, kiln_tensor::KvCache)> {
    let cfg = model.model.config();
    // A hybrid's recurrent state comes out of the pool's bytes: a slot a
    // running request and twice as many snapshot slots (each running
    // request's tail and the prefix cache's checkpoints), together at most
    // half the pool, so fewer requests run at once when the state is large,
    // and the spare slots of speculative decodes; the blocks it takes leave
    // the pool.
    let (mut num_blocks, mut max_num_seqs, mut state_slots, mut spares) =
        (config.num_blocks, config.max_num_seqs, 0, 0);
    let per_seq = model.model.state_bytes_per_seq();
    if per_seq > 0 {
        let elem = model.model.backend().kv_bytes_per_element();
        let per_block = cfg.kv_bytes_per_block(config.block_size, elem).max(1) as u64;
        let pool = num_blocks as u64 * per_block;
        // (Three slots and at most one spare a request: at most half.)
        max_num_seqs = max_num_seqs.min((pool / 8 / per_seq).max(1) as usize);
        state_slots = max_num_seqs;
        spares = spare_slots.min(max_num_seqs);
        let state_blocks =
            ((3 * state_slots + spares) as u64 * per_seq).div_ceil(per_block) as usize;
        num_blocks = num_blocks.saturating_sub(state_blocks).max(1);
    }
    let sched_cfg = SchedulerConfig {
        kv_cache: cfg.kv_layout(config.block_size).0,
        num_blocks,
        max_model_len: served_context(model, &config),
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_num_seqs,
        max_waiting: config.max_waiting,
        state_slots,
        state_snapshots: 2 * state_slots,
        state_checkpoint_tokens: kiln_scheduler::DEFAULT_STATE_CHECKPOINT_TOKENS
            .div_ceil(config.block_size)
            * config.block_size,
        state_spare_slots: spares,
    };
    let scheduler = Scheduler::new(sched_cfg).map_err(|e| EngineError::Config(e.to_string()))?;
    let cache = model
        .model
        .new_cache(num_blocks, config.block_size, 3 * state_slots + spares)?;
    Ok((scheduler, cache))
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.handle.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
