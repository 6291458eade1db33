//! The admin side's HTTP/1 server: hyper on a one-thread tokio runtime of
//! its own, with everything a client can hold bounded.
//!
//! Both admin listeners face clients we do not control (`metrics_listen`
//! faces the network), so no request may cost more than a fixed amount of
//! memory, threads or time, and no client may stop the listener:
//!
//! - a request line and headers of at most [`HEADER_BYTES_MAX`] bytes in
//!   at most [`HEADERS_MAX`] fields, read within [`HEADER_READ_TIMEOUT`]
//!   (which is also the keep-alive idle limit: hyper starts that timer
//!   whenever it waits for a request head);
//! - a body of at most [`BODY_BYTES_MAX`] bytes (no route reads one; a
//!   larger declared length is answered 413 before a byte of it is read),
//!   read within [`BODY_READ_TIMEOUT`];
//! - a response drained within [`WRITE_TIMEOUT`] as a whole;
//! - at most [`CONNECTIONS_MAX`] connections a listener. When all are held,
//!   a new connection evicts the one that has been idle (between requests,
//!   or still sending its head) the longest, so a crowd of idle or slow
//!   clients cannot lock a probe out; only when every connection is inside
//!   a handler is a new one closed at once;
//! - one thread for all connections, and at most [`BLOCKING_THREADS_MAX`]
//!   more for the routes that block (model loads, resync accepts), so a
//!   slow control never delays `/readyz`;
//! - an accept error (EMFILE, ENFILE, ENOBUFS...) is counted, logged at
//!   most once a second, and waited out; the listener never stops.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Incoming};
use hyper::{Request, Response};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// Connections a listener holds at once.
pub const CONNECTIONS_MAX: usize = 256;
/// The request line and headers together.
pub const HEADER_BYTES_MAX: usize = 8 * 1024;
/// Header fields in one request.
pub const HEADERS_MAX: usize = 32;
/// No route reads a body; a client may still send a small one.
pub const BODY_BYTES_MAX: u64 = 1024;
/// For a whole request head, and for the next one on a kept-alive connection.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// For a whole response, from its first byte written.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Threads for the routes that block, beside the one that serves.
pub const BLOCKING_THREADS_MAX: usize = 2;
/// How long accepting pauses after an error that more accepts would repeat.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// hyper's smallest read buffer; heads are bounded by `HEADER_BYTES_MAX`.
const READ_BUFFER_BYTES_MAX: usize = 16 * 1024;

/// What the listeners count, for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    pub accepted: AtomicU64,
    /// Idle connections closed to admit a new one.
    pub evicted: AtomicU64,
    /// New connections closed because every held one was inside a handler.
    pub refused: AtomicU64,
    pub accept_errors: AtomicU64,
    /// Requests answered 408 or 413, or connections closed for a slow
    /// head or response.
    pub rejected: AtomicU64,
    last_accept_log_s: AtomicU64,
}

/// What a request said that a route needs: owned, so a blocking route can
/// take it to another thread.
#[derive(Debug)]
pub struct Head {
    pub method: String,
    /// Path and query, as sent.
    pub url: String,
    pub remote: SocketAddr,
    pub authorization: Option<String>,
    pub host: Option<String>,
    pub origin: Option<String>,
    pub sec_fetch_site: Option<String>,
}

/// A route's answer.
#[derive(Debug)]
pub struct Answer {
    pub code: u16,
    pub content_type: &'static str,
    pub body: String,
    /// Adds `WWW-Authenticate: Bearer`.
    pub bearer_challenge: bool,
}

impl Answer {
    pub fn text(code: u16, body: impl Into<String>) -> Answer {
        Answer { code, content_type: "text/plain; charset=utf-8", body: body.into(), bearer_challenge: false }
    }

    pub fn json(code: u16, body: String) -> Answer {
        Answer { code, content_type: "application/json", body, bearer_challenge: false }
    }
}

/// The routes a listener serves.
pub trait Handler: Send + Sync + 'static {
    /// Whether answering `head` may block (file reads, model builds, waits):
    /// such requests run on the blocking threads.
    fn blocks(&self, head: &Head) -> bool;
    fn answer(&self, head: &Head) -> Answer;
}

/// A listener being served on its own thread.
pub struct Listener {
    stop: Arc<Notify>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Serves `listener` on a new thread named `name`.
    pub fn start(
        name: String,
        listener: std::net::TcpListener,
        handler: Arc<dyn Handler>,
        counters: Arc<Counters>,
    ) -> io::Result<Listener> {
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .max_blocking_threads(BLOCKING_THREADS_MAX)
            .thread_name(format!("{name}-blocking"))
            .build()?;
        let stop = Arc::new(Notify::new());
        let thread = std::thread::Builder::new().name(name).spawn({
            let stop = stop.clone();
            move || {
                let local = tokio::task::LocalSet::new();
                local.block_on(&runtime, serve(listener, handler, counters, stop));
                // A model load still running on a blocking thread finishes
                // on its own; stopping does not wait for it.
                drop(local);
                runtime.shutdown_timeout(Duration::from_secs(1));
            }
        })?;
        Ok(Listener { stop, thread: Some(thread) })
    }

