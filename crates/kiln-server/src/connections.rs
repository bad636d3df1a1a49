//! The listener: connections accepted by hand and served with hyper's
//! HTTP/1.1 server, so that no client can hold the server. A connection
//! is closed when the head of a request takes longer than
//! `header_read_timeout` from its first byte (slowloris), or when it stays
//! idle — no request in progress — for `idle_timeout`; past
//! `max_connections` open connections, new ones get a 503 with a short JSON
//! body and are closed. Request bodies are timed by the request guard
//! (`guard.rs`), which knows each route's error shape.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::errors::ApiError;

/// How long connections may take and how many may be open.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

/// Largest request head hyper reads (its read buffer); past it, 431.
const MAX_HEAD_BYTES: usize = 256 << 10;

/// Most connections being refused at once; past it, new ones are closed
/// without an answer.
const MAX_REFUSING: usize = 64;

/// Accepts and serves connections until `stop` becomes true, then asks
/// every connection to close after its current request and returns when
/// all have.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusing = Arc::new(AtomicUsize::new(0));
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|&s| s) => break,
        };
        while connections.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // Out of file descriptors or a connection reset before it was
            // accepted: wait a moment rather than spin.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        match permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let conn = connection(stream, app.clone(), limits, stop.clone(), permit);
                connections.spawn(conn);
            }
            Err(_) => {
                if refusing.fetch_add(1, Ordering::AcqRel) < MAX_REFUSING {
                    let refusing = refusing.clone();
                    connections.spawn(async move {
                        refuse(stream, limits.max_connections).await;
                        refusing.fetch_sub(1, Ordering::AcqRel);
                    });
                } else {
                    refusing.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Serves one connection under the limits; ends when the client or the
/// server closes it.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched::new(stream, activity.clone()));
    let service_activity = activity.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::begin(service_activity.clone());
        let app = app.clone();
        async move {
            let response = match app.oneshot(req.map(Body::new)).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok::<Response, Infallible>(response.map(|body| {
                Body::new(Tracked {
                    body,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    let mut builder = http1::Builder::new();
    // The head timeout is kept here (from the head's first byte, not from
    // the end of the previous request), so hyper's own is off.
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(4 * crate::guard::MAX_HEADERS);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let tick = (limits.header_read_timeout.min(limits.idle_timeout) / 4)
        .clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut ticks = tokio::time::interval(tick);
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = ticks.tick() => {
                if activity.expired(&limits) {
                    return;
                }
            }
            _ = stop.wait_for(|&s| s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Answers a connection over the cap with 503 and closes it.
async fn refuse(stream: TcpStream, max_connections: usize) {
    let body = ApiError::Unavailable(format!(
        "too many open connections (at most {max_connections}); retry shortly"
    ))
    .body()
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = async {
        let mut rest = response.as_bytes();
        while !rest.is_empty() {
            stream.writable().await?;
            match stream.try_write(rest) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        // Read what the client sent, so closing does not reset the
        // connection before it reads the answer.
        let mut sink = [0u8; 4096];
        loop {
            stream.readable().await?;
            match stream.try_read(&mut sink) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), answer).await;
}

/// What a connection is doing, for its timeouts: requests in progress,
/// when it last became idle, and when the head of the next request began.
struct Activity {
    epoch: Instant,
    in_flight: AtomicUsize,
    /// Response heads the router's requests have yet to write.
    heads_owed: AtomicUsize,
    /// Milliseconds after `epoch`.
    idle_since: AtomicU64,
    /// Milliseconds after `epoch`, plus one; zero while no head is coming.
    head_since: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            epoch: Instant::now(),
            in_flight: AtomicUsize::new(0),
            heads_owed: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Bytes arrived: with no request in progress, a head has begun.
    fn on_read(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0 {
            let now = self.now_ms() + 1;
            let _ = self
                .head_since
                .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Whether the connection has outstayed a limit: a head that is taking
    /// too long, or idleness.
    fn expired(&self, limits: &ConnectionLimits) -> bool {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return false;
        }
        let now = self.now_ms();
        let since = |ms: u64| Duration::from_millis(now.saturating_sub(ms));
        match self.head_since.load(Ordering::Acquire) {
            0 => since(self.idle_since.load(Ordering::Acquire)) > limits.idle_timeout,
            head => since(head - 1) > limits.header_read_timeout,
        }
    }
}

/// One request in progress on a connection, from its head until its
/// response body is done.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn begin(activity: Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        activity.heads_owed.fetch_add(1, Ordering::AcqRel);
        activity.head_since.store(0, Ordering::Release);
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.idle_since.store(a.now_ms(), Ordering::Release);
        a.head_since.store(0, Ordering::Release);
        a.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in progress.
struct Tracked {
    body: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The connection's socket, noting when bytes arrive, and giving the
/// responses hyper writes on its own (a request head it cannot parse:
/// 400, 414, 431 — a response head no request of the router owes) a JSON
/// body.
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
    /// A replacement being written: its bytes, how many are out, and how
    /// many of hyper's bytes it stands for.
    replacing: Option<(Vec<u8>, usize, usize)>,
}

impl Watched {
    fn new(stream: TcpStream, activity: Arc<Activity>) -> Self {
        Watched {
            stream,
            activity,
            replacing: None,
        }
    }

    /// Writes the replacement for hyper's `claimed` bytes starting with
    /// `first`, if they are hyper's own error response.
    fn poll_replace(
        &mut self,
        cx: &mut Context<'_>,
        first: &[u8],
        claimed: usize,
    ) -> Option<Poll<io::Result<usize>>> {
        if self.replacing.is_none() {
            // Only the start of a final response head is looked at.
            if !first.starts_with(b"HTTP/1.1 ") || first.starts_with(b"HTTP/1.1 1") {
                return None;
            }
            // The head of a response the router made.
            let owed = &self.activity.heads_owed;
            if owed
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
            {
                return None;
            }
            let replacement = hyper_error_response(first)?;
            self.replacing = Some((replacement, 0, claimed));
        }
        let (bytes, done, claimed) = self.replacing.as_mut()?;
        while *done < bytes.len() {
            match Pin::new(&mut self.stream).poll_write(cx, &bytes[*done..]) {
                Poll::Ready(Ok(0)) => {
                    return Some(Poll::Ready(Err(io::ErrorKind::WriteZero.into())))
                }
                Poll::Ready(Ok(n)) => *done += n,
                Poll::Ready(Err(e)) => return Some(Poll::Ready(Err(e))),
                Poll::Pending => return Some(Poll::Pending),
            }
        }
        let claimed = *claimed;
        self.replacing = None;
        Some(Poll::Ready(Ok(claimed)))
    }
}

/// Hyper's head-parse error responses have empty bodies; this is the same
/// status with a JSON error body (OpenAI's shape: the route is unknown).
fn hyper_error_response(head: &[u8]) -> Option<Vec<u8>> {
    let rest = head.strip_prefix(b"HTTP/1.1 ")?;
    let code = std::str::from_utf8(rest.get(..3)?).ok()?;
    let error = match code {
        "414" => ApiError::UriTooLong { limit: 65534 },
        "431" => ApiError::HeadersTooLarge {
            limit: MAX_HEAD_BYTES,
        },
        "400" => ApiError::InvalidRequest {
            message: "the request is not valid HTTP/1.1".into(),
            param: None,
        },
        _ => return None,
    };
    let status = error.status();
    let body = error.body().to_string();
    let response = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    Some(response.into_bytes())
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.on_read();
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(poll) = self.poll_replace(cx, buf, buf.len()) {
            return poll;
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
            let claimed = bufs.iter().map(|b| b.len()).sum();
            if let Some(poll) = self.poll_replace(cx, first, claimed) {
                return poll;
            }
        }
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
