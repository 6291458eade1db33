//! A blocking Redis connection speaking RESP2 over one TCP stream.
//!
//! Redis is the source of truth for features: writers publish through this connection and the
//! replica refresher consumes the change streams through it. It is deliberately small (one
//! command or one pipeline at a time, no pooling, no async) and every wait is bounded by the
//! configured connect and I/O timeouts, so a stuck or unreachable Redis surfaces as a typed
//! error instead of a hang. This is the only module that sees `redis_protocol` types; callers
//! get [`Reply`].

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use redis_protocol::resp2::decode::decode;
use redis_protocol::resp2::encode::encode_borrowed;
use redis_protocol::resp2::types::{BorrowedFrame, OwnedFrame};
use serde::Deserialize;

use crate::tls::{self, ClientTls, Stream};

/// The largest reply accepted. A longer reply (or a length prefix announcing one) is a protocol
/// error: far beyond any sane feature read, and it keeps a confused or hostile peer from making
/// us allocate without limit.
pub const REPLY_BYTES_MAX: usize = 512 << 20;

/// Arrays nested deeper than this are refused. Redis replies nest a handful of levels at most
/// (XREAD: streams, entries, fields); the bound keeps the decoder's recursion shallow.
const REPLY_DEPTH_MAX: usize = 32;

/// How much the read buffer grows by at least, and what it shrinks back to after a big reply.
const READ_CHUNK_BYTES: usize = 64 << 10;

/// A buffer that grew past this for one big reply is released once that reply is consumed, so a
/// long-lived connection does not pin its largest reply's memory.
const READ_BUFFER_KEEP_BYTES: usize = 4 << 20;

/// Where Redis lives and how long to wait for it. Deserializable so it can sit in a config file.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `host:port` (IPv6 as `[addr]:port`).
    pub addr: String,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// The logical database (`SELECT`); 0 needs no command.
    #[serde(default)]
    pub db: u32,
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Bound on each read and write; 0 means wait forever.
    #[serde(default = "default_io_timeout_ms")]
    pub io_timeout_ms: u64,
    /// TLS (`rediss://`); `None` is plain TCP.
    #[serde(default)]
    pub tls: Option<ClientTls>,
}

fn default_connect_timeout_ms() -> u64 {
    500
}

fn default_io_timeout_ms() -> u64 {
    2000
}

/// A `redis://` URL that cannot be used. The message never repeats a password.
#[derive(Debug, thiserror::Error)]
#[error("Redis URL '{url}': {what} (expected redis://[user:password@]host:port[/db])")]
pub struct UrlError {
    /// The URL with any password replaced by `***`.
    pub url: String,
    pub what: String,
}

impl fmt::Debug for RedisConfig {
    // Hand-written so that logging a config never leaks the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("addr", &self.addr)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("io_timeout_ms", &self.io_timeout_ms)
            .field("tls", &self.tls)
            .finish()
    }
}

impl RedisConfig {
    /// `addr` with no credentials, database 0 and the default timeouts.
    pub fn new(addr: impl Into<String>) -> RedisConfig {
        RedisConfig {
            addr: addr.into(),
            username: None,
            password: None,
            db: 0,
            connect_timeout_ms: default_connect_timeout_ms(),
            io_timeout_ms: default_io_timeout_ms(),
            tls: None,
        }
    }

