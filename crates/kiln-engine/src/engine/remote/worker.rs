//! The engine process's side: serves one engine to the server's process
//! over the socket that is its standard input, until the server closes it.

use std::collections::HashMap;
use std::io;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::wire::{self, FromWorker, ToWorker, WireError};
use crate::engine::{Engine, EngineHandle};
use crate::events::Event;

/// The socket to the server: standard input, as the server started us.
fn socket() -> io::Result<UnixStream> {
    // SAFETY: fd 0 is open for the life of the process, and nothing else
    // in it reads standard input; the stream takes it over.
    let s = unsafe { UnixStream::from_raw_fd(0) };
    // Fails unless fd 0 is a socket (a terminal, a file): not started by
    // a server.
    s.peer_addr()?;
    Ok(s)
}

/// Tells the server that the model could not be loaded (the caller then
/// exits). For the binary's engine mode.
pub fn report_load_failure(message: &str) {
    if let Ok(mut s) = socket() {
        let _ = wire::write(
            &mut s,
            &FromWorker::LoadFailed {
                message: message.to_string(),
            },
        );
    }
}

/// Serves `engine` to the server that started this
/// process, until it closes the connection; then the engine stops.
pub fn serve(engine: Engine) -> io::Result<()> {
    let socket = socket()?;
    let mut reader = socket.try_clone()?;
    let writer = Arc::new(Mutex::new(socket));
    let handle = engine.handle();
    let send = {
        let writer = writer.clone();
        move |m: &FromWorker| {
            let mut w = writer.lock().unwrap_or_else(|e| e.into_inner());
            let _ = wire::write(&mut *w, m);
        }
    };
    send(&FromWorker::Ready {
        generates: handle.model().model.generates(),
        context: handle.context_length(),
    });
    let cancelled: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>> = Arc::default();
    while let Some(message) = wire::read::<ToWorker>(&mut reader)? {
        match message {
            ToWorker::Submit { id, request } => {
                let flag = Arc::new(AtomicBool::new(false));
                cancelled
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, flag.clone());
                let (handle, send, cancelled) = (handle.clone(), send.clone(), cancelled.clone());
                std::thread::spawn(move || {
                    run_request(&handle, id, request.into_request(), &flag, &send);
                    cancelled
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                });
            }
            ToWorker::Cancel { id } => {
                if let Some(f) = cancelled.lock().unwrap_or_else(|e| e.into_inner()).get(&id) {
                    f.store(true, Ordering::Release);
                }
            }
            ToWorker::Stats { call } => {
                if let Ok(stats) = handle.stats() {
                    send(&FromWorker::Stats {
                        call,
                        stats: Box::new(stats),
                    });
                }
            }
            ToWorker::Embed { call, inputs } => {
                let (handle, send) = (handle.clone(), send.clone());
                std::thread::spawn(move || {
                    let result = handle.embed(inputs).map_err(WireError::from);
                    send(&FromWorker::Embedded { call, result });
                });
            }
        }
    }
    drop(engine);
    Ok(())
}

/// Submits one request and sends its events until it ends or the server
/// cancels it.
fn run_request(
    handle: &EngineHandle,
    id: u64,
    request: crate::generate::GenerationRequest,
    cancelled: &AtomicBool,
    send: &impl Fn(&FromWorker),
) {
    let stream = match handle.submit(request) {
        Ok(s) => s,
        Err(e) => {
            send(&FromWorker::Refused {
                id,
                error: e.into(),
            });
            return;
        }
    };
    send(&FromWorker::Admitted { id });
    loop {
        if cancelled.load(Ordering::Acquire) {
            // Dropping the stream cancels the request in the engine.
            return;
        }
        match stream.next_event_timeout(Duration::from_millis(20)) {
            Ok(Some(event)) => {
                let last = matches!(event, Event::Finished { .. } | Event::Failed { .. });
                send(&FromWorker::Event { id, event });
                if last {
                    return;
                }
            }
            Ok(None) => {
                send(&FromWorker::Event {
                    id,
                    event: Event::Failed {
                        message: "the engine stopped".into(),
                        retryable: true,
                    },
                });
                return;
            }
            Err(()) => {}
        }
    }
}
