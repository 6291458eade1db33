//! The Redis side of `quiver bench --protocol redis`: the environment's own
//! floor, measured by the same open-loop generator in the same run.
//!
//! The bench writes its own values first (`SET`, through the feed's blocking
//! connection), then sends `GET` of those keys on the generator's hot loop.
//! Replies come back in order per connection, so each connection keeps the
//! ids of its requests in a FIFO. Only what a `GET` can answer is parsed here
//! (a bulk string, nil, or an error line): anything else is a protocol error
//! that breaks the connection, as a bad Quiver frame does.

use std::fmt::Write as _;

use crate::features::feed::resp::{RedisConfig, RedisConn};

/// Keys the bench writes and reads: enough to spread over Redis's dict, few
/// enough to write in one pipeline at start.
pub const KEYS: u64 = 1024;
/// Largest value the bench writes.
pub const VALUE_BYTES_MAX: usize = 1 << 20;

fn key(i: u64) -> String {
    format!("quiver:bench:{i}")
}

/// Writes `KEYS` values of `value_bytes` each, so every `GET` hits.
pub fn prepare(addr: &str, value_bytes: usize) -> Result<(), String> {
    assert!(value_bytes <= VALUE_BYTES_MAX);
    let mut conn = RedisConn::connect(&RedisConfig::new(addr)).map_err(|e| format!("redis at {addr}: {e}"))?;
    let value = vec![b'v'; value_bytes];
    let cmds: Vec<Vec<Vec<u8>>> =
        (0..KEYS).map(|i| vec![b"SET".to_vec(), key(i).into_bytes(), value.clone()]).collect();
    conn.pipeline(&cmds).map_err(|e| format!("redis at {addr}: SET of the bench's values: {e}"))?;
    Ok(())
}

/// Appends `GET` of the key request `seq` reads (no allocation once `out`
/// and `scratch` have grown).
pub fn encode_get(seq: u64, out: &mut Vec<u8>, scratch: &mut String) {
    scratch.clear();
    write!(scratch, "quiver:bench:{}", seq % KEYS).expect("writing to a String cannot fail");
    std::io::Write::write_fmt(out, format_args!("*2\r\n$3\r\nGET\r\n${}\r\n{scratch}\r\n", scratch.len()))
        .expect("writing to a Vec cannot fail");
}

/// What one `GET` reply said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Value,
    Nil,
    Error,
}

impl Reply {
    pub fn name(self) -> &'static str {
        match self {
            Reply::Value => "ok",
            Reply::Nil => "nil",
            Reply::Error => "redis_error",
        }
    }
}

fn line(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// The next complete reply in `buf` and the bytes it used; `Ok(None)` when
/// more bytes are needed.
pub fn decode(buf: &[u8]) -> Result<Option<(Reply, usize)>, String> {
    let Some(&kind) = buf.first() else { return Ok(None) };
    let Some(end) = line(buf) else {
        return if buf.len() > 64 && kind == b'$' { Err("a bulk length line over 64 bytes".into()) } else { Ok(None) };
    };
    match kind {
        b'-' => Ok(Some((Reply::Error, end + 2))),
        b'$' => {
            let len: i64 = std::str::from_utf8(&buf[1..end]).ok().and_then(|s| s.parse().ok()).ok_or_else(|| {
                format!("a bulk length that is not a number: {:?}", String::from_utf8_lossy(&buf[..end]))
            })?;
            if len == -1 {
                return Ok(Some((Reply::Nil, end + 2)));
            }
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= VALUE_BYTES_MAX)
                .ok_or_else(|| format!("a bulk length of {len}"))?;
            let total = end + 2 + len + 2;
            if buf.len() < total {
                return Ok(None);
            }
            if &buf[total - 2..total] != b"\r\n" {
                return Err("a bulk string not ended by CRLF".into());
            }
            Ok(Some((Reply::Value, total)))
        }
        other => Err(format!("a reply of type {:?}, not one a GET gives", other as char)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_is_resp() {
        let (mut out, mut s) = (Vec::new(), String::new());
        encode_get(KEYS + 7, &mut out, &mut s);
        assert_eq!(out, b"*2\r\n$3\r\nGET\r\n$14\r\nquiver:bench:7\r\n");
        assert_eq!(key(7), "quiver:bench:7");
    }

    #[test]
    fn replies_decode_whole_or_wait() {
        let buf = b"$3\r\nabc\r\n$-1\r\n-ERR no\r\n";
        assert_eq!(decode(buf).unwrap(), Some((Reply::Value, 9)));
        assert_eq!(decode(&buf[9..]).unwrap(), Some((Reply::Nil, 5)));
        assert_eq!(decode(&buf[14..]).unwrap(), Some((Reply::Error, 9)));
        for cut in 0..9 {
            assert_eq!(decode(&buf[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert!(decode(b"$3\r\nabcXY").is_err());
        assert!(decode(b":1\r\n").is_err());
        assert!(decode(b"$x\r\n").is_err());
        assert!(decode(b"$99999999999\r\n").is_err());
    }
}
