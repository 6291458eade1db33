//! The binary client: a sans-IO codec and a blocking `std::net` client on top.
//!
//! [`Codec`] turns requests into frames and frames into responses over plain
//! byte buffers, with no runtime, so any event loop can embed it. [`Client`]
//! drives it over one TCP connection (or TLS over it, for a server with
//! `[tls]`), pipelines many requests, and enforces its own timeout on every
//! call.

pub mod cluster;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::stream::Stream;
#[cfg(feature = "tls")]
use crate::tls::ClientTls;
use crate::wire::{self, FrameError, RequestEncoder, RequestSpec, Response};

#[derive(Debug)]
pub enum ClientError {
    Connect { addr: String, source: std::io::Error },
    Io(std::io::Error),
    Tls { addr: String, what: String },
    Timeout(Duration),
    Closed,
    ClosedMidFrame,
    Frame(FrameError),
    Invalid(flatbuffers::InvalidFlatbuffer),
    UnexpectedId(u64),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Connect { addr, source } => write!(f, "connecting to {addr}: {source}"),
            ClientError::Io(e) => write!(f, "i/o: {e}"),
            ClientError::Tls { addr, what } => write!(f, "TLS to {addr}: {what}"),
            ClientError::Timeout(t) => write!(f, "no response within {t:?}"),
            ClientError::Closed => f.write_str("the server closed the connection"),
            ClientError::ClosedMidFrame => {
                f.write_str("the server closed the connection in the middle of a response frame")
            }
            ClientError::Frame(e) => write!(f, "bad frame from the server: {e}"),
            ClientError::Invalid(e) => write!(f, "bad response from the server: {e}"),
            ClientError::UnexpectedId(id) => write!(f, "response for request {id}, which is not outstanding"),
        }
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClientError::Connect { source, .. } => Some(source),
            ClientError::Io(e) => Some(e),
            ClientError::Frame(e) => Some(e),
            ClientError::Invalid(e) => Some(e),
            _ => None,
        }
    }
}

impl From<std::io::Error> for ClientError {
    fn from(e: std::io::Error) -> ClientError {
        ClientError::Io(e)
    }
}

impl From<FrameError> for ClientError {
    fn from(e: FrameError) -> ClientError {
        ClientError::Frame(e)
    }
}

impl From<flatbuffers::InvalidFlatbuffer> for ClientError {
    fn from(e: flatbuffers::InvalidFlatbuffer) -> ClientError {
        ClientError::Invalid(e)
    }
}

/// Encodes requests and decodes responses; holds no socket.
pub struct Codec {
    encoder: RequestEncoder,
    /// Largest response frame accepted from the server.
    pub frame_bytes_max: usize,
    /// Most scores a response may carry.
    pub scores_max: usize,
}

impl Default for Codec {
    fn default() -> Self {
        Codec { encoder: RequestEncoder::new(), frame_bytes_max: 1 << 20, scores_max: 1 << 16 }
    }
}

impl Codec {
    pub fn encode(&mut self, spec: &RequestSpec, out: &mut Vec<u8>) {
        self.encoder.encode(spec, out);
    }

    /// Decodes the first response in `buf`; returns it with the bytes it
    /// used, or `None` when `buf` does not hold a whole frame yet.
    pub fn decode(&self, buf: &[u8]) -> Result<Option<(Response, usize)>, ClientError> {
        match wire::split_frame(buf, self.frame_bytes_max)? {
            None => Ok(None),
            Some((payload, used)) => Ok(Some((wire::decode_response(payload, self.scores_max)?, used))),
        }
    }
}

/// A blocking client over one connection.
pub struct Client {
    stream: Stream,
    codec: Codec,
    rbuf: Vec<u8>,
    rfilled: usize,
    wbuf: Vec<u8>,
    timeout: Duration,
}

