//! The server's side of an engine process: starts and supervises the
//! child, and turns the handle's commands into messages and the child's
//! messages into events and replies.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command as Process, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, FromWorker, ToWorker, WireRequest};
use super::WorkerCommand;
use crate::engine::supervise::StatusCell;
use crate::engine::{Command, EngineStats};
use crate::error::{EngineError, Result};
use crate::events::Event;

/// How often the proxy looks for requests whose callers went away.
const CANCEL_POLL: Duration = Duration::from_millis(10);
/// The pause before the first restart; it doubles with each failure in a
/// row, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A child that ran this long before failing restarts after the first pause.
const STABLE: Duration = Duration::from_secs(60);

/// What a loaded child said about itself.
pub(super) struct Ready {
    pub(super) generates: bool,
    pub(super) context: usize,
}

/// One running child: its process, the socket to it, and the thread that
/// reads it.
struct Worker {
    child: Child,
    socket: UnixStream,
    started: Instant,
    /// When it last sent anything.
    heard: Instant,
    /// When the last ping went out (unanswered so far).
    pinged: Option<Instant>,
    /// Killed by the watchdog: why, for the failure message.
    silenced: Option<String>,
}

/// What the proxy waits on: a command from a handle, a message from the
/// child (tagged with the child's generation, so a dead child's last words
/// are not taken for the new one's), or the child's end.
enum Input {
    Command(Command),
    Message(u64, FromWorker),
    Closed(u64, String),
    /// Every handle is gone.
    Hangup,
}

/// A request the child holds.
struct InFlight {
    events: Sender<Event>,
    abandoned: Arc<AtomicBool>,
    /// Until the child admits or refuses it.
    reply: Option<SyncSender<Result<u64>>>,
}

pub(super) struct Proxy {
    command: WorkerCommand,
    worker: Option<Worker>,
    generation: u64,
    inputs: (Sender<Input>, Receiver<Input>),
}

impl Proxy {
    /// Starts the child and waits for its model to load.
    pub(super) fn start(command: WorkerCommand) -> Result<(Proxy, Ready)> {
        let mut proxy = Proxy {
            command,
            worker: None,
            generation: 0,
            inputs: mpsc::channel(),
        };
        proxy.spawn()?;
        let ready = proxy.wait_ready()?;
        Ok((proxy, ready))
    }