    /// Parses `redis://[user:password@]host[:port][/db]`; the port defaults to 6379. User and
    /// password may be percent-encoded (a password holding `@` or `/` must be). `rediss://` is
    /// TLS, with optional `?ca=FILE&cert=FILE&key=FILE&sni=NAME` (see [`ClientTls`]).
    pub fn from_url(url: &str) -> Result<RedisConfig, UrlError> {
        let bad = |what: &str| UrlError { url: redact_url(url), what: what.into() };
        let (tls, rest) = match url.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("redis") => (false, rest),
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("rediss") => (true, rest),
            _ => return Err(bad("the scheme must be redis:// or rediss://")),
        };
        if rest.contains('#') {
            return Err(bad("fragments are not supported"));
        }
        let (rest, query) = rest.split_once('?').map_or((rest, None), |(r, q)| (r, Some(q)));
        let tls = match (tls, query) {
            (false, Some(_)) => return Err(bad("query strings are only for rediss:// (TLS options)")),
            (false, None) => None,
            (true, query) => {
                let mut t = ClientTls::default();
                for kv in query.unwrap_or("").split('&').filter(|kv| !kv.is_empty()) {
                    let (k, v) = kv.split_once('=').ok_or_else(|| bad(&format!("'{kv}' is not key=value")))?;
                    let v = percent_decode(v).ok_or_else(|| bad(&format!("bad percent-encoding in '{k}'")))?;
                    match k {
                        "ca" => t.ca_file = Some(v.into()),
                        "cert" => t.cert_file = Some(v.into()),
                        "key" => t.key_file = Some(v.into()),
                        "sni" => t.server_name = Some(v),
                        _ => return Err(bad(&format!("unknown TLS option '{k}' (ca, cert, key, sni)"))),
                    }
                }
                if t.cert_file.is_some() != t.key_file.is_some() {
                    return Err(bad("a client certificate needs both cert= and key="));
                }
                Some(t)
            }
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let mut config = RedisConfig::new(String::new());
        if let Some(userinfo) = userinfo {
            let Some((user, password)) = userinfo.split_once(':') else {
                return Err(bad("credentials must be user:password or :password"));
            };
            let user = percent_decode(user).ok_or_else(|| bad("bad percent-encoding in the user name"))?;
            let password = percent_decode(password).ok_or_else(|| bad("bad percent-encoding in the password"))?;
            if password.is_empty() {
                return Err(bad("empty password"));
            }
            config.username = (!user.is_empty()).then_some(user);
            config.password = Some(password);
        }
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let Some((inner, after)) = v6.split_once(']') else {
                return Err(bad("unclosed '[' in the host"));
            };
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| bad("junk after the IPv6 host"))?),
            };
            (format!("[{inner}]"), port)
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (hostport.to_string(), None),
            }
        };
        if host.is_empty() || host == "[]" {
            return Err(bad("no host"));
        }
        let port: u16 = match port {
            None => 6379,
            Some(p) => match p.parse() {
                Ok(p) if p != 0 => p,
                _ => return Err(bad(&format!("'{p}' is not a port"))),
            },
        };
        config.addr = format!("{host}:{port}");
        config.tls = tls;
        config.db = match path {
            "" => 0,
            p => p.parse().map_err(|_| bad(&format!("'{p}' is not a database index")))?,
        };
        Ok(config)
    }
}

/// `url` with the password of its credentials, if any, replaced by `***`.
pub(super) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    match rest[..at].split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url.to_string(),
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// One Redis reply, decoupled from the wire library's frame types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Simple(Vec<u8>),
    Error(String),
    Int(i64),
    Bulk(Vec<u8>),
    Nil,
    Array(Vec<Reply>),
}

impl Reply {
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The payload of a bulk or simple string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Reply::Bulk(b) | Reply::Simple(b) => Some(b),
            _ => None,
        }
    }

    pub fn into_bytes(self) -> Option<Vec<u8>> {
        match self {
            Reply::Bulk(b) | Reply::Simple(b) => Some(b),
            _ => None,
        }
    }

    pub fn into_array(self) -> Option<Vec<Reply>> {
        match self {
            Reply::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, Reply::Nil)
    }
}

impl From<OwnedFrame> for Reply {
    fn from(frame: OwnedFrame) -> Reply {
        match frame {
            OwnedFrame::SimpleString(s) => Reply::Simple(s),
            OwnedFrame::Error(e) => Reply::Error(e),
            OwnedFrame::Integer(i) => Reply::Int(i),
            OwnedFrame::BulkString(b) => Reply::Bulk(b),
            OwnedFrame::Array(a) => Reply::Array(a.into_iter().map(Reply::from).collect()),
            OwnedFrame::Null => Reply::Nil,
        }
    }
}

/// Why a Redis call failed. Every variant names the server address, so a one-line report of
/// the error says which Redis was at fault.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis {addr}: {source}")]
    Io {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("redis {addr}: {what} timed out after {timeout_ms} ms")]
    Timeout { addr: String, what: &'static str, timeout_ms: u64 },
    #[error("redis {addr}: malformed reply: {what}")]
    Protocol { addr: String, what: String },
    #[error("redis {addr}: {message}")]
    Server { addr: String, message: String },
    #[error("redis {addr}: authentication failed: {message}")]
    Auth { addr: String, message: String },
    #[error("redis {addr}: connection closed by the server")]
    Closed { addr: String },
    #[error("redis {addr}: TLS: {what}")]
    Tls { addr: String, what: String },
    /// An earlier I/O or protocol failure left the stream at an unknown point of a reply; the
    /// caller must reconnect.
    #[error("redis {addr}: connection unusable after an earlier failure; reconnect")]
    Broken { addr: String },
}