    /// Stops accepting, closes every connection and joins the thread.
    pub fn stop(mut self) {
        self.stop.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(listener: std::net::TcpListener, handler: Arc<dyn Handler>, counters: Arc<Counters>, stop: Arc<Notify>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "admin listener could not be registered; it does not serve");
            return;
        }
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_headers(HEADERS_MAX)
        .max_header_size(HEADER_BYTES_MAX)
        .max_buf_size(READ_BUFFER_BYTES_MAX);
    let builder = Rc::new(builder);
    let table = Rc::new(Table::new(CONNECTIONS_MAX));
    loop {
        let accepted = tokio::select! {
            biased;
            () = stop.notified() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                accept_failed(&counters, &e);
                if !matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset) {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
                continue;
            }
        };
        let Some(conn) = table.admit(&counters) else {
            counters.refused.fetch_add(1, Relaxed);
            drop(stream);
            continue;
        };
        counters.accepted.fetch_add(1, Relaxed);
        let (builder, table, handler, counters) = (builder.clone(), table.clone(), handler.clone(), counters.clone());
        tokio::task::spawn_local(async move {
            let _ = stream.set_nodelay(true);
            let io = hyper_util::rt::TokioIo::new(WriteDeadline::new(stream, WRITE_TIMEOUT));
            let service = {
                let (conn, counters) = (conn.clone(), counters.clone());
                hyper::service::service_fn(move |request| {
                    respond(request, remote, conn.clone(), handler.clone(), counters.clone())
                })
            };
            let served = builder.serve_connection(io, service);
            tokio::select! {
                served = served => if let Err(e) = served {
                    if e.is_timeout() || e.is_parse_too_large() || io_timed_out(&e) {
                        counters.rejected.fetch_add(1, Relaxed);
                    }
                    tracing::debug!(%remote, error = %e, "admin connection ended");
                },
                () = conn.evict.notified() => {}
            }
            table.release(conn.id);
        });
    }
}

fn io_timed_out(e: &hyper::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<io::Error>())
        .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut)
}

fn accept_failed(counters: &Counters, e: &io::Error) {
    counters.accept_errors.fetch_add(1, Relaxed);
    let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let last = counters.last_accept_log_s.load(Relaxed);
    if now_s > last && counters.last_accept_log_s.compare_exchange(last, now_s, Relaxed, Relaxed).is_ok() {
        tracing::warn!(
            error = %e,
            total = counters.accept_errors.load(Relaxed),
            "admin listener: accept failed; retrying (out of file descriptors? raise LimitNOFILE)"
        );
    }
}

/// One request, from head to answer.
async fn respond(
    request: Request<Incoming>,
    remote: SocketAddr,
    conn: Rc<Conn>,
    handler: Arc<dyn Handler>,
    counters: Arc<Counters>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    conn.busy.set(true);
    let answer = answer(request, remote, handler, &counters).await;
    conn.busy.set(false);
    conn.idle_since.set(Instant::now());
    Ok(answer)
}

async fn answer(
    request: Request<Incoming>,
    remote: SocketAddr,
    handler: Arc<dyn Handler>,
    counters: &Counters,
) -> Response<Full<Bytes>> {
    let header = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let head = Head {
        method: request.method().as_str().to_string(),
        url: request.uri().path_and_query().map_or_else(|| request.uri().path().to_string(), |p| p.to_string()),
        remote,
        authorization: header("authorization"),
        host: header("host"),
        origin: header("origin"),
        sec_fetch_site: header("sec-fetch-site"),
    };
    if request.body().size_hint().lower() > BODY_BYTES_MAX {
        counters.rejected.fetch_add(1, Relaxed);
        let why = format!("request body too large: admin requests carry at most {BODY_BYTES_MAX} bytes\n");
        return closing(Answer::text(413, why));
    }
    match tokio::time::timeout(BODY_READ_TIMEOUT, Limited::new(request.into_body(), BODY_BYTES_MAX as usize).collect())
        .await
    {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            counters.rejected.fetch_add(1, Relaxed);
            let why = format!("request body too large: admin requests carry at most {BODY_BYTES_MAX} bytes\n");
            return closing(Answer::text(413, why));
        }
        Ok(Err(_)) => return closing(Answer::text(400, "the request body could not be read\n")),
        Err(_) => {
            counters.rejected.fetch_add(1, Relaxed);
            let why = format!("request body not received within {} s\n", BODY_READ_TIMEOUT.as_secs());
            return closing(Answer::text(408, why));
        }
    }
    let answer = if handler.blocks(&head) {
        let handler = handler.clone();
        match tokio::task::spawn_blocking(move || handler.answer(&head)).await {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, "admin: a control request failed");
                Answer::text(500, "internal error\n")
            }
        }
    } else {
        handler.answer(&head)
    };
    response(answer)
}

