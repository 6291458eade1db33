//! The data contract between feature writers and Quiver replicas, as stored in Redis.
//!
//! Per feature group `g` with u64 entity ids:
//! - `g:{id}` holds the entity's vector as packed little-endian f32 (dim × 4 bytes);
//! - `quiver:seq:g` counts changes (INCR), so sequence numbers are dense from 1;
//! - `quiver:stream:g` holds one entry per change with id `{seq}-0` and fields
//!   `k` (entity key), `v` (the new bytes) or `d` = `1` (deleted), and `t` (Redis time, ms);
//! - `quiver:epoch:g` is set once, from Redis `TIME` as `{secs}{micros:06}`, when the group is
//!   first written; a replica that sees it change knows the history it followed is gone.
//!
//! Writers must go through [`PUBLISH_LUA`] (the [`Publisher`] does) so that the entity, the
//! counter and the stream entry change together: a replica that applies the stream in order
//! then converges on exactly the keyspace.

use super::resp::{RedisConn, RedisError, Reply};

/// The publish script; see the comments in `publish.lua` for its keys and arguments.
pub const PUBLISH_LUA: &str = include_str!("publish.lua");

/// The largest vector dimension accepted (the replica format's bound).
pub const DIM_MAX: usize = crate::replica::DIM_MAX as usize;

/// Longest feature group name; it is part of every key.
pub const GROUP_BYTES_MAX: usize = 64;

/// Default approximate bound on stream length: enough history for a replica to catch up after
/// a restart without a full rebuild, bounded so the stream cannot grow without limit.
pub const STREAM_MAXLEN_DEFAULT: u64 = 1_000_000;

/// Commands per pipelined round trip in [`Publisher::put_many`]: large enough to hide the
/// round trip, small enough that one batch's replies and memory stay modest.
pub const PUT_BATCH_ROWS: usize = 1000;

/// A value or name that breaks the contract.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    #[error("vector of {found_bytes} bytes, expected {dim} f32 values ({} bytes)", dim * 4)]
    WrongLength { found_bytes: usize, dim: usize },
    #[error("value {index} is infinite ({value}); NaN marks a missing value")]
    NonFinite { index: usize, value: f32 },
    #[error("vector of {found} values; expected 1 to {DIM_MAX}")]
    Dim { found: usize },
    #[error("feature group '{group}': use 1 to {GROUP_BYTES_MAX} ASCII letters, digits, '_' or '-'")]
    Group { group: String },
    #[error("publish script answered {0}, expected a sequence number")]
    UnexpectedReply(String),
}

/// Why a publish failed: the values, or Redis.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Contract(#[from] ContractError),
    #[error(transparent)]
    Redis(#[from] RedisError),
    /// A row of a batch was refused on its own; the rows before it are written.
    #[error("entity {id}: {source}")]
    Row {
        id: u64,
        #[source]
        source: Box<PublishError>,
    },
}

/// Checks that `group` is usable in keys: short, ASCII, no separators.
pub fn check_group(group: &str) -> Result<(), ContractError> {
    let ok = !group.is_empty()
        && group.len() <= GROUP_BYTES_MAX
        && group.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ContractError::Group { group: group.into() })
    }
}

pub fn entity_key(group: &str, id: u64) -> String {
    format!("{group}:{id}")
}

pub fn seq_key(group: &str) -> String {
    format!("quiver:seq:{group}")
}

pub fn stream_key(group: &str) -> String {
    format!("quiver:stream:{group}")
}

pub fn epoch_key(group: &str) -> String {
    format!("quiver:epoch:{group}")
}

