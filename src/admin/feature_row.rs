//! `GET /features/{group}?key=K`: one key's row exactly as the shards read
//! it now, for the operator whose score looks wrong and who must first know
//! what the server saw. The row is read through the same `ReplicaHandle`
//! the shards serve (lock-free reads, no lock a shard takes), decoded from
//! its storage, or the group's default row when the key is not there.
//!
//! The replica format keeps no time per row: the time answered is the
//! group's last applied change (the feed's, or the file's checkpoint when
//! nothing follows Redis), never the row's own.

use std::sync::atomic::Ordering::Relaxed;

use serde::Serialize;

use crate::deadline::{Clock, MonotonicClock};
use crate::features::groups::{Absent, Scope};
use crate::features::replica::{decode_link, key_hash, KeyKind, Storage, GROUP_NAME_BYTES_MAX, KEY_BYTES_MAX};
use crate::metrics::Readiness;
use crate::request::SharedGroup;

/// What the route says of where the time in an answer comes from.
pub const TIME_NOTE: &str =
    "group_change_unix_ms and group_applied_seq are the group's last applied change, not this row's: replicas keep no \
     per-row update time";

/// A parsed `GET /features/{group}?key=K`: the group's name (at most
/// [`GROUP_NAME_BYTES_MAX`] bytes) and the key's bytes, percent-decoded (at
/// most [`KEY_BYTES_MAX`]).
#[derive(Debug, PartialEq)]
pub struct RowQuery {
    pub group: String,
    pub key: Vec<u8>,
}

/// The usage line of the route, for answers that refuse a request.
pub const USAGE: &str = "use GET /features/<group>?key=<K> (K percent-encoded)";

/// Reads `group` and the query string of a `/features/{group}` URL. The
/// error is the one line a 400 answers; nothing longer than the limits is
/// decoded or echoed.
pub fn parse(group: &str, query: &str) -> Result<RowQuery, String> {
    if group.is_empty() || group.len() > GROUP_NAME_BYTES_MAX {
        return Err(format!("a group name is 1 to {GROUP_NAME_BYTES_MAX} bytes; {USAGE}"));
    }
    let mut keys = query.split('&').filter_map(|kv| kv.strip_prefix("key="));
    let Some(raw) = keys.next() else {
        return Err(format!("no key: {USAGE}"));
    };
    if keys.next().is_some() {
        return Err(format!("key given twice: {USAGE}"));
    }
    let key = percent_decode(raw)?;
    if key.is_empty() {
        return Err(format!("an empty key: {USAGE}"));
    }
    Ok(RowQuery { group: group.to_string(), key })
}

/// RFC 3986 percent-decoding of at most [`KEY_BYTES_MAX`] bytes. A `+` is
/// a plus sign, not a space: string keys may hold one, and a key is read
/// the one way a client that percent-encodes every byte sends it.
fn percent_decode(raw: &str) -> Result<Vec<u8>, String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len().min(KEY_BYTES_MAX as usize));
    let mut i = 0;
    while i < bytes.len() {
        if out.len() == KEY_BYTES_MAX as usize {
            return Err(format!("a key is at most {KEY_BYTES_MAX} bytes"));
        }
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            let byte =
                hex.and_then(|h| u8::from_str_radix(h, 16).ok()).ok_or("a '%' not followed by two hex digits")?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// The route's JSON answer.
#[derive(Debug, Serialize)]
pub struct FeatureRow {
    pub group: String,
    /// The key as sent; not UTF-8 bytes are replaced (see `key_hex`).
    pub key: String,
    /// The key's bytes in hex, when they are not UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_hex: Option<String>,
    /// "u64" or "string".
    pub key_type: &'static str,
    /// False: the key is not in the replica and `row` is the default row,
    /// what a request with this key is served.
    pub found: bool,
    /// The floats a request is served, decoded from `storage`.
    pub row: Vec<f32>,
    /// For a group with a parent: the parent key this row names (null: it
    /// names none, or the key was not found), which the request path
    /// follows to the parent's row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentLink>,
    /// For a Feast view: the row's event time (its `_ts:`, Unix seconds;
    /// null when it holds none), and whether it is older than the view's
    /// `ttl`, so served as missing (`row` is then NaN, as a request gets it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_unix_s: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub expired: bool,
    pub width: usize,
    pub storage: Storage,
    pub scope: Scope,
    /// What a request that carries no key of this group gets.
    pub absent: Absent,
    /// Whether the replica follows Redis (`[feed]`), or is a file served as it is.
    pub follows_redis: bool,
    /// How long since the feed last knew the group held everything Redis
    /// had; null without a feed.
    pub staleness_ms: Option<u64>,
    /// When the group's last applied change was written to Redis; null
    /// when none was ever applied.
    pub group_change_unix_ms: Option<u64>,
    /// The stream sequence number of that change (0: none).
    pub group_applied_seq: u64,
    pub note: &'static str,
}

/// The parent a row links to.
#[derive(Debug, Serialize)]
pub struct ParentLink {
    /// The parent group's name.
    pub group: String,
    /// The parent key the row names, as text (a u64 in decimal); null when
    /// it names none.
    pub key: Option<String>,
}

/// How a lookup fails: the status and the one line answered.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum LookupError {
    #[error("no feature group '{name}': this server serves {served}")]
    UnknownGroup { name: String, served: String },
    /// The key quoted with escapes, so the answer stays one line.
    #[error("group '{group}' has u64 keys: {key:?} is not a decimal u64")]
    NotU64 { group: String, key: String },
    #[error("group '{group}' has string keys of 1 to {bytes_max} bytes; this one is {len} bytes")]
    KeyLength { group: String, bytes_max: u32, len: usize },
}

