//! One full copy of a feature group from Redis into a fresh replica file
//! (SCAN + MGET, pipelined), and what tells a copy of a settled source from
//! one of a source being written or reloaded. The refresher resyncs with it;
//! `quiver replica sync` runs it once.

use std::path::Path;
use std::sync::atomic::Ordering;

use super::contract::{self, ContractError};
use super::resp::{RedisConn, RedisError, Reply};
use super::status::GroupStatus;
use crate::replica::{temp_path, Cursor, ReplicaError, ReplicaWriter, Storage};

/// Why a refresh session ended or a sync failed.
#[derive(Debug, thiserror::Error)]
pub enum RefreshError {
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("redis replied to {command} with an unexpected shape: {what}")]
    Reply { command: &'static str, what: String },
    #[error("{0}")]
    Url(String),
    #[error("initial sync of '{group}' did not finish: {why}")]
    InitialSync { group: String, why: String },
}

/// A stream entry id `{ms}-{n}`.
pub(super) fn parse_id(id: &[u8]) -> Option<(u64, u64)> {
    let s = std::str::from_utf8(id).ok()?;
    let (a, b) = s.split_once('-')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

fn parse_u64(reply: &Reply) -> Option<u64> {
    match reply {
        Reply::Nil => Some(0),
        Reply::Int(n) => u64::try_from(*n).ok(),
        Reply::Bulk(b) | Reply::Simple(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

pub(super) fn shape(command: &'static str, what: impl Into<String>) -> RefreshError {
    RefreshError::Reply { command, what: what.into() }
}

/// The epoch and counter Redis holds for a group now (0 when absent).
pub(super) fn position(conn: &mut RedisConn, group: &str) -> Result<(u64, u64), RefreshError> {
    let replies = conn.pipeline(&[
        vec![b"GET".to_vec(), contract::epoch_key(group).into_bytes()],
        vec![b"GET".to_vec(), contract::seq_key(group).into_bytes()],
    ])?;
    let get = |r: &Reply| parse_u64(r).ok_or_else(|| shape("GET", format!("{r:?}")));
    Ok((get(&replies[0])?, get(&replies[1])?))
}

/// The id of the first entry of `group`'s stream at or after `{from_seq}-0`.
pub(super) fn stream_first_from(
    conn: &mut RedisConn,
    group: &str,
    from_seq: u64,
) -> Result<Option<(u64, u64)>, RefreshError> {
    let from = format!("{from_seq}-0");
    let reply =
        conn.command(&[b"XRANGE", contract::stream_key(group).as_bytes(), from.as_bytes(), b"+", b"COUNT", b"1"])?;
    let first = reply.into_array().unwrap_or_default().into_iter().next();
    Ok(first
        .and_then(Reply::into_array)
        .and_then(|e| e.into_iter().next())
        .and_then(Reply::into_bytes)
        .and_then(|id| parse_id(&id)))
}

/// Why a finished copy, begun at `noted` (epoch, counter) with `copied` rows,
/// does not show a settled source, if it does not. `previous_rows` is what
/// the copy before this one of the same resync held: a source that moved
/// during the copy but kept its size is busy, not being reloaded.
pub(super) fn unsettled(
    conn: &mut RedisConn,
    group: &str,
    noted: (u64, u64),
    copied: u64,
    previous_rows: Option<u64>,
    rows_drift_max: f64,
) -> Result<Option<String>, RefreshError> {
    let (epoch, seq) = position(conn, group)?;
    if epoch != noted.0 {
        return Ok(Some(format!("the epoch changed from {} to {epoch} during the copy", noted.0)));
    }
    if seq < noted.1 {
        return Ok(Some(format!("the counter went back from {} to {seq} during the copy", noted.1)));
    }
    let moved = seq - noted.1;
    if moved > 0 && stream_first_from(conn, group, noted.1 + 1)? != Some((noted.1 + 1, 0)) {
        return Ok(Some(format!("the stream no longer holds entry {} the copy needs replayed", noted.1 + 1)));
    }
    let same_size = previous_rows.is_some_and(|p| p.abs_diff(copied) as f64 <= rows_drift_max * copied as f64);
    if moved > 0 && !same_size {
        let was = previous_rows.map_or(String::new(), |p| format!(" (the copy before had {p})"));
        return Ok(Some(format!("{moved} changes arrived while {copied} rows were copied{was}")));
    }
    Ok(None)
}

/// What a full sync writes: a fresh replica of `group` beside `path`.
pub struct SyncTarget<'a> {
    pub group: &'a str,
    pub path: &'a Path,
    pub dim: usize,
    pub storage: Storage,
    pub default: &'a [f32],
    pub batch_keys_max: usize,
}

/// Copies every `{group}:*` key from Redis into a fresh replica file at a
/// temporary name beside the target's path; the caller swaps it in. The
/// returned writer is checkpointed at the counter noted before the copy
/// began, so replaying the stream from there loses nothing written meanwhile.
pub fn full_sync(
    conn: &mut RedisConn,
    target: &SyncTarget<'_>,
    status: Option<&GroupStatus>,
    progress: &mut dyn FnMut(u64),
) -> Result<ReplicaWriter, RefreshError> {
    let SyncTarget { group, path, dim, storage, default, batch_keys_max } = *target;
    let (epoch, tail) = position(conn, group)?;
    let tmp = temp_path(path, "sync");
    // Sized from the whole database so the copy never stops to grow the
    // file; DBSIZE counts other groups too, an overestimate at most.
    let dbsize = conn.command(&[b"DBSIZE"])?.as_int().and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
    let capacity = dbsize.clamp(1024, crate::replica::ROW_CAPACITY_MAX);
    let mut fresh = ReplicaWriter::create(&tmp, group, dim as u32, storage, capacity, default)?;
    let pattern = format!("{group}:*").into_bytes();
    let count = batch_keys_max.max(1).to_string().into_bytes();
    let mut cursor = b"0".to_vec();
    let mut scanned_all = false;
    let mut pending: Vec<Vec<u8>> = Vec::new();
    let mut copied = 0u64;
    // Each round trip carries the next SCAN and the MGET of the keys the
    // previous SCAN returned, so the copy costs one round trip per batch.
    while !(scanned_all && pending.is_empty()) {
        let mut commands = Vec::with_capacity(2);
        if !scanned_all {
            commands.push(vec![
                b"SCAN".to_vec(),
                cursor.clone(),
                b"MATCH".to_vec(),
                pattern.clone(),
                b"COUNT".to_vec(),
                count.clone(),
            ]);
        }
        let keys = std::mem::take(&mut pending);
        if !keys.is_empty() {
            let mut mget = Vec::with_capacity(keys.len() + 1);
            mget.push(b"MGET".to_vec());
            mget.extend(keys.iter().cloned());
            commands.push(mget);
        }
        let mut replies = conn.pipeline(&commands)?.into_iter();
        if !scanned_all {
            let reply = replies.next().ok_or_else(|| shape("SCAN", "no reply"))?;
            let mut parts = reply.into_array().ok_or_else(|| shape("SCAN", "not an array"))?.into_iter();
            let (Some(next), Some(found)) = (parts.next(), parts.next()) else {
                return Err(shape("SCAN", "fewer than two elements"));
            };
            cursor = next.into_bytes().ok_or_else(|| shape("SCAN", "cursor is not a string"))?;
            scanned_all = cursor == b"0";
            pending = found
                .into_array()
                .ok_or_else(|| shape("SCAN", "keys are not an array"))?
                .into_iter()
                .filter_map(Reply::into_bytes)
                .collect();
        }
        if keys.is_empty() {
            continue;
        }
        let values = replies.next().and_then(Reply::into_array).ok_or_else(|| shape("MGET", "not an array"))?;
        if values.len() != keys.len() {
            return Err(shape("MGET", format!("{} values for {} keys", values.len(), keys.len())));
        }
        for (key, value) in keys.iter().zip(values) {
            let applied = match value {
                Reply::Bulk(bytes) => entity(group, key, &bytes, dim).map(|(id, v)| fresh.upsert(id, &v)),
                // MGET answers nil for a key of another type, and for one
                // deleted since SCAN saw it (not bad data: the stream replay
                // after the copy deletes it here too).
                Reply::Nil => match conn.command(&[b"TYPE", key])? {
                    Reply::Simple(t) if t == b"none" => continue,
                    Reply::Simple(t) => Err(format!(
                        "key {} holds a {}, not a string",
                        String::from_utf8_lossy(key),
                        String::from_utf8_lossy(&t)
                    )),
                    other => return Err(shape("TYPE", format!("{other:?}"))),
                },
                other => Err(format!("key {}: unexpected reply {other:?}", String::from_utf8_lossy(key))),
            };
            match applied {
                Ok(result) => {
                    result?;
                    copied += 1;
                }
                Err(why) => skip(status, group, &why),
            }
        }
        progress(copied);
        if let Some(s) = status {
            s.sync_rows.store(copied, Ordering::Relaxed);
        }
    }
    fresh.checkpoint(Cursor { epoch, seq: tail, change_unix_ms: 0 })?;
    Ok(fresh)
}

/// The id and vector of an entity key and value, or why they are bad data.
pub(super) fn entity(group: &str, key: &[u8], value: &[u8], dim: usize) -> Result<(u64, Vec<f32>), String> {
    let name = || String::from_utf8_lossy(key).into_owned();
    let id = contract::parse_entity_key(group, key).ok_or_else(|| format!("key {} is not {group}:<u64>", name()))?;
    let v = contract::decode_vector(value, dim).map_err(|e: ContractError| format!("key {}: {e}", name()))?;
    Ok((id, v))
}

pub(super) fn skip(status: Option<&GroupStatus>, group: &str, why: &str) {
    tracing::warn!(group, "skipped bad feature data: {why}");
    if let Some(s) = status {
        GroupStatus::bump(&s.skipped_total, 1);
    }
}
