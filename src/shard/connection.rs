//! One connection's life on its shard: the optional TLS handshake, then
//! rounds of read → answer every complete frame → write, until the client
//! closes, a timeout fires or the shard drains; and what the shard keeps
//! for starting connections (`Conns`), accepted or handed over.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;

use super::balance::{self, ShardBalance};
use super::mailbox::{Mailbox, Mailboxes, Notify, Returned};
use super::stall::StallMeter;
use super::{
    refresh, stamped, tls_stream, ListenerTls, ShardReport, ShutdownSignal, QUEUED_WAIT, READ_BUFFER_BYTES_MIN,
};
use crate::deadline::{Clock, MonotonicClock};
use crate::metrics::{self, StallTask};
use crate::request::{response_frame_bytes_max, Handled, RequestPath};
use crate::wire::{self, FRAME_PREFIX_BYTES};

/// What woke a connection waiting between rounds.
enum Wake {
    /// Bytes read, and how long the newest of them waited in the socket.
    Read(std::io::Result<(usize, Option<u64>)>),
    Delivered,
    Shutdown,
    /// The frame partly read is not complete within `frame_timeout_ms`.
    FrameTimedOut,
}

/// What a shard needs to start serving a connection, accepted or handed over.
pub(super) struct Conns {
    pub(super) shard: usize,
    pub(super) mailboxes: Rc<Mailboxes>,
    pub(super) submitted: Rc<Notify>,
    pub(super) path: Rc<RefCell<RequestPath<MonotonicClock>>>,
    pub(super) shutdown: Rc<ShutdownSignal>,
    pub(super) limits: crate::request::Limits,
    pub(super) report: Rc<RefCell<ShardReport>>,
    pub(super) stalls: Rc<StallMeter>,
    pub(super) socket_wait_every_reads: u32,
    pub(super) active: Rc<Cell<usize>>,
    pub(super) balance: Rc<ShardBalance>,
    /// Wakes the shard's shadow task.
    pub(super) shadow_wanted: Rc<Notify>,
    pub(super) tls: Option<ListenerTls>,
    /// With `tls`: the new handshakes this shard may start.
    pub(super) handshakes: Option<tls_stream::HandshakeBudget>,
}

impl Conns {
    /// Serves `stream` on this shard until it closes. Its place in the
    /// balance counts was taken when it was placed here.
    pub(super) fn spawn(self: &Rc<Self>, stream: TcpStream, source: balance::Source) {
        self.report.borrow_mut().connections_accepted += 1;
        self.active.set(self.active.get() + 1);
        let conn = Connection { shard: self.clone() };
        let this = self.clone();
        glommio::spawn_local(async move {
            if let Err(e) = conn.serve(stream).await {
                let mut path = this.path.borrow_mut();
                match e.get_ref().and_then(|inner| inner.downcast_ref::<TimedOut>()) {
                    Some(TimedOut::Frame) => path.telemetry.counters.frames_timed_out += 1,
                    Some(TimedOut::Write) => path.telemetry.counters.writes_timed_out += 1,
                    None => {}
                }
                tracing::debug!(shard = this.shard, error = %e, "connection closed");
            }
            this.active.set(this.active.get() - 1);
            this.balance.closed(source);
        })
        .detach();
    }
}

/// Why a connection was closed for time: a frame not complete within
/// `frame_timeout_ms` of its first byte, or a round's responses not taken
/// within `write_timeout_ms`.
#[derive(Debug, thiserror::Error)]
enum TimedOut {
    #[error("frame not complete within frame_timeout_ms of its first byte")]
    Frame,
    #[error("responses not taken within write_timeout_ms")]
    Write,
}

impl From<TimedOut> for std::io::Error {
    fn from(t: TimedOut) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::TimedOut, t)
    }
}

/// A connection's bytes: the socket's own, or decrypted from TLS.
enum Transport {
    Plain(TcpStream),
    Tls(Box<tls_stream::TlsStream>),
}