/// A blocking connection to one Redis server.
pub struct RedisConn {
    stream: Stream,
    addr: String,
    reader: ReplyReader,
    out: Vec<u8>,
    read_timeout_ms: u64,
    write_timeout_ms: u64,
    broken: bool,
}

impl RedisConn {
    /// Connects within `connect_timeout_ms`, authenticates and selects the database.
    pub fn connect(config: &RedisConfig) -> Result<RedisConn, RedisError> {
        let addr = config.addr.clone();
        let io_err = |source| RedisError::Io { addr: addr.clone(), source };
        let targets: Vec<_> = config.addr.to_socket_addrs().map_err(io_err)?.collect();
        let connect_timeout = Duration::from_millis(config.connect_timeout_ms.max(1));
        let mut last_err = io::Error::new(io::ErrorKind::NotFound, "the address resolves to nothing");
        let mut stream = None;
        for target in &targets {
            match TcpStream::connect_timeout(target, connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last_err = e,
            }
        }
        let stream = match stream {
            Some(s) => s,
            None if is_timeout(&last_err) => {
                return Err(RedisError::Timeout { addr, what: "connect", timeout_ms: config.connect_timeout_ms })
            }
            None => return Err(io_err(last_err)),
        };
        stream.set_nodelay(true).map_err(io_err)?;
        // The handshake is bounded like any read or write.
        stream.set_read_timeout(timeout(config.io_timeout_ms)).map_err(io_err)?;
        stream.set_write_timeout(timeout(config.io_timeout_ms)).map_err(io_err)?;
        let stream = match &config.tls {
            None => Stream::Plain(stream),
            Some(tls) => {
                tls::connect(stream, &addr, tls).map_err(|what| RedisError::Tls { addr: addr.clone(), what })?
            }
        };
        let mut conn = RedisConn {
            stream,
            addr: addr.clone(),
            reader: ReplyReader::new(REPLY_BYTES_MAX),
            out: Vec::new(),
            read_timeout_ms: 0,
            write_timeout_ms: 0,
            broken: false,
        };
        conn.set_read_timeout_ms(config.io_timeout_ms)?;
        conn.write_timeout_ms = config.io_timeout_ms;
        conn.stream.tcp().set_write_timeout(timeout(config.io_timeout_ms)).map_err(io_err)?;

        // Without a password, a PING still proves the server will take our commands: a server
        // that wants one answers NOAUTH, and that is better reported at connect than later.
        let (hello, is_auth): (Vec<&[u8]>, bool) = match (&config.username, &config.password) {
            (Some(user), Some(password)) => (vec![b"AUTH", user.as_bytes(), password.as_bytes()], true),
            (None, Some(password)) => (vec![b"AUTH", password.as_bytes()], true),
            (_, None) => (vec![b"PING"], false),
        };
        match conn.command(&hello) {
            Ok(_) => {}
            // Other refusals of PING (LOADING while a restarted server reads its data) are not
            // about credentials and stay server errors.
            Err(RedisError::Server { addr, message }) if is_auth || message.starts_with("NOAUTH") => {
                return Err(RedisError::Auth { addr, message })
            }
            Err(e) => return Err(e),
        }
        if config.db != 0 {
            conn.command(&[b"SELECT", config.db.to_string().as_bytes()])?;
        }
        Ok(conn)
    }

    /// The `host:port` this connection was opened to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sets the bound on each read; 0 waits forever. A blocking command (`XREAD BLOCK`) needs
    /// a bound longer than its own block time, or every idle wait reads as a timeout.
    pub fn set_read_timeout_ms(&mut self, ms: u64) -> Result<(), RedisError> {
        self.stream
            .tcp()
            .set_read_timeout(timeout(ms))
            .map_err(|source| RedisError::Io { addr: self.addr.clone(), source })?;
        self.read_timeout_ms = ms;
        Ok(())
    }

    /// Sends one command and reads its reply. An error reply is `Err(RedisError::Server)`.
    pub fn command(&mut self, args: &[&[u8]]) -> Result<Reply, RedisError> {
        self.check_usable()?;
        self.out.clear();
        encode_command(&mut self.out, args);
        self.send()?;
        match self.receive()? {
            Reply::Error(message) => Err(RedisError::Server { addr: self.addr.clone(), message }),
            reply => Ok(reply),
        }
    }