impl Client {
    /// Connects with `timeout` for the connection and for every later call.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Client, ClientError> {
        Client::open(addr, timeout, |stream| Ok(Stream::Plain(stream)))
    }

    /// [`Client::connect`], through TLS when `tls` is given; the handshake
    /// completes here, within `timeout`, so a certificate problem is a
    /// connect error.
    #[cfg(feature = "tls")]
    pub fn connect_with(addr: &str, timeout: Duration, tls: Option<&ClientTls>) -> Result<Client, ClientError> {
        let Some(tls) = tls else {
            return Client::connect(addr, timeout);
        };
        Client::open(addr, timeout, |stream| {
            let err = |source| ClientError::Connect { addr: addr.into(), source };
            stream.set_read_timeout(Some(timeout)).map_err(err)?;
            stream.set_write_timeout(Some(timeout)).map_err(err)?;
            crate::tls::connect(stream, addr, tls).map_err(|what| ClientError::Tls { addr: addr.into(), what })
        })
    }

    /// Connects to the first of `addr`'s addresses that answers within
    /// `timeout`, and wraps the socket with `wrap` (plain, or TLS).
    fn open(
        addr: &str,
        timeout: Duration,
        wrap: impl Fn(TcpStream) -> Result<Stream, ClientError>,
    ) -> Result<Client, ClientError> {
        let err = |source| ClientError::Connect { addr: addr.into(), source };
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(err)?.collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        for a in addrs {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(stream) => {
                    stream.set_nodelay(true).map_err(err)?;
                    return Ok(Client {
                        stream: wrap(stream)?,
                        codec: Codec::default(),
                        rbuf: vec![0; 64 * 1024],
                        rfilled: 0,
                        wbuf: Vec::with_capacity(64 * 1024),
                        timeout,
                    });
                }
                Err(e) => last = e,
            }
        }
        Err(err(last))
    }

    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The socket (under TLS, if any), for tests that need to misbehave on
    /// purpose.
    pub fn stream(&mut self) -> &mut TcpStream {
        self.stream.tcp_mut()
    }

    /// Sends one request without waiting for its response.
    pub fn send(&mut self, spec: &RequestSpec) -> Result<(), ClientError> {
        self.wbuf.clear();
        self.codec.encode(spec, &mut self.wbuf);
        self.stream.tcp().set_write_timeout(Some(self.timeout))?;
        self.stream.write_all(&self.wbuf).map_err(|e| self.timeout_or(e))?;
        Ok(())
    }

    /// Sends raw bytes: for tests of malformed input.
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.stream.tcp().set_write_timeout(Some(self.timeout))?;
        self.stream.write_all(bytes).map_err(|e| self.timeout_or(e))?;
        Ok(())
    }

    fn timeout_or(&self, e: std::io::Error) -> ClientError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ClientError::Timeout(self.timeout),
            _ => ClientError::Io(e),
        }
    }

    /// Waits for the next response, whichever request it answers.
    pub fn recv(&mut self) -> Result<Response, ClientError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some((resp, used)) = self.codec.decode(&self.rbuf[..self.rfilled])? {
                self.rbuf.copy_within(used..self.rfilled, 0);
                self.rfilled -= used;
                return Ok(resp);
            }
            if self.rfilled == self.rbuf.len() {
                let grown = (self.rbuf.len() * 2).min(self.codec.frame_bytes_max + wire::FRAME_PREFIX_BYTES);
                self.rbuf.resize(grown.max(self.rbuf.len() + 1), 0);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ClientError::Timeout(self.timeout));
            }
            self.stream.tcp().set_read_timeout(Some(left))?;
            match self.stream.read(&mut self.rbuf[self.rfilled..]) {
                Ok(0) if self.rfilled > 0 => return Err(ClientError::ClosedMidFrame),
                Ok(0) => return Err(ClientError::Closed),
                Ok(n) => self.rfilled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.timeout_or(e)),
            }
        }
    }

    /// Sends one request and waits for its response.
    pub fn score(&mut self, spec: &RequestSpec) -> Result<Response, ClientError> {
        self.send(spec)?;
        let resp = self.recv()?;
        if resp.request_id != spec.request_id {
            return Err(ClientError::UnexpectedId(resp.request_id));
        }
        Ok(resp)
    }

    /// Sends all `specs` on this connection with up to `window` outstanding
    /// and returns their responses in request order. Request ids must be
    /// distinct; responses may arrive in any order.
    pub fn pipeline(&mut self, specs: &[RequestSpec], window: usize) -> Result<Vec<Response>, ClientError> {
        let window = window.max(1);
        let index: std::collections::HashMap<u64, usize> =
            specs.iter().enumerate().map(|(i, s)| (s.request_id, i)).collect();
        assert_eq!(index.len(), specs.len(), "request ids must be distinct");
        let mut out: Vec<Option<Response>> = vec![None; specs.len()];
        let (mut sent, mut received) = (0, 0);
        while received < specs.len() {
            while sent < specs.len() && sent - received < window {
                self.send(&specs[sent])?;
                sent += 1;
            }
            let resp = self.recv()?;
            let i = *index.get(&resp.request_id).ok_or(ClientError::UnexpectedId(resp.request_id))?;
            if out[i].is_some() {
                return Err(ClientError::UnexpectedId(resp.request_id));
            }
            out[i] = Some(resp);
            received += 1;
        }
        Ok(out.into_iter().map(|r| r.expect("every slot filled")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Reason, ResponseEncoder, ResponseFields, Status, Tier};

    #[test]
    fn codec_decodes_byte_by_byte() {
        let mut bytes = Vec::new();
        let mut enc = ResponseEncoder::new(4);
        let scores = [0.5f32; 3];
        for id in 0..3 {
            enc.encode(
                &ResponseFields {
                    request_id: id,
                    status: Status::Ok,
                    scores: &scores,
                    tier: Tier::Primary,
                    model_version: 1,
                    server_us: 5,
                    features_missing: 0,
                    error: "",
                    reason: Reason::None,
                    features_stale: false,
                    explain: crate::wire::ExplainFields::NONE,
                },
                &mut bytes,
            );
        }
        let codec = Codec::default();
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for b in bytes {
            buf.push(b);
            if let Some((resp, used)) = codec.decode(&buf).unwrap() {
                buf.drain(..used);
                got.push(resp.request_id);
            }
        }
        assert_eq!(got, vec![0, 1, 2]);
        assert!(buf.is_empty());
    }

    #[test]
    fn codec_rejects_an_oversized_frame() {
        let codec = Codec { frame_bytes_max: 16, ..Codec::default() };
        assert!(matches!(codec.decode(&[17, 0, 0, 0]), Err(ClientError::Frame(FrameError::TooLarge { .. }))));
    }
}
