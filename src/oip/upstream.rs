//! The front end's connections to the shards: FlatBuffers frames over the
//! scoring port, as any client sends them, so a v2 request takes exactly
//! the request path a FlatBuffers one takes.
//!
//! A fixed set of connections (`[oip] upstream_connections`) is opened to
//! the shards' listener, which spreads them over the shards like any
//! client's. Each is multiplexed: callers hand it a request and wait for a
//! one-shot answer; a writer task frames every request waiting into one
//! write, a reader task routes each response to its caller by request id
//! (responses may come back out of order). In-flight requests are bounded
//! by permits (`[oip] in_flight_max`): a caller that finds none is told
//! at once, never queued. A connection that fails fails its pending callers
//! (they are answered UNAVAILABLE) and is opened again, with a pause after
//! a failed connect.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::client::Codec;
use crate::wire::{RequestSpec, Response};

/// Requests a connection's writer takes into one write.
const WRITE_BATCH_MAX: usize = 64;
/// Pause after a failed connect before the next.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// Largest response frame accepted from a shard.
const RESPONSE_BYTES_MAX: usize = 1 << 20;

/// Why a request got no answer from a shard.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum UpstreamError {
    #[error("the front end has {0} requests in flight to the shards, its limit (oip.in_flight_max)")]
    Busy(usize),
    #[error("the connection to the shards failed: {0}")]
    Lost(String),
}

type Reply = oneshot::Sender<Result<Response, UpstreamError>>;

struct Call {
    spec: RequestSpec,
    reply: Reply,
}

/// The connections, shared by every task of the front end.
pub struct Upstream {
    conns: Vec<mpsc::UnboundedSender<Call>>,
    next: AtomicUsize,
    permits: Semaphore,
    in_flight_max: usize,
}

impl Upstream {
    /// Opens `connections` connections to `addr` (in the background: a
    /// request sent before one is up waits for it, within its timeout).
    /// Call from inside the front end's runtime.
    pub fn start(addr: SocketAddr, connections: usize, in_flight_max: usize) -> Upstream {
        let conns = (0..connections.max(1))
            .map(|_| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(connection(addr, rx));
                tx
            })
            .collect();
        Upstream { conns, next: AtomicUsize::new(0), permits: Semaphore::new(in_flight_max), in_flight_max }
    }

    /// Sends `spec` (its request id is the connection's to set) and waits
    /// for the shard's response.
    pub async fn call(&self, spec: RequestSpec) -> Result<Response, UpstreamError> {
        // Held until this caller has its answer or gives up (its future
        // dropped by a timeout).
        let _permit = self.permits.try_acquire().map_err(|_| UpstreamError::Busy(self.in_flight_max))?;
        let (reply, answer) = oneshot::channel();
        let at = self.next.fetch_add(1, Relaxed) % self.conns.len();
        self.conns[at]
            .send(Call { spec, reply })
            .map_err(|_| UpstreamError::Lost("the front end is stopping".into()))?;
        answer.await.unwrap_or_else(|_| Err(UpstreamError::Lost("the connection closed".into())))
    }
}

/// Pending callers of one connection, by request id.
type Pending = Arc<Mutex<HashMap<u64, Reply>>>;

/// One connection to the shards, opened again whenever it fails, until
/// every sender is gone.
async fn connection(addr: SocketAddr, mut calls: mpsc::UnboundedReceiver<Call>) {
    let mut next_id: u64 = 1;
    loop {
        let stream = match tokio::net::TcpStream::connect(addr).await {
            Ok(s) => s,
            Err(e) => {
                // Nobody waits on a connection that is not there.
                while let Ok(call) = calls.try_recv() {
                    let _ = call.reply.send(Err(UpstreamError::Lost(format!("connecting to {addr}: {e}"))));
                }
                if calls.is_closed() {
                    return;
                }
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (read, write) = stream.into_split();
        let pending: Pending = Arc::default();
        let why = tokio::select! {
            why = writer(write, &mut calls, &pending, &mut next_id) => why,
            why = reader(read, &pending) => why,
        };
        let Some(why) = why else { return };
        tracing::debug!(%addr, %why, "oip: a connection to the shards closed; opening it again");
        let failed: Vec<Reply> = pending.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, r)| r).collect();
        for reply in failed {
            let _ = reply.send(Err(UpstreamError::Lost(why.clone())));
        }
    }
}

/// Frames the calls waiting into one write, until the connection fails
/// (`Some(why)`) or every sender is gone (`None`).
async fn writer(
    mut write: tokio::net::tcp::OwnedWriteHalf,
    calls: &mut mpsc::UnboundedReceiver<Call>,
    pending: &Pending,
    next_id: &mut u64,
) -> Option<String> {
    let mut codec = Codec::default();
    let mut buf = Vec::with_capacity(64 * 1024);
    loop {
        let first = calls.recv().await?;
        buf.clear();
        let mut batch = Some(first);
        let mut taken = 0;
        while let Some(mut call) = batch.take() {
            call.spec.request_id = *next_id;
            *next_id = next_id.wrapping_add(1);
            codec.encode(&call.spec, &mut buf);
            pending.lock().unwrap_or_else(|e| e.into_inner()).insert(call.spec.request_id, call.reply);
            taken += 1;
            if taken < WRITE_BATCH_MAX {
                batch = calls.try_recv().ok();
            }
        }
        if let Err(e) = write.write_all(&buf).await {
            return Some(format!("writing: {e}"));
        }
    }
}

/// Routes each response to its caller, until the connection fails.
async fn reader(mut read: tokio::net::tcp::OwnedReadHalf, pending: &Pending) -> Option<String> {
    let mut codec = Codec::default();
    codec.frame_bytes_max = RESPONSE_BYTES_MAX;
    let mut buf = vec![0u8; 64 * 1024];
    let mut filled = 0;
    loop {
        if filled == buf.len() {
            let grown = (buf.len() * 2).min(RESPONSE_BYTES_MAX + crate::wire::FRAME_PREFIX_BYTES);
            if grown <= buf.len() {
                return Some("a response frame over the limit".into());
            }
            buf.resize(grown, 0);
        }
        match read.read(&mut buf[filled..]).await {
            Ok(0) => return Some("the shard closed the connection".into()),
            Ok(n) => filled += n,
            Err(e) => return Some(format!("reading: {e}")),
        }
        let mut at = 0;
        loop {
            match codec.decode(&buf[at..filled]) {
                Ok(Some((response, used))) => {
                    at += used;
                    let reply = pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&response.request_id);
                    // A caller that gave up (its timeout) dropped its end.
                    if let Some(reply) = reply {
                        let _ = reply.send(Ok(response));
                    }
                }
                Ok(None) => break,
                Err(e) => return Some(format!("a bad response frame: {e}")),
            }
        }
        buf.copy_within(at..filled, 0);
        filled -= at;
    }
}