impl Transport {
    fn tcp(&self) -> &TcpStream {
        match self {
            Transport::Plain(s) => s,
            Transport::Tls(s) => s.tcp(),
        }
    }

    async fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Transport::Plain(s) => s.write_all(buf).await,
            Transport::Tls(s) => s.write_all(buf).await,
        }
    }
}

/// One connection being served: what it needs is its shard's.
struct Connection {
    shard: Rc<Conns>,
}

impl Connection {
    async fn serve(self, stream: TcpStream) -> std::io::Result<()> {
        stream.set_nodelay(true)?;
        let mut stream = match &self.shard.tls {
            None => Transport::Plain(stream),
            Some(tls) => {
                let within = self.shard.handshakes.as_ref().is_none_or(|b| b.take(MonotonicClock::new().now_ns()));
                if !within {
                    self.shard.path.borrow_mut().telemetry.counters.tls_handshakes_refused += 1;
                    return Err(std::io::Error::other("over tls.handshakes_per_s_max: closed before the handshake"));
                }
                let handshake = self.handshake(stream, tls).await;
                let mut path = self.shard.path.borrow_mut();
                match handshake {
                    Ok(s) => {
                        path.telemetry.counters.tls_handshakes += 1;
                        Transport::Tls(Box::new(s))
                    }
                    Err(e) => {
                        path.telemetry.counters.tls_handshake_failures += 1;
                        return Err(e);
                    }
                }
            }
        };
        let (id, mailbox) = self.shard.mailboxes.open();
        let result = self.serve_rounds(&mut stream, id, &mailbox).await;
        // Answer every completion the stage still owes this connection (each
        // ends by its deadline; answering gives its job slot back), write
        // what can be written, then close.
        let mut rest = Vec::new();
        self.answer_returned(&mailbox, &mut rest);
        while mailbox.pending() > 0 {
            // `delivered` resolves while what came back waits in the
            // mailbox, so answer it before waiting for the next one.
            mailbox.delivered().await;
            self.answer_returned(&mailbox, &mut rest);
        }
        self.shard.mailboxes.close(id);
        if result.is_ok() && !rest.is_empty() {
            self.write_within(&mut stream, &rest).await?;
        }
        result
    }

    /// Answers into `out` what came back for this connection's handed-off
    /// requests: completions, and give-ups from the lower rungs.
    fn answer_returned(&self, mailbox: &Mailbox, out: &mut Vec<u8>) {
        let mut path = self.shard.path.borrow_mut();
        while let Some(returned) = mailbox.take() {
            match returned {
                Returned::Completed(done, token) => {
                    path.complete(done, token, out);
                }
                Returned::GiveUp(slot) => path.give_up(slot, out),
            }
        }
    }

    /// Writes `buf` whole within `write_timeout_ms`, however slowly the
    /// client reads (the socket's own timeout is per write call).
    async fn write_within(&self, stream: &mut Transport, buf: &[u8]) -> std::io::Result<()> {
        let limit = Duration::from_millis(self.shard.limits.write_timeout_ms);
        futures_lite::future::or(stream.write_all(buf), async {
            glommio::timer::sleep(limit).await;
            Err(TimedOut::Write.into())
        })
        .await
    }

    /// A TLS handshake on `stream`, within the configured time (the whole
    /// handshake, however the client trickles its bytes).
    async fn handshake(&self, stream: TcpStream, tls: &ListenerTls) -> std::io::Result<tls_stream::TlsStream> {
        let timeout = tls.handshake_timeout;
        futures_lite::future::or(tls_stream::TlsStream::accept(stream, tls.config.clone()), async {
            glommio::timer::sleep(timeout).await;
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out"))
        })
        .await
    }