impl LookupError {
    pub fn status(&self) -> u16 {
        match self {
            LookupError::UnknownGroup { .. } => 404,
            LookupError::NotU64 { .. } | LookupError::KeyLength { .. } => 400,
        }
    }
}

/// Reads `q.key`'s row of `q.group` from the served `groups` now.
pub fn lookup(groups: &[SharedGroup], readiness: &Readiness, q: &RowQuery) -> Result<FeatureRow, LookupError> {
    let Some(g) = groups.iter().find(|g| g.name == q.group) else {
        let served: Vec<&str> = groups.iter().map(|g| g.name.as_str()).collect();
        let served = if served.is_empty() { "no groups".to_string() } else { served.join(", ") };
        return Err(LookupError::UnknownGroup { name: q.group.clone(), served });
    };
    let handle = &g.handle;
    let mut row = vec![0f32; handle.dim()];
    let mut link = vec![0u32; handle.link_words()];
    let (found, key_type) = match handle.key_kind() {
        KeyKind::U64 => {
            let id = std::str::from_utf8(&q.key).ok().and_then(|s| s.parse::<u64>().ok()).ok_or_else(|| {
                LookupError::NotU64 { group: g.name.clone(), key: String::from_utf8_lossy(&q.key).into_owned() }
            })?;
            (handle.read_linked_into(id, &[], &mut row, &mut link), "u64")
        }
        KeyKind::Str { bytes_max } => {
            if q.key.len() > bytes_max as usize {
                return Err(LookupError::KeyLength { group: g.name.clone(), bytes_max, len: q.key.len() });
            }
            (handle.read_linked_into(key_hash(&q.key), &q.key, &mut row, &mut link), "string")
        }
    };
    let feast_view = handle.link_kind().is_some() && g.child.is_none() && g.ttl_s > 0;
    let event_unix_s = crate::features::feast::rows::row_time_s(&link);
    let now_s = MonotonicClock::new().unix_s();
    let expired = feast_view && event_unix_s != 0 && event_unix_s < now_s.saturating_sub(g.ttl_s);
    if expired {
        row.fill(f32::NAN);
    }
    let parent_group = groups.iter().find(|p| p.child.as_deref() == Some(g.name.as_str()));
    let parent = handle.link_kind().zip(parent_group).map(|(kind, p)| {
        let mut buf = [0u8; KEY_BYTES_MAX as usize];
        let key = decode_link(&link, kind, &mut buf).map(|k| k.to_string());
        ParentLink { group: p.name.clone(), key }
    });
    let table = handle.load();
    let status = readiness.feed().and_then(|f| f.group(&g.name));
    let (staleness_ms, change_unix_ms, seq) = match status {
        Some(s) => {
            let now_ns = MonotonicClock::new().now_ns();
            (Some(s.staleness_ns(now_ns) / 1_000_000), s.change_unix_ms.load(Relaxed), s.applied_seq.load(Relaxed))
        }
        None => {
            let c = table.cursor_at_open();
            (None, c.change_unix_ms, c.seq)
        }
    };
    let key_hex = std::str::from_utf8(&q.key).is_err().then(|| q.key.iter().map(|b| format!("{b:02x}")).collect());
    Ok(FeatureRow {
        group: g.name.clone(),
        key: String::from_utf8_lossy(&q.key).into_owned(),
        key_hex,
        key_type,
        found,
        row,
        parent,
        event_unix_s: (feast_view && event_unix_s != 0).then_some(event_unix_s),
        expired,
        width: handle.dim(),
        storage: table.storage(),
        scope: g.scope,
        absent: g.absent,
        follows_redis: status.is_some(),
        staleness_ms,
        group_change_unix_ms: (change_unix_ms != 0).then_some(change_unix_ms),
        group_applied_seq: seq,
        note: TIME_NOTE,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_percent_decoded_within_the_limit() {
        let q = parse("device", "x=1&key=a%2Fb+c%00").unwrap();
        assert_eq!(q, RowQuery { group: "device".into(), key: b"a/b+c\0".to_vec() });
        assert_eq!(parse("user", "key=42").unwrap().key, b"42");
        assert!(parse("user", "").unwrap_err().starts_with("no key"));
        assert!(parse("user", "key=").unwrap_err().starts_with("an empty key"));
        assert!(parse("user", "key=1&key=2").unwrap_err().starts_with("key given twice"));
        assert!(parse("user", "key=%4").is_err() && parse("user", "key=%zz").is_err());
        assert!(parse("", "key=1").is_err() && parse(&"g".repeat(17), "key=1").is_err());
        let longest = "k".repeat(KEY_BYTES_MAX as usize);
        assert_eq!(parse("d", &format!("key={longest}")).unwrap().key.len(), 64);
        assert!(parse("d", &format!("key={longest}k")).unwrap_err().contains("at most 64 bytes"));
        assert!(parse("d", &format!("key={}", "%41".repeat(65))).is_err());
    }
}