    /// Sends all commands in one write, then reads one reply per command. An error reply stays
    /// in its command's place as [`Reply::Error`]; only transport failures fail the whole call.
    pub fn pipeline(&mut self, cmds: &[Vec<Vec<u8>>]) -> Result<Vec<Reply>, RedisError> {
        self.check_usable()?;
        self.out.clear();
        for cmd in cmds {
            let args: Vec<&[u8]> = cmd.iter().map(Vec::as_slice).collect();
            encode_command(&mut self.out, &args);
        }
        self.send()?;
        let mut replies = Vec::with_capacity(cmds.len());
        for _ in cmds {
            replies.push(self.receive()?);
        }
        Ok(replies)
    }

    fn check_usable(&self) -> Result<(), RedisError> {
        if self.broken {
            return Err(RedisError::Broken { addr: self.addr.clone() });
        }
        Ok(())
    }

    fn send(&mut self) -> Result<(), RedisError> {
        let result = self.stream.write_all(&self.out);
        if self.out.capacity() > READ_BUFFER_KEEP_BYTES {
            self.out = Vec::new();
        }
        result.map_err(|e| {
            self.broken = true;
            io_failure(&self.addr, "write", self.write_timeout_ms, e)
        })
    }

    fn receive(&mut self) -> Result<Reply, RedisError> {
        self.reader.read_reply(&mut self.stream).map_err(|failure| {
            self.broken = true;
            let addr = self.addr.clone();
            match failure {
                ReadFailure::Io(e) => io_failure(&addr, "read", self.read_timeout_ms, e),
                ReadFailure::Protocol(what) => RedisError::Protocol { addr, what },
                ReadFailure::Closed => RedisError::Closed { addr },
            }
        })
    }
}

fn timeout(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

fn io_failure(addr: &str, what: &'static str, timeout_ms: u64, e: io::Error) -> RedisError {
    let addr = addr.to_string();
    match e.kind() {
        _ if is_timeout(&e) => RedisError::Timeout { addr, what, timeout_ms },
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
            RedisError::Closed { addr }
        }
        _ => RedisError::Io { addr, source: e },
    }
}

/// Appends `args` to `out` as a RESP array of bulk strings (the form Redis expects commands in).
fn encode_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    let parts: Vec<BorrowedFrame<'_>> = args.iter().map(|a| BorrowedFrame::BulkString(a)).collect();
    let frame = BorrowedFrame::Array(&parts);
    let offset = out.len();
    out.resize(offset + frame.encode_len(false), 0);
    let written = encode_borrowed(&mut out[offset..], &frame, false)
        .expect("the buffer was sized by encode_len for this very frame");
    out.truncate(offset + written);
}

/// Every reply in `bytes`, read as the connection reads them (the framing
/// scan, then the decoder) with the bytes arriving `chunk_bytes` at a time;
/// what is left after the last whole reply must be empty. For fuzzing and
/// tests: replies are untrusted input, and this is their one parser.
pub fn decode_all(bytes: &[u8], reply_bytes_max: usize, chunk_bytes: usize) -> Result<Vec<Reply>, String> {
    struct Chunks<'a>(&'a [u8], usize);
    impl Read for Chunks<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = self.0.len().min(self.1).min(out.len());
            out[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }
    let mut src = Chunks(bytes, chunk_bytes.max(1));
    let mut reader = ReplyReader::new(reply_bytes_max);
    let mut replies = Vec::new();
    loop {
        match reader.read_reply(&mut src) {
            Ok(reply) => replies.push(reply),
            Err(ReadFailure::Closed) if reader.start == reader.end => return Ok(replies),
            Err(ReadFailure::Closed) => return Err("the bytes end inside a reply".into()),
            Err(ReadFailure::Protocol(what)) => return Err(what),
            Err(ReadFailure::Io(e)) => return Err(e.to_string()),
        }
    }
}

/// A failure while reading a reply, before it is tied to an address.
#[derive(Debug)]
enum ReadFailure {
    Io(io::Error),
    Protocol(String),
    Closed,
}