fn response(answer: Answer) -> Response<Full<Bytes>> {
    let mut builder = Response::builder().status(answer.code).header("content-type", answer.content_type);
    if answer.bearer_challenge {
        builder = builder.header("www-authenticate", "Bearer");
    }
    builder.body(Full::new(Bytes::from(answer.body))).unwrap_or_else(|_| {
        let mut r = Response::new(Full::new(Bytes::from_static(b"internal error\n")));
        *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
        r
    })
}

/// An answer after which the connection closes: the client may still be
/// sending a body that will not be read.
fn closing(answer: Answer) -> Response<Full<Bytes>> {
    let mut r = response(answer);
    r.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
    r
}

/// A held connection, as the accept loop sees it.
struct Conn {
    id: u64,
    /// Inside a handler: not evicted.
    busy: Cell<bool>,
    idle_since: Cell<Instant>,
    evict: Notify,
}

/// The connections of one listener. Invariant: at most `max` entries.
struct Table {
    conns: RefCell<Vec<Rc<Conn>>>,
    max: usize,
    next_id: Cell<u64>,
}

impl Table {
    fn new(max: usize) -> Table {
        assert!(max > 0);
        Table { conns: RefCell::new(Vec::with_capacity(max)), max, next_id: Cell::new(0) }
    }

    /// A slot for a new connection: a free one, or the one idle the
    /// longest, whose task is told to close. `None` when every connection
    /// is inside a handler.
    fn admit(&self, counters: &Counters) -> Option<Rc<Conn>> {
        let mut conns = self.conns.borrow_mut();
        if conns.len() == self.max {
            let (at, _) =
                conns.iter().enumerate().filter(|(_, c)| !c.busy.get()).min_by_key(|(_, c)| c.idle_since.get())?;
            let evicted = conns.swap_remove(at);
            evicted.evict.notify_one();
            counters.evicted.fetch_add(1, Relaxed);
        }
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        let conn =
            Rc::new(Conn { id, busy: Cell::new(false), idle_since: Cell::new(Instant::now()), evict: Notify::new() });
        conns.push(conn.clone());
        assert!(conns.len() <= self.max);
        Some(conn)
    }

    fn release(&self, id: u64) {
        let mut conns = self.conns.borrow_mut();
        if let Some(at) = conns.iter().position(|c| c.id == id) {
            conns.swap_remove(at);
        }
    }
}

/// A stream whose every response must be written within a limit: the clock
/// starts at the first write after the client last sent bytes, so a client
/// that reads a large `/metrics` a byte at a time is cut off, not served
/// for ever. The v2 front end's listeners (`src/oip/`) use it too.
pub struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub fn new(inner: S, limit: Duration) -> WriteDeadline<S> {
        WriteDeadline { inner, limit, deadline: None }
    }

    /// Starts the clock if no response is being written; errs once it ran out.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let limit = self.limit;
        let deadline = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("response not taken by the client within {} s", limit.as_secs()),
            )),
            Poll::Pending => Ok(()),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.deadline = None;
        }
        read
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_evicts_the_longest_idle_and_never_a_busy_one() {
        let counters = Counters::default();
        let table = Table::new(2);
        let a = table.admit(&counters).unwrap();
        let b = table.admit(&counters).unwrap();
        a.busy.set(true);
        let c = table.admit(&counters).unwrap();
        assert_eq!(counters.evicted.load(Relaxed), 1);
        let held: Vec<u64> = table.conns.borrow().iter().map(|c| c.id).collect();
        assert!(held.contains(&a.id) && held.contains(&c.id) && !held.contains(&b.id), "{held:?}");
        c.busy.set(true);
        assert!(table.admit(&counters).is_none(), "every connection is inside a handler");
        table.release(a.id);
        assert!(table.admit(&counters).is_some());
        assert_eq!(table.conns.borrow().len(), 2);
    }

    #[test]
    fn a_response_the_client_does_not_take_is_cut_off_and_the_next_gets_a_fresh_limit() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build().unwrap();
        rt.block_on(async {
            let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
            let mut w = WriteDeadline::new(ours, Duration::from_millis(100));
            let chunk = [0u8; 64 * 1024];
            let started = Instant::now();
            let err = loop {
                if let Err(e) = std::future::poll_fn(|cx| Pin::new(&mut w).poll_write(cx, &chunk)).await {
                    break e;
                }
            };
            assert_eq!(err.kind(), io::ErrorKind::TimedOut);
            assert!(started.elapsed() >= Duration::from_millis(100));
            // The client sends a new request: its response has the whole limit.
            theirs.try_write(b"GET").unwrap();
            let mut buf = [0u8; 8];
            let mut read = ReadBuf::new(&mut buf);
            std::future::poll_fn(|cx| Pin::new(&mut w).poll_read(cx, &mut read)).await.unwrap();
            assert!(w.deadline.is_none());
            let wrote = std::future::poll_fn(|cx| Pin::new(&mut w).poll_flush(cx)).await;
            assert!(wrote.is_ok());
        });
    }
}
