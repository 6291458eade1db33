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

/// What one reply may hold, checked as its bytes arrive: a reply (or a length prefix announcing
/// one) past either bound is a protocol error and the connection is dropped. Bytes bound the
/// buffer; elements bound what decoding makes of it, which is where a small reply grows: an
/// empty bulk string is 4 bytes on the wire and some 70 in memory once decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyLimits {
    /// Elements of all the reply's arrays together (nested ones included).
    pub elements_max: u64,
    pub bytes_max: usize,
}

impl ReplyLimits {
    /// For a command that says nothing about its reply's size: far beyond any reply the feed
    /// reads of Redis that way (CLUSTER SLOTS of a cluster split into 16,384 ranges of a dozen
    /// nodes each fits), and some 140 MiB decoded at the most.
    pub const DEFAULT: ReplyLimits = ReplyLimits { elements_max: 1 << 20, bytes_max: 64 << 20 };

    /// The bounds of the reply to `args`, from what the command asks for where it says: an
    /// MGET of n keys is n values, a SCAN or a stream read returns about its COUNT.
    pub fn for_command(args: &[&[u8]]) -> ReplyLimits {
        let default = ReplyLimits::DEFAULT;
        let Some(name) = args.first() else { return default };
        // The number after keyword `word` (COUNT) among the options `args[options]`, where a key
        // named like the keyword cannot be taken for it.
        let after = |word: &[u8], options: std::ops::Range<usize>| -> Option<u64> {
            let i = options.start + args.get(options)?.iter().position(|a| a.eq_ignore_ascii_case(word))?;
            std::str::from_utf8(args.get(i + 1)?).ok()?.parse().ok()
        };
        // Values are feature vectors of at most the replica format's DIM_MAX floats; the slack is for the bulk
        // headers, keys, ids and a writer's odd value, which the contract check then refuses.
        let value_bytes = (crate::features::replica::DIM_MAX as usize * 4 + 512) as u64;
        let bytes = |values: u64| {
            let derived = usize::try_from(values.saturating_mul(value_bytes)).unwrap_or(usize::MAX);
            derived.max(default.bytes_max)
        };
        let upper = |a: &[u8]| a.eq_ignore_ascii_case(name);
        if upper(b"MGET") {
            let keys = args.len() as u64 - 1;
            return ReplyLimits { elements_max: keys, bytes_max: bytes(keys) };
        }
        if upper(b"XREAD") || upper(b"XRANGE") || upper(b"XREVRANGE") {
            // XREAD [COUNT c] [BLOCK ms] STREAMS key... id...: the options come before STREAMS;
            // XRANGE key start end [COUNT c]: after the three.
            let streams_at = args.iter().position(|a| a.eq_ignore_ascii_case(b"STREAMS"));
            let (options, streams) = match streams_at {
                Some(i) if upper(b"XREAD") => (1..i, ((args.len() - i - 1) / 2) as u64),
                _ if upper(b"XREAD") => return default,
                _ => (4.min(args.len())..args.len(), 1),
            };
            let Some(count) = after(b"COUNT", options) else { return default };
            // XREAD: [[stream, [[id, [field, value, ...]], ...]], ...], one per stream named.
            let entry = 3 + STREAM_ENTRY_FIELDS_MAX;
            let per_stream = count.saturating_mul(entry).saturating_add(3);
            return ReplyLimits {
                elements_max: streams.saturating_mul(per_stream),
                bytes_max: bytes(streams.saturating_mul(count)),
            };
        }
        if upper(b"SCAN") {
            // COUNT is a hint: SCAN returns the keys of the buckets it visited, which may be a
            // few more than asked for.
            let count = after(b"COUNT", 2.min(args.len())..args.len()).unwrap_or(10);
            return ReplyLimits { elements_max: count.saturating_mul(4).saturating_add(4096), ..default };
        }
        if upper(b"CLUSTER") && args.get(1).is_some_and(|a| a.eq_ignore_ascii_case(b"GETKEYSINSLOT")) {
            let count = args.get(3).and_then(|c| std::str::from_utf8(c).ok()?.parse::<u64>().ok());
            return ReplyLimits { elements_max: count.unwrap_or(0), ..default };
        }
        default
    }
}

/// Fields and values of one stream entry a read allows for: the contract's entries have six
/// (`k`, `v` or `d`, `t`).
const STREAM_ENTRY_FIELDS_MAX: u64 = 16;

