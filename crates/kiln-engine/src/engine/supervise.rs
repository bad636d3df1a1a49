//! Supervision of the engine loop. The loop runs under `catch_unwind`: when
//! it panics, every request it held (running or queued) gets
//! [`Event::Failed`](crate::Event::Failed), its scheduler and KV pool are
//! dropped, and a fresh loop starts on the same thread, taking the
//! commands that waited meanwhile. [`EngineStatus`] says where it stands,
//! so the server can answer 503 while it restarts.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use kiln_scheduler::Scheduler;

use super::{fresh_state, Command, EngineConfig, Loop, SpeculativeConfig};
use crate::load::LoadedModel;

/// Where the engine loop stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineStatus {
    /// Serving requests.
    Running,
    /// The loop failed; a fresh one is being started. Requests are refused
    /// until it runs.
    Restarting,
    /// The loop has ended (shut down, or it could not be restarted).
    Stopped,
}

/// The status shared between the loop's thread and every handle.
#[derive(Debug, Default)]
pub(super) struct StatusCell {
    status: AtomicU8,
    pub(super) num_restarts: AtomicU64,
}

impl StatusCell {
    pub(super) const RUNNING: u8 = 0;
    pub(super) const RESTARTING: u8 = 1;
    pub(super) const STOPPED: u8 = 2;

    pub(super) fn get(&self) -> EngineStatus {
        match self.status.load(Ordering::Acquire) {
            Self::RUNNING => EngineStatus::Running,
            Self::RESTARTING => EngineStatus::Restarting,
            _ => EngineStatus::Stopped,
        }
    }

    pub(super) fn num_restarts(&self) -> u64 {
        self.num_restarts.load(Ordering::Relaxed)
    }

    pub(super) fn set(&self, status: u8) {
        self.status.store(status, Ordering::Release);
    }
}

/// The gate the `fault-injection` test hook returns: the failed loop is
/// restarted once it is released (or dropped).
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub struct FaultGate(pub(super) std::sync::mpsc::SyncSender<()>);

#[cfg(feature = "fault-injection")]
impl FaultGate {
    /// Let the engine restart.
    pub fn release(self) {
        let _ = self.0.try_send(());
    }
}

/// Pause after a failure before the fresh loop starts, so a fault that
/// repeats at once does not spin.
const RESTART_PAUSE: Duration = Duration::from_millis(50);

/// Runs loops over `first` and then fresh states until the commands end
/// (every handle dropped, or [`Command::Shutdown`]).
pub(super) fn run(
    model: &LoadedModel,
    (config, speculative, draft): (EngineConfig, SpeculativeConfig, Option<&LoadedModel>),
    first: (Scheduler, kiln_tensor::KvCache),
    commands: &Receiver<Command>,
    status: &StatusCell,
) {
    let mut state = Some(first);
    let mut next_id = 1;
    loop {
        let parts = match state.take() {
            Some(parts) => parts,
            None => match fresh_state(model, config, super::spare_state_slots(speculative)) {
                Ok(parts) => parts,
                // The commands still waiting are dropped with the receiver,
                // so their callers see `EngineStopped`.
                Err(_) => {
                    status.set(StatusCell::STOPPED);
                    return;
                }
            },
        };
        let mut lp = Loop::new(model, parts, config.block_size, next_id);
        lp.speculative = speculative;
        if let Some(d) = draft {
            let per_seq = super::served_context(model, &config).div_ceil(config.block_size);
            let blocks = config
                .num_blocks
                .min(speculative.max_batch.max(1) * per_seq);
            match super::DraftModel::new(
                d,
                blocks,
                config.block_size,
                config.max_num_batched_tokens,
            ) {
                Ok(dm) => lp.draft = Some(dm),
                // Without its cache the engine runs without guesses.
                Err(_) => lp.speculative.method = super::SpeculativeMethod::Off,
            }
        }
        if speculative.method == super::SpeculativeMethod::Mtp {
            // The head's pool: as many blocks as the target's, at most what
            // `max_batch` requests of the served context need (one layer's
            // keys a block).
            let per_seq = super::served_context(model, &config).div_ceil(config.block_size);
            let blocks = config
                .num_blocks
                .min(speculative.max_batch.max(1) * per_seq);
            match crate::mtp::MtpProposer::new(model, blocks, config.block_size) {
                Ok(m) => lp.mtp = Some(m),
                Err(e) => {
                    tracing::warn!(target: "kiln::engine", "the MTP head's cache of {blocks} blocks could not be made ({e}); decoding without speculation");
                    lp.speculative.method = super::SpeculativeMethod::Off;
                }
            }
        }
        status.set(StatusCell::RUNNING);
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| lp.run(commands)));
        let Err(payload) = outcome else {
            status.set(StatusCell::STOPPED);
            return;
        };
        status.set(StatusCell::RESTARTING);
        status.num_restarts.fetch_add(1, Ordering::Relaxed);
        let message = format!(
            "the engine failed ({}) and is restarting; retry the request",
            panic_message(payload.as_ref())
        );
        next_id = lp.next_id;
        #[cfg(feature = "fault-injection")]
        let hold = lp.restart_hold.take();
        // The failed loop's state may be inconsistent: only its requests'
        // channels are used, and a second panic here is contained too.
        let failed = panic::catch_unwind(AssertUnwindSafe(move || {
            lp.fail_all(&message);
            drop(lp);
        }));
        if failed.is_err() {
            status.set(StatusCell::STOPPED);
            return;
        }
        #[cfg(feature = "fault-injection")]
        if let Some(hold) = hold {
            let _ = hold.recv();
        }
        std::thread::sleep(RESTART_PAUSE);
    }
}

/// The text of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "a panic"
    }
}