    /// Reads what the socket has, waiting for it if need be; with socket
    /// timestamps, also how long the newest bytes waited in the socket.
    async fn read(
        &self,
        stream: &mut Transport,
        buf: &mut [u8],
        stamps: bool,
    ) -> std::io::Result<(usize, Option<u64>)> {
        let stream = match stream {
            Transport::Plain(s) => s,
            Transport::Tls(s) => return s.read(buf).await.map(|n| (n, None)),
        };
        let waited = |stamp: Option<u64>| stamp.map(|s| stamped::realtime_ns().saturating_sub(s));
        if !stamps || buf.len() < 2 {
            return stream.read(buf).await.map(|n| (n, None));
        }
        if let Some((n, stamp)) = stamped::try_recv(stream, buf)? {
            return Ok((n, waited(stamp)));
        }
        // Wait through the runtime's own read path for one byte, then take
        // the rest of what arrived with its stamp. (Waiting by a peek costs
        // more: io_uring may hand a pending receive to a worker thread.)
        let n = stream.read(&mut buf[..1]).await?;
        if n == 0 {
            return Ok((0, None));
        }
        match stamped::try_recv(stream, &mut buf[1..])? {
            Some((m, stamp)) => Ok((1 + m, waited(stamp))),
            None => Ok((1, None)),
        }
    }