/// Reads replies from a byte source into a growable buffer.
///
/// `redis_protocol`'s decoder keeps no state across a partial frame, so calling it after every
/// read would re-parse a large reply once per read. Instead a small resumable [`FrameScan`]
/// finds where the frame ends (and checks its size bounds) as bytes arrive, and the decoder runs
/// once per complete frame. Separate from the socket so framing is testable with any `Read`.
struct ReplyReader {
    buf: Vec<u8>,
    /// Unconsumed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    scan: FrameScan,
    reply_bytes_max: usize,
}

impl ReplyReader {
    fn new(reply_bytes_max: usize) -> ReplyReader {
        ReplyReader { buf: Vec::new(), start: 0, end: 0, scan: FrameScan::new(), reply_bytes_max }
    }

    fn read_reply<R: Read>(&mut self, src: &mut R) -> Result<Reply, ReadFailure> {
        loop {
            if let Some(len) = self.scan.advance(&self.buf[self.start..self.end], self.reply_bytes_max)? {
                let frame_bytes = &self.buf[self.start..self.start + len];
                let reply = match decode(frame_bytes) {
                    Ok(Some((frame, used))) if used == len => Reply::from(frame),
                    Ok(_) => return Err(ReadFailure::Protocol("frame length disagrees with the decoder".into())),
                    Err(e) => return Err(ReadFailure::Protocol(e.details().to_string())),
                };
                self.start += len;
                self.scan = FrameScan::new();
                if self.start == self.end {
                    self.start = 0;
                    self.end = 0;
                    if self.buf.len() > READ_BUFFER_KEEP_BYTES {
                        self.buf = Vec::new();
                    }
                }
                return Ok(reply);
            }
            self.fill(src)?;
        }
    }

    /// Reads at least one more byte of the frame in progress.
    fn fill<R: Read>(&mut self, src: &mut R) -> Result<(), ReadFailure> {
        // Everything buffered belongs to the incomplete frame, so this bounds its size even
        // when no length prefix gave it away (a simple string with no line end).
        if self.end - self.start >= self.reply_bytes_max {
            return Err(ReadFailure::Protocol(format!("reply exceeds {} bytes", self.reply_bytes_max)));
        }
        if self.end == self.buf.len() {
            if self.start > 0 {
                // The scan's offsets are relative to `start`, so moving the bytes keeps them valid.
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.end == self.buf.len() {
                let grown = (self.buf.len() * 2).max(READ_CHUNK_BYTES).min(self.reply_bytes_max + READ_CHUNK_BYTES);
                self.buf.resize(grown, 0);
            }
        }
        loop {
            match src.read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(ReadFailure::Closed),
                Ok(n) => {
                    self.end += n;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ReadFailure::Io(e)),
            }
        }
    }
}

/// Finds the end of one RESP2 frame, resuming where the previous call stopped.
struct FrameScan {
    /// Bytes of the frame accounted for so far.
    pos: usize,
    /// For each open array, the elements still to come; the outermost entry is the frame itself.
    open: Vec<u64>,
}

impl FrameScan {
    fn new() -> FrameScan {
        FrameScan { pos: 0, open: vec![1] }
    }

    /// `Some(length)` once `buf` holds the whole frame; `None` while more bytes are needed.
    fn advance(&mut self, buf: &[u8], bytes_max: usize) -> Result<Option<usize>, ReadFailure> {
        let protocol = |what: String| Err(ReadFailure::Protocol(what));
        while let Some(&left) = self.open.last() {
            if left == 0 {
                self.open.pop();
                continue;
            }
            let rest = &buf[self.pos..];
            let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
                return Ok(None);
            };
            if eol == 0 {
                return protocol("empty line where a reply was expected".into());
            }
            let header_len = eol + 2;
            let body = &rest[1..eol];
            let mut consumed = header_len;
            match rest[0] {
                b'+' | b'-' => {}
                b':' => {
                    if parse_int(body).is_none() {
                        return protocol(format!("bad integer {:?}", String::from_utf8_lossy(body)));
                    }
                }
                b'$' => match parse_int(body) {
                    Some(-1) => {}
                    Some(n) if n >= 0 => {
                        let n = n as usize;
                        if n > bytes_max {
                            return protocol(format!("bulk string of {n} bytes exceeds {bytes_max}"));
                        }
                        consumed = header_len + n + 2;
                        if rest.len() < consumed {
                            return Ok(None);
                        }
                        if &rest[header_len + n..consumed] != b"\r\n" {
                            return protocol("bulk string not followed by CRLF".into());
                        }
                    }
                    _ => return protocol(format!("bad bulk length {:?}", String::from_utf8_lossy(body))),
                },
                b'*' => match parse_int(body) {
                    Some(-1) => {}
                    Some(n) if n >= 0 => {
                        // Every element takes at least 3 bytes, so a count past this is a lie.
                        if n as usize > bytes_max / 3 {
                            return protocol(format!("array of {n} elements exceeds the reply bound"));
                        }
                        if self.open.len() >= REPLY_DEPTH_MAX {
                            return protocol(format!("arrays nested deeper than {REPLY_DEPTH_MAX}"));
                        }
                        self.pos += header_len;
                        if let Some(top) = self.open.last_mut() {
                            *top -= 1;
                        }
                        self.open.push(n as u64);
                        continue;
                    }
                    _ => return protocol(format!("bad array length {:?}", String::from_utf8_lossy(body))),
                },
                other => return protocol(format!("unknown reply type byte 0x{other:02x}")),
            }
            self.pos += consumed;
            if self.pos > bytes_max {
                return protocol(format!("reply exceeds {bytes_max} bytes"));
            }
            if let Some(top) = self.open.last_mut() {
                *top -= 1;
            }
        }
        Ok(Some(self.pos))
    }
}