    /// Starts a child whose standard input is our socket's other end.
    fn spawn(&mut self) -> Result<()> {
        let (ours, theirs) = UnixStream::pair()
            .map_err(|e| EngineError::Config(format!("cannot make the engine socket: {e}")))?;
        let child = Process::new(&self.command.program)
            .args(&self.command.args)
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                EngineError::Config(format!(
                    "cannot start the engine process {}: {e}",
                    self.command.program.display()
                ))
            })?;
        self.generation += 1;
        let generation = self.generation;
        let mut reader = ours
            .try_clone()
            .map_err(|e| EngineError::Config(format!("engine socket: {e}")))?;
        let tx = self.inputs.0.clone();
        std::thread::Builder::new()
            .name("kiln-engine-reader".into())
            .spawn(move || loop {
                match wire::read::<FromWorker>(&mut reader) {
                    Ok(Some(m)) => {
                        if tx.send(Input::Message(generation, m)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {
                        let _ = tx.send(Input::Closed(generation, "its connection closed".into()));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Input::Closed(
                            generation,
                            format!("its messages broke off: {e}"),
                        ));
                        return;
                    }
                }
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine reader: {e}")))?;
        self.worker = Some(Worker {
            child,
            socket: ours,
            started: Instant::now(),
            heard: Instant::now(),
            pinged: None,
            silenced: None,
        });
        Ok(())
    }

    /// Waits for the new child's `Ready` (commands wait in their channel).
    fn wait_ready(&mut self) -> Result<Ready> {
        loop {
            match self.inputs.1.recv() {
                Ok(Input::Message(g, FromWorker::Ready { generates, context }))
                    if g == self.generation =>
                {
                    return Ok(Ready { generates, context })
                }
                Ok(Input::Message(g, FromWorker::LoadFailed { message }))
                    if g == self.generation =>
                {
                    self.reap();
                    return Err(EngineError::Config(message));
                }
                Ok(Input::Closed(g, why)) if g == self.generation => {
                    let status = self.reap();
                    return Err(EngineError::Config(format!(
                        "the engine process ended before its model loaded ({why}; {status})"
                    )));
                }
                Ok(_) => {}
                Err(_) => return Err(EngineError::EngineStopped),
            }
        }
    }

    /// Ends the child (if it has not ended) and says how it ended.
    fn reap(&mut self) -> String {
        let Some(mut w) = self.worker.take() else {
            return "no process".into();
        };
        let _ = w.socket.shutdown(std::net::Shutdown::Both);
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            match w.child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = w.child.kill();
                    match w.child.wait() {
                        Ok(s) => break s,
                        Err(e) => return format!("its status is unknown: {e}"),
                    }
                }
            }
        };
        describe(status)
    }

    fn send(&mut self, message: &ToWorker) -> bool {
        match &mut self.worker {
            Some(w) => wire::write(&mut w.socket, message).is_ok(),
            None => false,
        }
    }

    /// Serves the handle's commands until every handle is dropped or the
    /// engine is shut down, restarting the child when it fails.
    pub(super) fn run(mut self, commands: Receiver<Command>, status: &StatusCell) {
        // The handle's commands join the child's messages in one queue.
        let tx = self.inputs.0.clone();
        std::thread::Builder::new()
            .name("kiln-engine-commands".into())
            .spawn(move || {
                for c in commands {
                    if tx.send(Input::Command(c)).is_err() {
                        return;
                    }
                }
                let _ = tx.send(Input::Hangup);
            })
            .expect("starting the command forwarder");
        let mut next_id: u64 = 1;
        let mut next_call: u64 = 1;
        let mut requests: HashMap<u64, InFlight> = HashMap::new();
        let mut stats: HashMap<u64, SyncSender<EngineStats>> = HashMap::new();
        let mut embeds: HashMap<u64, SyncSender<Result<Vec<Vec<f32>>>>> = HashMap::new();
        // While the child restarts: when the next one starts, and the pause.
        let mut restart_at: Option<Instant> = None;
        let mut backoff = FIRST_BACKOFF;
        let mut scanned = Instant::now();
        loop {
            // Callers that went away: their requests end in the child. Looked
            // for once a poll period, not at every message (a request whose
            // caller left is also cancelled when its next event finds no
            // receiver).
            if scanned.elapsed() >= CANCEL_POLL {
                scanned = Instant::now();
                let gone: Vec<u64> = requests
                    .iter()
                    .filter(|(_, r)| r.abandoned.load(Ordering::Acquire))
                    .map(|(&id, _)| id)
                    .collect();
                for id in gone {
                    requests.remove(&id);
                    self.send(&ToWorker::Cancel { id });
                }
            }
            if let Some(at) = restart_at {
                if Instant::now() >= at {
                    restart_at = None;
                    if self.spawn().is_err() {
                        restart_at = Some(Instant::now() + backoff);
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
            let busy = !(requests.is_empty() && stats.is_empty() && embeds.is_empty());
            if let (Some(limit), Some(w), true) = (self.command.watchdog, &mut self.worker, busy) {
                let quiet = w.heard.elapsed();
                if w.silenced.is_none() && quiet >= limit {
                    // Hung: a crash as far as its requests are concerned.
                    w.silenced = Some(format!(
                        "it answered nothing for {:.0} s",
                        quiet.as_secs_f64()
                    ));
                    let _ = w.child.kill();
                } else if quiet >= limit / 4 && w.pinged.is_none() {
                    w.pinged = Some(Instant::now());
                    let call = next_call;
                    next_call += 1;
                    // Answered between steps, so only a stuck engine stays silent.
                    let _ = wire::write(&mut w.socket, &ToWorker::Stats { call });
                }
            }
            let input = match self.inputs.1.recv_timeout(CANCEL_POLL) {
                Ok(i) => i,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            match input {
                Input::Command(Command::Submit {
                    request,
                    prepared: _,
                    events,
                    abandoned,
                    reply,
                }) => {
                    if status.get() != crate::EngineStatus::Running {
                        let _ = reply.send(Err(EngineError::Restarting));
                        continue;
                    }
                    let id = next_id;
                    next_id += 1;
                    let message = ToWorker::Submit {
                        id,
                        request: WireRequest::new(request),
                    };
                    if self.send(&message) {
                        requests.insert(
                            id,
                            InFlight {
                                events,
                                abandoned,
                                reply: Some(reply),
                            },
                        );
                    } else {
                        let _ = reply.send(Err(EngineError::Restarting));
                    }
                }
                Input::Command(Command::Stats { reply }) => {
                    let call = next_call;
                    next_call += 1;
                    if self.send(&ToWorker::Stats { call }) {
                        stats.insert(call, reply);
                    }
                }
                Input::Command(Command::Embed(job)) => {
                    let call = next_call;
                    next_call += 1;
                    if self.send(&ToWorker::Embed {
                        call,
                        inputs: job.inputs,
                    }) {
                        embeds.insert(call, job.reply);
                    } else {
                        let _ = job.reply.send(Err(EngineError::Restarting));
                    }
                }
                Input::Command(Command::Shutdown) | Input::Hangup => break,
                #[cfg(feature = "fault-injection")]
                Input::Command(Command::InjectPanic { .. }) => {}
                Input::Message(g, _) | Input::Closed(g, _) if g != self.generation => {}
                Input::Message(_, message) => {
                    if let Some(w) = &mut self.worker {
                        w.heard = Instant::now();
                        w.pinged = None;
                    }
                    match message {
                        FromWorker::Ready { .. } => {
                            status.set(StatusCell::RUNNING);
                            tracing::info!(target: "kiln::engine", "the engine process is back");
                        }
                        FromWorker::LoadFailed { message } => {
                            tracing::warn!(target: "kiln::engine", "the engine process could not load its model: {message}");
                        }
                        FromWorker::Admitted { id } => {
                            if let Some(r) = requests.get_mut(&id) {
                                if let Some(reply) = r.reply.take() {
                                    if reply.send(Ok(id)).is_err() {
                                        requests.remove(&id);
                                        self.send(&ToWorker::Cancel { id });
                                    }
                                }
                            }
                        }
                        FromWorker::Refused { id, error } => {
                            if let Some(r) = requests.remove(&id) {
                                if let Some(reply) = r.reply {
                                    let _ = reply.send(Err(error.into()));
                                }
                            }
                        }
                        FromWorker::Event { id, event } => {
                            let last =
                                matches!(event, Event::Finished { .. } | Event::Failed { .. });
                            let delivered = requests
                                .get(&id)
                                .is_some_and(|r| r.events.send(event).is_ok());
                            if last || !delivered {
                                if requests.remove(&id).is_some() && !delivered {
                                    self.send(&ToWorker::Cancel { id });
                                }
                            }
                        }
                        FromWorker::Stats { call, stats: s } => {
                            if let Some(reply) = stats.remove(&call) {
                                let _ = reply.send(*s);
                            }
                        }
                        FromWorker::Embedded { call, result } => {
                            if let Some(reply) = embeds.remove(&call) {
                                let _ = reply.send(result.map_err(EngineError::from));
                            }
                        }
                    }
                }
                Input::Closed(_, why) => {
                    let ran = self.worker.as_ref().map(|w| w.started.elapsed());
                    let why = self
                        .worker
                        .as_mut()
                        .and_then(|w| w.silenced.take())
                        .unwrap_or(why);
                    let ended = self.reap();
                    status.set(StatusCell::RESTARTING);
                    status.num_restarts.fetch_add(1, Ordering::Relaxed);
                    let message = format!(
                        "the engine process ended ({ended}; {why}) and is restarting; retry the request"
                    );
                    tracing::warn!(target: "kiln::engine", "{message}");
                    for (_, r) in requests.drain() {
                        match r.reply {
                            Some(reply) => {
                                let _ = reply.send(Err(EngineError::Restarting));
                            }
                            None => {
                                let _ = r.events.send(Event::Failed {
                                    message: message.clone(),
                                    retryable: true,
                                });
                            }
                        }
                    }
                    // Stats and embeddings asked of it get no answer: their
                    // callers see the engine gone.
                    stats.clear();
                    for (_, reply) in embeds.drain() {
                        let _ = reply.send(Err(EngineError::Restarting));
                    }
                    if ran.is_some_and(|d| d >= STABLE) {
                        backoff = FIRST_BACKOFF;
                    }
                    restart_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        status.set(StatusCell::STOPPED);
        for (_, r) in requests.drain() {
            let _ = r.events.send(Event::Failed {
                message: "the engine has stopped".into(),
                retryable: false,
            });
        }
        self.reap();
    }
}

/// How a process ended, as a person reads it.
fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        let name = match sig {
            6 => " (aborted)",
            9 => " (killed)",
            11 => " (segmentation fault)",
            15 => " (terminated)",
            _ => "",
        };
        return format!("signal {sig}{name}");
    }
    match status.code() {
        Some(c) => format!("exit status {c}"),
        None => "unknown status".into(),
    }
}