/// The id in an entity key of `group`, if `key` is one exactly as [`entity_key`] writes it
/// (no sign, no leading zeros), so that parsing and formatting are inverses.
pub fn parse_entity_key(group: &str, key: &[u8]) -> Option<u64> {
    let digits = key.strip_prefix(group.as_bytes())?.strip_prefix(b":")?;
    let canonical = match digits {
        [] => false,
        [b'0'] => true,
        [first, ..] => *first != b'0' && digits.iter().all(u8::is_ascii_digit),
    };
    if !canonical {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Packs a vector as little-endian f32, the form stored under entity keys.
pub fn encode_vector(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Unpacks an entity value of a group with dimension `dim`, refusing anything a writer
/// following the contract could not have stored.
pub fn decode_vector(bytes: &[u8], dim: usize) -> Result<Vec<f32>, ContractError> {
    let mut values = Vec::with_capacity(dim);
    decode_vector_into(bytes, dim, &mut values)?;
    Ok(values)
}

/// [`decode_vector`] appending to `out`, which is left as it was when the value is refused: a
/// full sync decodes a whole batch into one buffer instead of one allocation per entity.
pub fn decode_vector_into(bytes: &[u8], dim: usize, out: &mut Vec<f32>) -> Result<(), ContractError> {
    if bytes.len() != dim * 4 {
        return Err(ContractError::WrongLength { found_bytes: bytes.len(), dim });
    }
    let start = out.len();
    out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
    let checked = check_values(&out[start..]);
    if checked.is_err() {
        out.truncate(start);
    }
    checked
}

/// The publish-side rule for vectors: 1 to [`DIM_MAX`] values, none
/// infinite (NaN is a missing value).
pub fn check_values(values: &[f32]) -> Result<(), ContractError> {
    if values.is_empty() || values.len() > DIM_MAX {
        return Err(ContractError::Dim { found: values.len() });
    }
    match values.iter().position(|v| v.is_infinite()) {
        Some(index) => Err(ContractError::NonFinite { index, value: values[index] }),
        None => Ok(()),
    }
}

/// Writes entities through the publish script on one connection.
pub struct Publisher {
    conn: RedisConn,
    sha: String,
    stream_maxlen: u64,
}

impl Publisher {
    /// Loads the publish script on `conn`'s server.
    pub fn new(conn: RedisConn) -> Result<Publisher, PublishError> {
        let mut p = Publisher { conn, sha: String::new(), stream_maxlen: STREAM_MAXLEN_DEFAULT };
        p.load_script()?;
        Ok(p)
    }

    /// The approximate bound passed to `XADD MAXLEN ~`.
    pub fn with_stream_maxlen(mut self, stream_maxlen: u64) -> Publisher {
        self.stream_maxlen = stream_maxlen;
        self
    }

    /// The connection, for reads alongside publishing.
    pub fn conn(&mut self) -> &mut RedisConn {
        &mut self.conn
    }

    /// Sets `group:{id}` to `values`; returns the change's sequence number.
    pub fn put(&mut self, group: &str, id: u64, values: &[f32]) -> Result<u64, PublishError> {
        check_group(group)?;
        check_values(values)?;
        let cmd = self.publish_command(group, id, &Op::Put(encode_vector(values)));
        self.run_one(cmd)
    }

    /// Deletes `group:{id}`; returns the change's sequence number. Deleting an absent entity
    /// still records the change, so replicas that missed the put agree as well.
    pub fn delete(&mut self, group: &str, id: u64) -> Result<u64, PublishError> {
        check_group(group)?;
        let cmd = self.publish_command(group, id, &Op::Delete);
        self.run_one(cmd)
    }

    /// Writes `rows` in order, [`PUT_BATCH_ROWS`] per round trip, calling `progress(done, total)`
    /// after each batch; returns the last sequence number (0 for no rows). Every row is checked
    /// before anything is sent, so bad values write nothing.
    pub fn put_many(
        &mut self,
        group: &str,
        rows: &[(u64, Vec<f32>)],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        check_group(group)?;
        for (id, values) in rows {
            check_values(values).map_err(|e| PublishError::Row { id: *id, source: Box::new(e.into()) })?;
        }
        self.publish_many(group, rows.len(), |i| (rows[i].0, Op::Put(encode_vector(&rows[i].1))), progress)
    }

    /// Deletes `group:{id}` for every id, in order, [`PUT_BATCH_ROWS`] per round trip, with
    /// progress as [`Publisher::put_many`]; returns the last sequence number (0 for no ids).
    pub fn delete_many(
        &mut self,
        group: &str,
        ids: &[u64],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        check_group(group)?;
        self.publish_many(group, ids.len(), |i| (ids[i], Op::Delete), progress)
    }

    /// Runs the `n` changes `change(i)` gives, pipelined by batch.
    fn publish_many(
        &mut self,
        group: &str,
        n: usize,
        change: impl Fn(usize) -> (u64, Op),
        mut progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        let mut last_seq = 0;
        for start in (0..n).step_by(PUT_BATCH_ROWS) {
            let batch: Vec<(u64, Op)> = (start..n.min(start + PUT_BATCH_ROWS)).map(&change).collect();
            let cmds: Vec<Vec<Vec<u8>>> = batch.iter().map(|(id, op)| self.publish_command(group, *id, op)).collect();
            let mut replies = self.conn.pipeline(&cmds)?;
            // A server restart or SCRIPT FLUSH between batches (or within one) drops the script:
            // reload it and redo, in order, just the commands that did not run.
            if replies.iter().any(is_noscript) {
                self.load_script()?;
                let redo: Vec<usize> = (0..replies.len()).filter(|&i| is_noscript(&replies[i])).collect();
                let redo_cmds: Vec<Vec<Vec<u8>>> = redo.iter().map(|&i| self.refresh_sha(cmds[i].clone())).collect();
                for (i, reply) in redo.into_iter().zip(self.conn.pipeline(&redo_cmds)?) {
                    replies[i] = reply;
                }
            }
            for ((id, _), reply) in batch.iter().zip(replies) {
                last_seq =
                    self.seq_from(reply).map_err(|e| PublishError::Row { id: *id, source: Box::new(e) })?.max(last_seq);
            }
            progress(start + batch.len(), n);
        }
        Ok(last_seq)
    }

    fn load_script(&mut self) -> Result<(), PublishError> {
        let reply = self.conn.command(&[b"SCRIPT", b"LOAD", PUBLISH_LUA.as_bytes()])?;
        self.sha = match reply.into_bytes().map(String::from_utf8) {
            Some(Ok(sha)) => sha,
            _ => return Err(ContractError::UnexpectedReply("a non-text SCRIPT LOAD answer".into()).into()),
        };
        Ok(())
    }

    fn publish_command(&self, group: &str, id: u64, op: &Op) -> Vec<Vec<u8>> {
        let (op_name, bytes): (&[u8], &[u8]) = match op {
            Op::Put(bytes) => (b"put", bytes),
            Op::Delete => (b"del", b""),
        };
        vec![
            b"EVALSHA".to_vec(),
            self.sha.clone().into_bytes(),
            b"4".to_vec(),
            entity_key(group, id).into_bytes(),
            seq_key(group).into_bytes(),
            stream_key(group).into_bytes(),
            epoch_key(group).into_bytes(),
            op_name.to_vec(),
            bytes.to_vec(),
            self.stream_maxlen.to_string().into_bytes(),
        ]
    }

    /// `cmd` with the current script hash, after a reload.
    fn refresh_sha(&self, mut cmd: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
        cmd[1] = self.sha.clone().into_bytes();
        cmd
    }

    fn run_one(&mut self, cmd: Vec<Vec<u8>>) -> Result<u64, PublishError> {
        let mut reply = self.conn.pipeline(std::slice::from_ref(&cmd))?.pop();
        if reply.as_ref().is_some_and(is_noscript) {
            self.load_script()?;
            reply = self.conn.pipeline(&[self.refresh_sha(cmd)])?.pop();
        }
        self.seq_from(reply.unwrap_or(Reply::Nil))
    }

    fn seq_from(&self, reply: Reply) -> Result<u64, PublishError> {
        match reply {
            Reply::Int(seq) if seq > 0 => Ok(seq as u64),
            Reply::Error(message) => Err(RedisError::Server { addr: self.conn.addr().to_string(), message }.into()),
            other => Err(ContractError::UnexpectedReply(format!("{other:?}")).into()),
        }
    }
}

enum Op {
    Put(Vec<u8>),
    Delete,
}

fn is_noscript(reply: &Reply) -> bool {
    matches!(reply, Reply::Error(m) if m.starts_with("NOSCRIPT"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_contract() {
        assert_eq!(entity_key("user", 42), "user:42");
        assert_eq!(seq_key("item"), "quiver:seq:item");
        assert_eq!(stream_key("item"), "quiver:stream:item");
        assert_eq!(epoch_key("item"), "quiver:epoch:item");
    }

    #[test]
    fn entity_keys_parse_back_only_when_canonical() {
        for id in [0, 7, 42, u64::MAX] {
            assert_eq!(parse_entity_key("user", entity_key("user", id).as_bytes()), Some(id));
        }
        for bad in [
            "user:",
            "user:042",
            "user:+4",
            "user:-4",
            "user:4x",
            "item:4",
            "user4",
            "users:4",
            "user:18446744073709551616",
        ] {
            assert_eq!(parse_entity_key("user", bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn vectors_round_trip_and_bad_ones_are_refused() {
        let v = [0.5f32, -1.25, 3.0e-8, f32::MAX];
        let bytes = encode_vector(&v);
        assert_eq!(bytes.len(), 16);
        assert_eq!(&bytes[..4], &0.5f32.to_le_bytes());
        assert_eq!(decode_vector(&bytes, 4).unwrap(), v);
        assert!(matches!(decode_vector(&bytes, 3), Err(ContractError::WrongLength { found_bytes: 16, dim: 3 })));
        assert!(matches!(decode_vector(&bytes[..15], 4), Err(ContractError::WrongLength { .. })));
        let inf = encode_vector(&[1.0, f32::INFINITY]);
        assert!(matches!(decode_vector(&inf, 2), Err(ContractError::NonFinite { index: 1, .. })));
        let nan = decode_vector(&encode_vector(&[1.0, f32::NAN]), 2).unwrap();
        assert!(nan[1].is_nan(), "NaN is a missing value and passes");
        let mut batch = vec![9.0];
        decode_vector_into(&bytes, 4, &mut batch).unwrap();
        assert_eq!(batch[1..], v);
        assert!(decode_vector_into(&inf, 2, &mut batch).is_err());
        assert!(decode_vector_into(&bytes, 3, &mut batch).is_err());
        assert_eq!(batch.len(), 5, "a refused value leaves the buffer as it was");
        assert!(matches!(check_values(&[]), Err(ContractError::Dim { found: 0 })));
        assert!(matches!(check_values(&vec![0.0; DIM_MAX + 1]), Err(ContractError::Dim { .. })));
        assert!(check_values(&vec![0.0; DIM_MAX]).is_ok());
        assert!(matches!(check_values(&[f32::INFINITY]), Err(ContractError::NonFinite { index: 0, .. })));
    }

    #[test]
    fn group_names_are_checked() {
        for ok in ["user", "item", "ad_v2", "a-b"] {
            assert!(check_group(ok).is_ok(), "{ok}");
        }
        let long = "g".repeat(GROUP_BYTES_MAX + 1);
        for bad in ["", "a:b", "a b", "ü", long.as_str()] {
            assert!(check_group(bad).is_err(), "{bad}");
        }
    }
}