fn parse_int(digits: &[u8]) -> Option<i64> {
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Yields its bytes in the given chunk sizes, then end of stream.
    struct Chunked {
        data: Vec<u8>,
        cuts: Vec<usize>,
        pos: usize,
    }

    impl Read for Chunked {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let next_cut = self.cuts.iter().copied().find(|&c| c > self.pos).unwrap_or(self.data.len());
            let n = (next_cut - self.pos).min(out.len());
            out[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    fn read_all(data: &[u8], cuts: Vec<usize>, count: usize) -> Result<Vec<Reply>, ReadFailure> {
        let mut src = Chunked { data: data.to_vec(), cuts, pos: 0 };
        let mut reader = ReplyReader::new(1 << 20);
        (0..count).map(|_| reader.read_reply(&mut src)).collect()
    }

    fn sample() -> (Vec<u8>, Vec<Reply>) {
        let wire = b"+OK\r\n-ERR bad thing\r\n:-42\r\n$5\r\nhe\r\no\r\n$-1\r\n$0\r\n\r\n*-1\r\n*0\r\n\
*3\r\n*2\r\n$1\r\na\r\n:7\r\n*1\r\n*1\r\n$-1\r\n+x\r\n"
            .to_vec();
        let replies = vec![
            Reply::Simple(b"OK".to_vec()),
            Reply::Error("ERR bad thing".into()),
            Reply::Int(-42),
            Reply::Bulk(b"he\r\no".to_vec()),
            Reply::Nil,
            Reply::Bulk(Vec::new()),
            Reply::Nil,
            Reply::Array(Vec::new()),
            Reply::Array(vec![
                Reply::Array(vec![Reply::Bulk(b"a".to_vec()), Reply::Int(7)]),
                Reply::Array(vec![Reply::Array(vec![Reply::Nil])]),
                Reply::Simple(b"x".to_vec()),
            ]),
        ];
        (wire, replies)
    }

    #[test]
    fn replies_split_at_every_offset_decode_the_same() {
        let (wire, expected) = sample();
        for cut in 0..=wire.len() {
            let got = read_all(&wire, vec![cut], expected.len()).unwrap();
            assert_eq!(got, expected, "split at byte {cut}");
        }
        let one_byte_reads: Vec<usize> = (1..wire.len()).collect();
        assert_eq!(read_all(&wire, one_byte_reads, expected.len()).unwrap(), expected);
    }

    #[test]
    fn a_large_bulk_string_crosses_many_reads_and_buffer_growth() {
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut wire = format!("${}\r\n", payload.len()).into_bytes();
        wire.extend_from_slice(&payload);
        wire.extend_from_slice(b"\r\n:1\r\n");
        let cuts = (1..wire.len()).step_by(7_001).collect();
        let got = read_all(&wire, cuts, 2).unwrap();
        assert_eq!(got, vec![Reply::Bulk(payload), Reply::Int(1)]);
    }

    #[test]
    fn a_truncated_reply_is_closed_not_a_hang() {
        assert!(matches!(read_all(b"$10\r\nabc", vec![], 1), Err(ReadFailure::Closed)));
        assert!(matches!(read_all(b"", vec![], 1), Err(ReadFailure::Closed)));
    }

    #[test]
    fn malformed_and_oversized_replies_are_protocol_errors() {
        for bad in [&b"?what\r\n"[..], b"$abc\r\n", b"$-2\r\n", b":1.5\r\n", b"$3\r\nabcde\r\n", b"*x\r\n", b"\r\n"] {
            assert!(
                matches!(read_all(bad, vec![], 1), Err(ReadFailure::Protocol(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Announced sizes past the bound fail before anything is read or allocated.
        assert!(matches!(read_all(b"$2000000\r\n", vec![], 1), Err(ReadFailure::Protocol(_))));
        assert!(matches!(read_all(b"*2000000\r\n", vec![], 1), Err(ReadFailure::Protocol(_))));
        // A line with no end is bounded too.
        let endless = vec![b'+'; (1 << 20) + 10];
        assert!(matches!(read_all(&endless, vec![], 1), Err(ReadFailure::Protocol(_))));
        let deep = "*1\r\n".repeat(REPLY_DEPTH_MAX + 1) + ":1\r\n";
        assert!(matches!(read_all(deep.as_bytes(), vec![], 1), Err(ReadFailure::Protocol(_))));
    }

    #[test]
    fn commands_encode_as_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        encode_command(&mut out, &[b"SET", b"k", b"a\r\nb"]);
        encode_command(&mut out, &[b"PING"]);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n*1\r\n$4\r\nPING\r\n");
    }

    #[test]
    fn urls_parse_and_bad_ones_are_typed_errors() {
        let c = RedisConfig::from_url("redis://127.0.0.1:6380").unwrap();
        assert_eq!((c.addr.as_str(), c.db, c.username, c.password), ("127.0.0.1:6380", 0, None, None));
        let c = RedisConfig::from_url("redis://:s%40cret@localhost:7000/3").unwrap();
        assert_eq!((c.addr.as_str(), c.db, c.password.as_deref()), ("localhost:7000", 3, Some("s@cret")));
        let c = RedisConfig::from_url("redis://alice:pw@[::1]/2").unwrap();
        assert_eq!((c.addr.as_str(), c.db, c.username.as_deref()), ("[::1]:6379", 2, Some("alice")));
        assert_eq!(RedisConfig::from_url("REDIS://h").unwrap().addr, "h:6379");
        let c = RedisConfig::from_url("rediss://:pw@h:6380/1?ca=/etc/ca%20file.pem&sni=r.example").unwrap();
        let tls = c.tls.unwrap();
        assert_eq!((c.addr.as_str(), c.db), ("h:6380", 1));
        assert_eq!(tls.ca_file.as_deref(), Some(std::path::Path::new("/etc/ca file.pem")));
        assert_eq!((tls.server_name.as_deref(), tls.cert_file), (Some("r.example"), None));
        assert_eq!(RedisConfig::from_url("rediss://h").unwrap().tls, Some(ClientTls::default()));
        assert_eq!(RedisConfig::from_url("redis://h").unwrap().tls, None);

        for bad in [
            "http://h:1",
            "rediss://h:1?verify=no",
            "rediss://h:1?key=k.pem",
            "redis://h:1?ca=x",
            "redis://",
            "redis://h:port",
            "redis://h:0",
            "redis://h:1/x",
            "redis://h:1?db=2",
            "redis://user@h:1",
            "redis://[::1:1",
            "h:6379",
        ] {
            assert!(RedisConfig::from_url(bad).is_err(), "{bad}");
        }
        let e = RedisConfig::from_url("redis://u:topsecret@h:1/zz").unwrap_err();
        assert!(!e.to_string().contains("topsecret"), "{e}");
        assert!(e.to_string().contains("'zz' is not a database index"), "{e}");
    }

    #[test]
    fn debug_hides_the_password() {
        let c = RedisConfig::from_url("redis://u:topsecret@h:1").unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("topsecret") && shown.contains("***"), "{shown}");
    }

    #[test]
    fn config_deserializes_with_defaults() {
        let c: RedisConfig = toml::from_str("addr = \"h:1\"").unwrap();
        assert_eq!((c.db, c.connect_timeout_ms, c.io_timeout_ms), (0, 500, 2000));
        assert!(toml::from_str::<RedisConfig>("addr = \"h:1\"\nbogus = 1").is_err());
    }
}
