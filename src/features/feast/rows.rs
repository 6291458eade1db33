//! One entity's Feast hash as the rows Quiver serves, shared by the first
//! sync ([`super::copy`]) and the follower ([`super::follow`]), so that a row
//! copied and a row updated in place are read by one rule:
//!
//! - which served entity a Redis key is ([`Entities::classify`]);
//! - a pipeline of HGETALL, each reply a hash or why it is bad data
//!   ([`read_hashes`]);
//! - a hash split into one row per served view of its entity, with each
//!   view's event time ([`Entities::split`]).
//!
//! Each row's event time (`_ts:<view>`, whole Unix seconds) is kept in the
//! row itself, in the replica's link words (a Feast view has no parent, so
//! its rows' links are free): a row "linked" to `Id(ts)` was written at
//! `ts`. Serving reads it to serve a row past its view's `ttl` as missing,
//! and the reconciliation compares it with Redis's `_ts:` field, so the
//! follower needs no table of its own for either.

use std::collections::HashMap;

use super::redis_layout::{self, EntityCodec, KeyError, HASH_FIELDS_MAX};
use super::repo::{FeastRepo, Plan};
use super::store::Store;
use super::FeastError;
use crate::features::feed::{RedisError, Reply};
use crate::features::replica::{EntityKey, EntityKeyBuf, KeyKind};

/// The link kind a Feast view's file is written with: each row's link
/// holds its event time as `Id(unix seconds)`.
pub const ROW_TIME_LINK: KeyKind = KeyKind::U64;

/// A row's event time as its link names it (none: no time known).
pub fn row_time_link(ts_unix_s: i64) -> Option<EntityKey<'static>> {
    u64::try_from(ts_unix_s).ok().filter(|&t| t > 0).map(EntityKey::Id)
}

/// The event time in a row's link words (as `decode_link` lays a u64 key
/// out: a presence word, then the low and high halves); 0 when none.
#[inline]
pub fn row_time_s(link: &[u32]) -> u64 {
    match link {
        [1, lo, hi, ..] => u64::from(*lo) | u64::from(*hi) << 32,
        _ => 0,
    }
}

/// A digest of what the files of `plan` mean: the project, the key
/// serialization and, per view, its key type and its features in order.
/// The first sync records it in each file's checkpoint (its `epoch`); a
/// file that names another was written for other definitions and is
/// copied again rather than resumed.
pub fn plan_digest(repo: &FeastRepo, plan: &Plan) -> u64 {
    let mut text = format!("feast 1|{}|v{}", repo.project, repo.key_version.number());
    for v in &plan.views {
        // One join key: `name:key:type`, as files written before composite
        // keys name it; several: their names, then their types.
        let types: Vec<&str> = v.join_keys.iter().map(|(_, t)| t.name()).collect();
        text.push_str(&format!("|{}:{}:{}", v.name, v.join_key, types.join(",")));
        for f in &v.features {
            text.push_str(&format!(",{}:{}", f.name, f.kind.name()));
        }
    }
    crate::features::replica::key_hash(text.as_bytes())
}

/// One served entity (or, for a composite key, one combination of
/// entities: the views keyed by the same join keys share its hashes): how
/// its keys read, the views it feeds (indices into the plan's views), and
/// each hash field's (view, column).
pub struct Entity {
    pub codec: EntityCodec,
    pub views: Vec<usize>,
    fields: HashMap<[u8; 4], (usize, usize)>,
}

/// What a Redis key is to the served views.
pub enum Claim {
    /// A key of entity `.0`.
    Of(usize, EntityKeyBuf),
    /// A key that starts as entity `.0`'s do but is none (bad data).
    Bad(usize, KeyError),
    /// No served entity's (another entity of the project, another project).
    Other,
}

/// What one entity's hash holds for one of its views.
#[derive(Clone, Debug, PartialEq)]
pub enum Split {
    /// Neither the view's `_ts:` field nor any of its features: no row.
    Absent,
    /// A row (in the caller's row buffer), with its event time (0: none).
    Row { ts_unix_s: i64 },
    /// Bad data: the row is skipped, for this reason; with the view's event
    /// time when it read (0: none).
    Bad { why: String, ts_unix_s: i64 },
}

/// Every served entity of a plan, and each view's `_ts:` field.
pub struct Entities {
    pub entities: Vec<Entity>,
    ts_fields: Vec<Vec<u8>>,
    feature_names: Vec<Vec<String>>,
}

impl Entities {
    pub fn new(repo: &FeastRepo, plan: &Plan) -> Entities {
        let mut entities: Vec<Entity> = Vec::new();
        for (at, view) in plan.views.iter().enumerate() {
            let i = match entities.iter().position(|e| e.codec.join_key == view.join_key) {
                Some(i) => i,
                None => {
                    let codec = EntityCodec::composite(&view.join_keys, repo.key_version, &repo.project);
                    entities.push(Entity { codec, views: Vec::new(), fields: HashMap::new() });
                    entities.len() - 1
                }
            };
            let entity = &mut entities[i];
            entity.views.push(at);
            for (column, f) in view.features.iter().enumerate() {
                entity.fields.insert(redis_layout::field_name(&view.name, &f.name), (at, column));
            }
        }
        Entities {
            entities,
            ts_fields: plan.views.iter().map(|v| redis_layout::ts_field(&v.name)).collect(),
            feature_names: plan.views.iter().map(|v| v.features.iter().map(|f| f.name.clone()).collect()).collect(),
        }
    }