    async fn serve_rounds(&self, stream: &mut Transport, id: u32, mailbox: &Mailbox) -> std::io::Result<()> {
        // Admission binds client ids to it; an unknown peer matches no network.
        let source = stream.tcp().peer_addr().map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip());
        // And to the names of a verified client certificate (mutual TLS).
        let tls_names = match &*stream {
            Transport::Tls(s) => s.peer_names(),
            Transport::Plain(_) => Vec::new(),
        };
        let peer = crate::request::admission::Peer { addr: source, tls_names: &tls_names };
        let every = self.shard.socket_wait_every_reads;
        // The kernel's stamps would be of ciphertext: TLS reads go unstamped.
        let stamps = every > 0 && matches!(stream, Transport::Plain(_)) && stamped::enable(stream.tcp()).is_ok();
        // How long the bytes of the last read waited in the socket, when it
        // was a stamped one; reads since the last stamped one.
        let mut socket_wait_ns: Option<u64> = None;
        let mut reads = 0u32;
        // When the frame now partly buffered began to arrive: the read
        // time of the round that first held its bytes.
        let clock = MonotonicClock::new();
        let frame_timeout_ns = self.shard.limits.frame_timeout_ms * 1_000_000;
        let mut frame_started_ns: Option<u64> = None;
        let mut round_ns;
        stream.tcp().set_read_timeout(Some(Duration::from_millis(self.shard.limits.idle_timeout_ms)))?;
        // No per-call write timeout: `write_within` bounds each round's
        // write as a whole.
        let frame_bytes_max = self.shard.limits.frame_bytes_max;
        let read_bytes_max = frame_bytes_max + FRAME_PREFIX_BYTES;
        let mut inbuf = vec![0u8; READ_BUFFER_BYTES_MIN.min(read_bytes_max)];
        let mut filled = 0usize;
        let out_cap = self.shard.limits.output_bytes_max + response_frame_bytes_max(self.shard.limits.candidates_max);
        let mut out = Vec::with_capacity(out_cap.min(1 << 20));
        loop {
            // Answer the complete frames already buffered, up to the output
            // cap and `frames_per_round_max`.
            let mut consumed = 0;
            let mut frames = 0;
            let mut broken = false;
            let t = self.shard.stalls.start();
            refresh(&self.shard.path, self.shard.shard);
            self.shard.stalls.end(StallTask::Refresh, t);
            let mut handed_off = false;
            let t = self.shard.stalls.start();
            {
                let mut path = self.shard.path.borrow_mut();
                let read_at_ns = path.clock().now_ns();
                round_ns = read_at_ns;
                while out.len() < self.shard.limits.output_bytes_max && frames < self.shard.limits.frames_per_round_max
                {
                    match wire::split_frame(&inbuf[consumed..filled], frame_bytes_max) {
                        Ok(Some((payload, used))) => {
                            frames += 1;
                            if let Some(wait_ns) = socket_wait_ns {
                                path.times_mut().record_ns(metrics::Stage::SocketWait, wait_ns);
                            }
                            if path.handle(payload, read_at_ns, id, peer, &mut out) == Handled::Pending {
                                mailbox.expect();
                                handed_off = true;
                            }
                            consumed += used;
                        }
                        Ok(None) => break,
                        Err(e) => {
                            path.reject_stream(&e, &mut out);
                            self.shard.report.borrow_mut().streams_rejected += 1;
                            broken = true;
                            break;
                        }
                    }
                }
            }
            if handed_off {
                self.shard.submitted.notify();
            }
            inbuf.copy_within(consumed..filled, 0);
            filled -= consumed;
            self.answer_returned(mailbox, &mut out);
            self.shard.stalls.end(StallTask::Connection, t);
            if !out.is_empty() {
                self.write_within(stream, &out).await?;
                out.clear();
            }
            // A partial frame's clock starts with the round that first held
            // it and keeps running until the frame is complete.
            frame_started_ns = match (filled, consumed) {
                (0, _) => None,
                (_, 0) => frame_started_ns.or(Some(round_ns)),
                _ => Some(round_ns),
            };
            if broken {
                return Ok(());
            }
            if consumed > 0 && wire::split_frame(&inbuf[..filled], frame_bytes_max).is_ok_and(|f| f.is_some()) {
                // More frames wait: let the shard's other work run first.
                futures_lite::future::yield_now().await;
                continue;
            }
            // Responses are written and no frame waits: shadows may run.
            if self.shard.path.borrow().shadows_pending() {
                self.shard.shadow_wanted.notify();
            }
            let closing = self.shard.shutdown.is_triggered();
            // Make room for the rest of a frame whose prefix we have seen.
            if filled == inbuf.len() {
                let grown = (inbuf.len() * 2).min(read_bytes_max);
                assert!(grown > inbuf.len(), "a complete frame always fits the buffer");
                inbuf.resize(grown, 0);
            }
            // Draining, the connection still reads what the client already
            // sent (it is in the socket at once) and answers it; it closes
            // when nothing more arrives within `QUEUED_WAIT`.
            let read = futures_lite::future::or(
                async {
                    Wake::Read(self.read(stream, &mut inbuf[filled..], stamps && reads.is_multiple_of(every)).await)
                },
                async {
                    futures_lite::future::or(
                        async {
                            if closing {
                                glommio::timer::sleep(QUEUED_WAIT).await;
                            } else {
                                self.shard.shutdown.wait().await;
                            }
                            Wake::Shutdown
                        },
                        futures_lite::future::or(
                            async {
                                mailbox.delivered().await;
                                Wake::Delivered
                            },
                            async {
                                let Some(started_ns) = frame_started_ns else {
                                    return std::future::pending().await;
                                };
                                let due_ns = started_ns + frame_timeout_ns;
                                glommio::timer::sleep(Duration::from_nanos(due_ns.saturating_sub(clock.now_ns())))
                                    .await;
                                Wake::FrameTimedOut
                            },
                        ),
                    )
                    .await
                },
            )
            .await;
            match read {
                // Responses the stage still owes are collected by `serve`.
                Wake::Shutdown if closing => return Ok(()),
                Wake::Shutdown => {}
                Wake::Delivered => {}
                Wake::Read(Ok((0, _))) => return Ok(()),
                Wake::FrameTimedOut => return Err(TimedOut::Frame.into()),
                Wake::Read(Ok((n, wait_ns))) => {
                    filled += n;
                    socket_wait_ns = wait_ns;
                    reads = reads.wrapping_add(1);
                }
                Wake::Read(Err(e)) => return Err(e),
            }
        }
    }
}