/// A header line (`$`, `*`, `:`) longer than this is refused before its end arrives: a length
/// or integer has at most 20 characters.
const HEADER_LINE_BYTES_MAX: usize = 32;

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
            reader: ReplyReader::new(),
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
        match self.receive(ReplyLimits::for_command(args))? {
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
        for cmd in cmds {
            let args: Vec<&[u8]> = cmd.iter().map(Vec::as_slice).collect();
            replies.push(self.receive(ReplyLimits::for_command(&args))?);
        }
        Ok(replies)
    }

    /// Reads the next message the server pushes on a subscribed connection
    /// (`PSUBSCRIBE`), waiting up to the read timeout: `None` when none came
    /// in that time. A message half read when the time ran out stays
    /// buffered, and the next call goes on with it, so a quiet channel is
    /// no failure.
    pub fn next_pushed(&mut self, limits: ReplyLimits) -> Result<Option<Reply>, RedisError> {
        self.check_usable()?;
        match self.reader.read_reply(&mut self.stream, limits) {
            Ok(reply) => Ok(Some(reply)),
            Err(ReadFailure::Io(e)) if is_timeout(&e) => Ok(None),
            Err(failure) => {
                self.broken = true;
                let addr = self.addr.clone();
                Err(match failure {
                    ReadFailure::Io(e) => io_failure(&addr, "read", self.read_timeout_ms, e),
                    ReadFailure::Protocol(what) => RedisError::Protocol { addr, what },
                    ReadFailure::Closed => RedisError::Closed { addr },
                })
            }
        }
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

    fn receive(&mut self, limits: ReplyLimits) -> Result<Reply, RedisError> {
        self.reader.read_reply(&mut self.stream, limits).map_err(|failure| {
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
/// tests: replies are untrusted input, and this is their one parser. Each reply is held to
/// `reply_bytes_max` and the default element bound.
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
    let limits = ReplyLimits { bytes_max: reply_bytes_max, ..ReplyLimits::DEFAULT };
    let mut reader = ReplyReader::new();
    let mut replies = Vec::new();
    loop {
        match reader.read_reply(&mut src, limits) {
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
/// finds where the frame ends (and checks its bounds) as bytes arrive, and the decoder runs
/// once per complete frame, on a frame already known to be within them. Separate from the
/// socket so framing is testable with any `Read`.
struct ReplyReader {
    buf: Vec<u8>,
    /// Unconsumed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    scan: FrameScan,
    /// Bytes the end-of-line search has looked at, over the reader's life: a measure of the
    /// scan's work for tests.
    scanned_bytes: u64,
}

impl ReplyReader {
    fn new() -> ReplyReader {
        ReplyReader { buf: Vec::new(), start: 0, end: 0, scan: FrameScan::new(), scanned_bytes: 0 }
    }

    fn read_reply<R: Read>(&mut self, src: &mut R, limits: ReplyLimits) -> Result<Reply, ReadFailure> {
        loop {
            if let Some(len) = self.scan.advance(&self.buf[self.start..self.end], limits, &mut self.scanned_bytes)? {
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
            self.fill(src, limits.bytes_max)?;
        }
    }

    /// Reads at least one more byte of the frame in progress.
    fn fill<R: Read>(&mut self, src: &mut R, bytes_max: usize) -> Result<(), ReadFailure> {
        // Everything buffered belongs to the incomplete frame, so this bounds its size even
        // when no length prefix gave it away (a simple string with no line end).
        if self.end - self.start >= bytes_max {
            return Err(ReadFailure::Protocol(format!("reply exceeds {bytes_max} bytes")));
        }
        if self.end == self.buf.len() {
            if self.start > 0 {
                // The scan's offsets are relative to `start`, so moving the bytes keeps them valid.
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.end == self.buf.len() {
                let grown = (self.buf.len() * 2).max(READ_CHUNK_BYTES).min(bytes_max + READ_CHUNK_BYTES);
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

/// Finds the end of one RESP2 frame, resuming where the previous call stopped: neither a line
/// nor a bulk string is looked at again when more of it arrives.
struct FrameScan {
    /// Bytes of the frame accounted for so far.
    pos: usize,
    /// How far past `pos` the current line was searched for its end without finding it.
    line_searched: usize,
    /// Elements the frame's arrays have announced so far.
    elements: u64,
    /// For each open array, the elements still to come; the outermost entry is the frame itself.
    open: Vec<u64>,
}

impl FrameScan {
    fn new() -> FrameScan {
        FrameScan { pos: 0, line_searched: 0, elements: 0, open: vec![1] }
    }

    /// `Some(length)` once `buf` holds the whole frame; `None` while more bytes are needed.
    /// `scanned` counts the bytes the end-of-line search looks at.
    fn advance(&mut self, buf: &[u8], limits: ReplyLimits, scanned: &mut u64) -> Result<Option<usize>, ReadFailure> {
        let protocol = |what: String| Err(ReadFailure::Protocol(what));
        let bytes_max = limits.bytes_max;
        while let Some(&left) = self.open.last() {
            if left == 0 {
                self.open.pop();
                continue;
            }
            let rest = &buf[self.pos..];
            // Resume one byte early: the CR of a CRLF split across reads was searched already.
            let from = self.line_searched.saturating_sub(1);
            let found = rest[from..].windows(2).position(|w| w == b"\r\n");
            *scanned += found.map_or(rest.len() - from, |i| i + 2) as u64;
            let Some(eol) = found.map(|i| from + i) else {
                self.line_searched = rest.len();
                if matches!(rest.first(), Some(b'$' | b'*' | b':')) && rest.len() > HEADER_LINE_BYTES_MAX {
                    return protocol(format!("a length line of more than {HEADER_LINE_BYTES_MAX} bytes"));
                }
                return Ok(None);
            };
            self.line_searched = 0;
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
                        // Refused on its header, before a byte of it is buffered.
                        let room = bytes_max.saturating_sub(self.pos + header_len + 2);
                        let n = usize::try_from(n).unwrap_or(usize::MAX);
                        if n > room {
                            return protocol(format!(
                                "bulk string of {n} bytes exceeds the reply bound of {bytes_max}"
                            ));
                        }
                        consumed = header_len + n + 2;
                        if rest.len() < consumed {
                            // The header is parsed again when the body is in: a few bytes.
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
                        let n = n as u64;
                        if self.elements.saturating_add(n) > limits.elements_max {
                            return protocol(format!(
                                "array of {n} elements exceeds the reply bound of {} elements in all",
                                limits.elements_max
                            ));
                        }
                        if self.open.len() >= REPLY_DEPTH_MAX {
                            return protocol(format!("arrays nested deeper than {REPLY_DEPTH_MAX}"));
                        }
                        self.elements += n;
                        self.pos += header_len;
                        if let Some(top) = self.open.last_mut() {
                            *top -= 1;
                        }
                        self.open.push(n);
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

/// A fake Redis on a loopback port for tests: it reads commands as a server would and answers
/// each with what a closure makes of it, hostile bytes included.
#[cfg(test)]
pub(crate) mod fake {
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    use super::{ReplyLimits, ReplyReader};

    type Answer = dyn Fn(&[Vec<u8>], u16) -> Vec<u8> + Send + Sync;
    /// Connections accepted, and every command received.
    type Log = Arc<Mutex<(usize, Vec<Vec<Vec<u8>>>)>>;

    pub(crate) struct FakeRedis {
        pub addr: String,
        log: Log,
    }

    impl FakeRedis {
        /// Answers every command with `answer(command)`.
        pub(crate) fn start(answer: impl Fn(&[Vec<u8>]) -> Vec<u8> + Send + Sync + 'static) -> FakeRedis {
            FakeRedis::start_with_port(move |cmd, _| answer(cmd))
        }

        /// Answers every command with `answer(command, its own port)`.
        pub(crate) fn start_with_port(
            answer: impl Fn(&[Vec<u8>], u16) -> Vec<u8> + Send + Sync + 'static,
        ) -> FakeRedis {
            let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
            let port = listener.local_addr().expect("bound").port();
            let log: Log = Arc::default();
            let answer: Arc<Answer> = Arc::new(answer);
            let (l, a) = (log.clone(), answer.clone());
            // The threads end with the test process; each connection's ends when the client
            // closes it.
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { return };
                    l.lock().expect("log").0 += 1;
                    let (l, a) = (l.clone(), a.clone());
                    std::thread::spawn(move || {
                        let mut reader = ReplyReader::new();
                        while let Ok(super::Reply::Array(args)) = reader.read_reply(&mut stream, ReplyLimits::DEFAULT) {
                            let cmd: Vec<Vec<u8>> = args.into_iter().filter_map(super::Reply::into_bytes).collect();
                            let out = a(&cmd, port);
                            l.lock().expect("log").1.push(cmd);
                            if std::io::Write::write_all(&mut stream, &out).is_err() {
                                return;
                            }
                        }
                    });
                }
            });
            FakeRedis { addr: format!("127.0.0.1:{port}"), log }
        }

        pub(crate) fn connections(&self) -> usize {
            self.log.lock().expect("log").0
        }

        pub(crate) fn commands(&self) -> Vec<Vec<Vec<u8>>> {
            self.log.lock().expect("log").1.clone()
        }
    }
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
        let mut reader = ReplyReader::new();
        let limits = ReplyLimits { bytes_max: 1 << 20, ..ReplyLimits::DEFAULT };
        (0..count).map(|_| reader.read_reply(&mut src, limits)).collect()
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

    /// A line that arrives a byte at a time is searched for its end once,
    /// not again from its start on every read: the work is linear in the
    /// line, where a rescan from its start made it quadratic (20,000 bytes
    /// took 200,070,006 steps).
    #[test]
    fn a_drip_fed_line_is_scanned_once() {
        let line_bytes = 20_000;
        let mut wire = vec![b'+'];
        wire.extend(std::iter::repeat_n(b'a', line_bytes));
        wire.extend_from_slice(b"\r\n");
        let mut src = Chunked { data: wire.clone(), cuts: (1..wire.len()).collect(), pos: 0 };
        let mut reader = ReplyReader::new();
        let reply = reader.read_reply(&mut src, ReplyLimits::DEFAULT).unwrap();
        assert_eq!(reply, Reply::Simple(vec![b'a'; line_bytes]));
        assert!(reader.scanned_bytes <= 2 * wire.len() as u64, "{} bytes scanned", reader.scanned_bytes);
    }

    /// Replies larger than their command asked for are refused as they arrive, with a typed
    /// error, and the connection is unusable after (the callers reconnect): an MGET of two keys
    /// answered by an array of 10^8, a GET by a bulk string of 400 MB (under the old 512 MiB
    /// bound, so it used to be awaited), and a reply of 2,000,000 empty strings (12 MB on the
    /// wire, some 140 MB decoded).
    #[test]
    fn replies_past_what_their_command_asked_for_are_refused() {
        let mut many = b"*2000000\r\n".to_vec();
        for _ in 0..2_000_000 {
            many.extend_from_slice(b"$0\r\n\r\n");
        }
        let redis = fake::FakeRedis::start(move |cmd| match cmd[0].as_slice() {
            b"PING" => b"+PONG\r\n".to_vec(),
            b"MGET" => b"*100000000\r\n$1\r\nx\r\n".to_vec(),
            b"GET" => b"$400000000\r\nxyz".to_vec(),
            _ => many.clone(),
        });
        let config = RedisConfig { io_timeout_ms: 5_000, ..RedisConfig::new(redis.addr.clone()) };
        for (args, want) in [
            (&[&b"MGET"[..], b"a", b"b"][..], "array of 100000000 elements exceeds the reply bound of 2 elements"),
            (&[b"GET", b"a"], "bulk string of 400000000 bytes exceeds the reply bound of 67108864"),
            (&[b"DBSIZE"], "array of 2000000 elements exceeds the reply bound of 1048576 elements"),
        ] {
            let mut conn = RedisConn::connect(&config).unwrap();
            let e = conn.command(args).unwrap_err();
            assert!(matches!(&e, RedisError::Protocol { what, .. } if what.contains(want)), "{e}");
            assert!(matches!(conn.command(&[b"PING"]), Err(RedisError::Broken { .. })));
        }
    }

    #[test]
    fn reply_limits_follow_the_command() {
        let l = |args: &[&[u8]]| ReplyLimits::for_command(args);
        let value = (crate::features::replica::DIM_MAX as usize * 4 + 512) as u64;
        assert_eq!(l(&[&b"mget"[..], b"a", b"b"]).elements_max, 2);
        let big = l(&[&b"MGET"[..]; 10_001]);
        assert_eq!((big.elements_max, big.bytes_max as u64), (10_000, 10_000 * value));
        // XREAD COUNT 10 over 3 streams: per stream [name, [entries]], each entry
        // [id, [fields]].
        let x = l(&[b"XREAD", b"COUNT", b"10", b"BLOCK", b"5", b"STREAMS", b"s1", b"s2", b"s3", b"0", b"0", b"0"]);
        assert_eq!(x.elements_max, 3 * (10 * (3 + STREAM_ENTRY_FIELDS_MAX) + 3));
        assert_eq!(l(&[b"XRANGE", b"s", b"-", b"+", b"COUNT", b"1"]).elements_max, 3 + STREAM_ENTRY_FIELDS_MAX + 3);
        assert_eq!(l(&[b"SCAN", b"0", b"MATCH", b"g:*", b"COUNT", b"1000"]).elements_max, 4000 + 4096);
        assert_eq!(l(&[b"CLUSTER", b"GETKEYSINSLOT", b"7", b"50"]).elements_max, 50);
        // A key named like the keyword is not taken for it.
        for other in [
            &[&b"XREAD"[..], b"STREAMS", b"count", b"0"][..],
            &[b"XRANGE", b"count", b"0", b"+"],
            &[b"CLUSTER", b"SLOTS"],
            &[b"EVALSHA"],
            &[],
        ] {
            assert_eq!(l(other), ReplyLimits::DEFAULT);
        }
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