    /// Which entity `key` is.
    pub fn classify(&self, key: &[u8]) -> Claim {
        let mut claimed = None;
        for (i, entity) in self.entities.iter().enumerate().filter(|(_, e)| e.codec.claims(key)) {
            match entity.codec.parse(key) {
                Ok(k) => return Claim::Of(i, k),
                Err(e) => claimed = claimed.or(Some((i, e))),
            }
        }
        match claimed {
            Some((i, e)) => Claim::Bad(i, e),
            None => Claim::Other,
        }
    }

    /// View `view`'s `_ts:` field.
    pub fn ts_field(&self, view: usize) -> &[u8] {
        &self.ts_fields[view]
    }

    /// Splits entity `entity`'s hash (`pairs`: field, value, ...) into a row
    /// per view of the entity: each into `rows[view]` (NaN where a feature
    /// is null or absent), and what it came to into `out[view]`.
    pub fn split(&self, entity: usize, pairs: &[Reply], rows: &mut [Vec<f32>], out: &mut [Split]) {
        let entity = &self.entities[entity];
        for &v in &entity.views {
            rows[v].fill(f32::NAN);
            out[v] = Split::Absent;
        }
        let mut bad: Vec<(usize, String)> = Vec::new();
        let note = |v: usize, why: String, bad: &mut Vec<(usize, String)>| {
            if !bad.iter().any(|(b, _)| *b == v) {
                bad.push((v, why));
            }
        };
        for pair in pairs.chunks_exact(2) {
            let (Some(field), Some(value)) = (pair[0].as_bytes(), pair[1].as_bytes()) else {
                continue;
            };
            if let Ok(name) = <[u8; 4]>::try_from(field) {
                if let Some(&(v, column)) = entity.fields.get(&name) {
                    if out[v] == Split::Absent {
                        out[v] = Split::Row { ts_unix_s: 0 };
                    }
                    match redis_layout::value_f32(value) {
                        Ok(Some(x)) => rows[v][column] = x,
                        Ok(None) => {}
                        Err(e) => note(v, format!("feature '{}': {e}", self.feature_names[v][column]), &mut bad),
                    }
                    continue;
                }
            }
            for &v in &entity.views {
                if field == self.ts_fields[v].as_slice() {
                    match redis_layout::ts_unix_s(value) {
                        Ok(ts) => out[v] = Split::Row { ts_unix_s: ts },
                        Err(e) => {
                            out[v] = Split::Row { ts_unix_s: 0 };
                            note(v, format!("its _ts: field: {e}"), &mut bad);
                        }
                    }
                }
            }
        }
        for (v, why) in bad {
            let ts_unix_s = match out[v] {
                Split::Row { ts_unix_s } => ts_unix_s,
                _ => 0,
            };
            out[v] = Split::Bad { why, ts_unix_s };
        }
    }
}

/// What HGETALL of one key returned.
pub enum Hash {
    /// The hash's fields and values (empty: the key is gone).
    Pairs(Vec<Reply>),
    /// Bad data: not a hash, or a hash past [`HASH_FIELDS_MAX`] fields.
    Bad(String),
}

/// Reads `keys` with one pipeline of HGETALL (per node, on a cluster).
pub fn read_hashes(store: &mut Store, keys: &[&[u8]]) -> Result<Vec<Hash>, FeastError> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let commands: Vec<(Vec<u8>, Vec<Vec<u8>>)> =
        keys.iter().map(|k| (k.to_vec(), vec![b"HGETALL".to_vec(), k.to_vec()])).collect();
    let replies = store.pipeline(&commands)?;
    if replies.len() != keys.len() {
        return Err(FeastError::Reply {
            command: "HGETALL",
            what: format!("{} replies to {} commands", replies.len(), keys.len()),
        });
    }
    replies
        .into_iter()
        .map(|reply| match reply {
            Reply::Array(pairs) if pairs.len() / 2 > HASH_FIELDS_MAX || pairs.len() % 2 != 0 => {
                Ok(Hash::Bad(format!("{} hash fields, past the {HASH_FIELDS_MAX} read", pairs.len() / 2)))
            }
            Reply::Array(pairs) => Ok(Hash::Pairs(pairs)),
            Reply::Error(message) if message.starts_with("WRONGTYPE") => Ok(Hash::Bad("not a hash".into())),
            Reply::Error(message) => Err(FeastError::Redis(RedisError::Server { addr: store.addr(), message })),
            other => Err(FeastError::Reply { command: "HGETALL", what: format!("{other:?}") }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::features::replica::encode_link;

    #[test]
    fn a_row_time_reads_back_from_its_link_words() {
        let mut words = [0u32; 3];
        encode_link(row_time_link(1_796_457_600), &mut words);
        assert_eq!(row_time_s(&words), 1_796_457_600);
        encode_link(row_time_link(0), &mut words);
        assert_eq!(row_time_s(&words), 0);
        assert!(row_time_link(-5).is_none());
        assert_eq!(row_time_s(&[]), 0);
    }
}
