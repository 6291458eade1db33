//! TLS on the scoring port: rustls's sans-IO server connection driven over
//! a shard's own glommio stream, so a TLS connection is served by the same
//! rounds as a plain one (read, answer every complete frame, one write).
//!
//! Ciphertext is handed to rustls only once the plaintext before it has
//! been read, so rustls's received-plaintext buffer (one record) never
//! overflows whatever a client pipelines, and nothing read from the socket
//! is ever dropped. `read` is cancel-safe like a plain socket read (the
//! connection races it against shutdown and deliveries): it only awaits the
//! socket's own read and writes nothing. Records rustls queues meanwhile (a
//! key update's answer) go out with the next `write_all`.
//!
//! The handshake's key exchange and signature run on the reactor: about
//! 360 µs of CPU once per connection (bench/tls_cost.sh), which bidders keep
//! open. So that a flood of new connections cannot take the reactor from
//! the requests it serves, each shard starts at most
//! `tls.handshakes_per_s_max` a second after a burst ([`HandshakeBudget`]);
//! over it, a new connection is closed before its handshake.

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::Duration;

use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;

use crate::request::admission::{Bucket, ClientLimit};

/// TLS on the scoring port: the configuration every shard shares, built
/// once at start-up, and the bound on one handshake.
#[derive(Clone)]
pub struct ListenerTls {
    pub config: Arc<rustls::ServerConfig>,
    pub handshake_timeout: Duration,
    /// Each shard's [`HandshakeBudget`].
    pub handshakes_per_s_max: u32,
    pub handshake_burst: u32,
}

/// A shard's budget of new handshakes: admission's token bucket, in a cell
/// (shard-local like everything on the reactor).
pub(super) struct HandshakeBudget(std::cell::Cell<Bucket>);

impl HandshakeBudget {
    /// `per_s` handshakes a second after a burst of `burst`, from `now_ns`.
    pub(super) fn new(per_s: u32, burst: u32, now_ns: u64) -> HandshakeBudget {
        let limit = ClientLimit { rate_per_s: f64::from(per_s), burst: f64::from(burst) };
        HandshakeBudget(std::cell::Cell::new(Bucket::new(limit, 1.0, now_ns)))
    }

    /// Whether a handshake may start at `now_ns`.
    pub(super) fn take(&self, now_ns: u64) -> bool {
        let mut bucket = self.0.get();
        let ok = bucket.take(now_ns);
        self.0.set(bucket);
        ok
    }
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls").field("handshake_timeout", &self.handshake_timeout).finish_non_exhaustive()
    }
}

/// Ciphertext read from the socket at once: one largest TLS record.
const CIPHER_IN_BYTES: usize = 16 * 1024 + 2048;

/// A TLS connection over a shard's stream.
pub(super) struct TlsStream {
    tcp: TcpStream,
    conn: rustls::ServerConnection,
    /// Ciphertext read and not yet given to rustls: `cipher_in[start..end]`.
    cipher_in: Box<[u8]>,
    start: usize,
    end: usize,
    /// Records rustls produced, on their way to the socket.
    cipher_out: Vec<u8>,
}

/// Names a client certificate may present, at most: its DNS and URI
/// subject alternative names beyond these are not matched against.
const PEER_NAMES_MAX: usize = 64;

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl TlsStream {
    /// The DNS and URI subject alternative names of the client certificate
    /// the handshake verified against `tls.client_ca_file`; none without one.
    pub(super) fn peer_names(&self) -> Vec<String> {
        let Some(cert) = self.conn.peer_certificates().and_then(|c| c.first()) else {
            return Vec::new();
        };
        let Ok(cert) = webpki::EndEntityCert::try_from(cert) else {
            return Vec::new();
        };
        cert.valid_dns_names().chain(cert.valid_uri_names()).take(PEER_NAMES_MAX).map(str::to_string).collect()
    }

    /// Completes the server side of a handshake on `tcp`. A failure has
    /// already sent its alert, when there was one to send.
    pub(super) async fn accept(tcp: TcpStream, config: Arc<rustls::ServerConfig>) -> io::Result<TlsStream> {
        let conn = rustls::ServerConnection::new(config).map_err(tls_error)?;
        let mut s = TlsStream {
            tcp,
            conn,
            cipher_in: vec![0u8; CIPHER_IN_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            cipher_out: Vec::with_capacity(CIPHER_IN_BYTES),
        };
        while s.conn.is_handshaking() {
            if s.conn.wants_write() {
                s.flush().await?;
                continue;
            }
            match s.feed() {
                Ok(true) => {}
                Ok(false) => {
                    if !s.fill().await? {
                        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed during the TLS handshake"));
                    }
                }
                Err(e) => {
                    // rustls queued the alert that tells the client why.
                    let _ = s.flush().await;
                    return Err(e);
                }
            }
        }
        // The server's last flight (and any session tickets).
        s.flush().await?;
        Ok(s)
    }

    /// The socket underneath, for its options and timeouts.
    pub(super) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Reads plaintext; 0 when the client closed (with or without
    /// `close_notify`).
    pub(super) async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.conn.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if !self.feed()? && !self.fill().await? {
                return Ok(0);
            }
        }
    }

    /// Encrypts and writes all of `buf`, and whatever rustls had queued.
    pub(super) async fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            // rustls takes what fits its bounded send buffer; flushing
            // empties it for the rest.
            at += self.conn.writer().write(&buf[at..])?;
            self.flush().await?;
        }
        self.flush().await
    }

    /// Gives buffered ciphertext to rustls, if the plaintext before it was
    /// read; false when there was none to give.
    fn feed(&mut self) -> io::Result<bool> {
        if self.start == self.end {
            return Ok(false);
        }
        let mut pending = &self.cipher_in[self.start..self.end];
        let used = self.conn.read_tls(&mut pending)?;
        if used == 0 {
            // rustls refused bytes it had room for: stop rather than spin.
            return Err(io::Error::new(io::ErrorKind::InvalidData, "TLS: records left unread"));
        }
        self.start += used;
        self.conn.process_new_packets().map_err(tls_error)?;
        Ok(true)
    }

    /// Reads ciphertext from the socket into the empty buffer; false at end
    /// of stream.
    async fn fill(&mut self) -> io::Result<bool> {
        debug_assert_eq!(self.start, self.end, "only an empty buffer is refilled");
        let n = self.tcp.read(&mut self.cipher_in).await?;
        self.start = 0;
        self.end = n;
        Ok(n > 0)
    }

    async fn flush(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            self.cipher_out.clear();
            self.conn.write_tls(&mut self.cipher_out)?;
            self.tcp.write_all(&self.cipher_out).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handshake_budget_allows_its_burst_then_its_rate() {
        let budget = HandshakeBudget::new(10, 3, 0);
        assert_eq!((0..10).filter(|_| budget.take(0)).count(), 3, "the burst");
        assert!(!budget.take(50_000_000), "half a token after 50 ms at 10/s");
        assert!(budget.take(100_000_000), "one token per 100 ms");
        assert!(!budget.take(100_000_000));
        assert_eq!((0..10).filter(|_| budget.take(10_000_000_000)).count(), 3, "refills to the burst, no more");
    }
}
