//! Feast's Redis online store layout, read exactly as Feast 0.67 writes it
//! (`feast/infra/online_stores/redis.py`, `feast/infra/key_encoding_utils.py`):
//!
//! - one hash per entity: its key is the serialized entity key followed by
//!   the project's name. Version 3 (Feast's default) writes the number of
//!   join keys, then each join key as `u32 type (STRING) | u32 length |
//!   bytes`, then each value as `u32 type | u32 length | bytes`, all little
//!   endian; version 2 writes neither the count nor the join key's length
//!   (feast #5357), so a join key that is another's prefix (`user`,
//!   `user_id`) is told apart by parsing the rest exactly. A view of
//!   several entities is keyed by all their join keys: Feast sorts them by
//!   name and writes each name, then each value, in that order; Quiver
//!   keys such a view's group by one string, the values' canonical text
//!   ([`composite_text`]: `m-1|23758` for merchant `m-1` and user 23758).
//! - every view of that entity writes into the same hash: a feature's field
//!   is MurmurHash3 (x86, 32 bits, seed 0) of `view:feature` as 4 bytes
//!   little endian; its value a serialized `feast.types.Value`;
//!   `_ts:<view>` holds the view's event time as a `google.protobuf.Timestamp`.
//!
//! Values become f32 by one rule (docs/FEATURES.md, "Feast"): float, double,
//! int32 and int64 to the nearest f32, bool to 1 or 0; an empty value, a
//! null and an absent field are missing (NaN). Anything else is bad data,
//! reported, never guessed.

use protobuf::{Message, MessageFull};

use super::protos::Value::value::Val;
use super::protos::Value::Value;
use crate::features::replica::{EntityKeyBuf, KEY_BYTES_MAX};

/// Feast's `ValueType` numbers that appear in serialized entity keys.
const TYPE_STRING: u32 = 2;
const TYPE_INT32: u32 = 3;
const TYPE_INT64: u32 = 4;

/// The longest Redis key read as an entity key: Feast's keys are the join
/// key's name, the value and the project, a few dozen bytes; a longer key
/// is no entity of a served view.
pub const REDIS_KEY_BYTES_MAX: usize = 1024;

/// The most fields one entity's hash may have to be read: every feature of
/// every view of the entity, and each view's `_ts:` field. A replica row is
/// at most 4096 floats; a hash past this is bad data, skipped whole.
pub const HASH_FIELDS_MAX: usize = 16_384;

/// The largest value decoded: a scalar `Value` is at most 11 bytes; lists
/// and strings (refused kinds) are longer, and are reported, not decoded.
pub const VALUE_BYTES_MAX: usize = 64;

/// Feast's `entity_key_serialization_version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyVersion {
    V2,
    V3,
}

impl KeyVersion {
    pub fn number(self) -> u32 {
        match self {
            KeyVersion::V2 => 2,
            KeyVersion::V3 => 3,
        }
    }
}

/// A join key's Feast type, and the group key it becomes: int64 and int32
/// ids a u64 key (a negative id by its two's complement, as `i64 as u64`),
/// a string its bytes (up to `bytes_max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JoinKeyType {
    Int64,
    Int32,
    String { bytes_max: u32 },
}

impl JoinKeyType {
    pub fn name(self) -> &'static str {
        match self {
            JoinKeyType::Int64 => "int64",
            JoinKeyType::Int32 => "int32",
            JoinKeyType::String { .. } => "string",
        }
    }
}

/// Why a Redis key that looked like one of an entity's is not.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the key is {0} bytes, past the {REDIS_KEY_BYTES_MAX} read")]
    TooLong(usize),
    #[error("the entity value is cut short")]
    Truncated,
    #[error("the entity value has type {found}, the join key is {expected}")]
    ValueType { found: u32, expected: &'static str },
    #[error("the entity value is {0} bytes, not {1}")]
    ValueLength(u32, u32),
    #[error("a string key of {bytes} bytes is past the group's {bytes_max}")]
    StringTooLong { bytes: usize, bytes_max: u32 },
    #[error("the key names another project")]
    OtherProject,
    #[error("not a composite key's canonical text: {0}")]
    NotComposite(&'static str),
}

/// How one entity's Redis keys are written: its join keys (several for a
/// view of several entities: a composite key), their types, the
/// serialization version and the project.
#[derive(Clone, Debug)]
pub struct EntityCodec {
    /// The join keys' names in Feast's order (ascending), comma-separated.
    pub join_key: String,
    /// The group key an entity becomes: the one join key's type, or for a
    /// composite key a string of at most [`KEY_BYTES_MAX`] bytes (its
    /// canonical text, [`composite_text`]).
    pub key: JoinKeyType,
    pub version: KeyVersion,
    /// Each join key and its type, in Feast's order.
    parts: Vec<(String, JoinKeyType)>,
    project: Vec<u8>,
    /// The key's bytes before the entity values.
    prefix: Vec<u8>,
}

/// The separator of a composite key's parts in its canonical text, and the
/// escape that lets a string part hold it (`\|`) or itself (`\\`).
pub const COMPOSITE_SEPARATOR: u8 = b'|';
pub const COMPOSITE_ESCAPE: u8 = b'\\';

/// A composite key's canonical text, the string key its group is keyed
/// by: the parts in the order of their join keys' names (ascending bytes,
/// the order Feast serializes them in), joined by `|`; an integer as its
/// signed decimal, a string as its UTF-8 bytes with `\` and `|` escaped by
/// a `\`. `user_id` 23758 and `merchant_id` `m-1` are `m-1|23758`.
pub fn composite_text(parts: &[CompositePart<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(COMPOSITE_SEPARATOR);
        }
        match part {
            CompositePart::Int(x) => out.extend_from_slice(x.to_string().as_bytes()),
            CompositePart::Str(bytes) => {
                for &b in *bytes {
                    if b == COMPOSITE_SEPARATOR || b == COMPOSITE_ESCAPE {
                        out.push(COMPOSITE_ESCAPE);
                    }
                    out.push(b);
                }
            }
        }
    }
    out
}

/// One part of a composite key's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompositePart<'a> {
    Int(i64),
    Str(&'a [u8]),
}

/// A composite key's canonical text split into its parts' bytes
/// (unescaped), or `None` when it is not one `composite_text` writes.
pub fn split_composite(text: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut parts = vec![Vec::new()];
    let mut bytes = text.iter();
    while let Some(&b) = bytes.next() {
        match b {
            COMPOSITE_ESCAPE => match bytes.next() {
                Some(&e) if e == COMPOSITE_SEPARATOR || e == COMPOSITE_ESCAPE => parts.last_mut()?.push(e),
                _ => return None,
            },
            COMPOSITE_SEPARATOR => parts.push(Vec::new()),
            _ => parts.last_mut()?.push(b),
        }
    }
    Some(parts)
}

impl EntityCodec {
    /// The codec of an entity of one join key.
    pub fn new(join_key: &str, key: JoinKeyType, version: KeyVersion, project: &str) -> EntityCodec {
        EntityCodec::composite(&[(join_key.to_string(), key)], version, project)
    }

    /// The codec of the entities of a view keyed by `parts` (join key and
    /// type, in any order; one part: [`EntityCodec::new`]'s).
    pub fn composite(parts: &[(String, JoinKeyType)], version: KeyVersion, project: &str) -> EntityCodec {
        let mut parts = parts.to_vec();
        // Feast sorts (join key, value) pairs: by the names' code points,
        // which is their UTF-8 bytes' order.
        parts.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let mut prefix = Vec::with_capacity(4 + parts.iter().map(|p| 8 + p.0.len()).sum::<usize>());
        if version == KeyVersion::V3 {
            prefix.extend_from_slice(&(parts.len() as u32).to_le_bytes());
        }
        for (name, _) in &parts {
            prefix.extend_from_slice(&TYPE_STRING.to_le_bytes());
            if version == KeyVersion::V3 {
                prefix.extend_from_slice(&(name.len() as u32).to_le_bytes());
            }
            prefix.extend_from_slice(name.as_bytes());
        }
        let key = match parts.as_slice() {
            [(_, one)] => *one,
            _ => JoinKeyType::String { bytes_max: KEY_BYTES_MAX },
        };
        EntityCodec {
            join_key: parts.iter().map(|p| p.0.as_str()).collect::<Vec<_>>().join(","),
            key,
            version,
            parts,
            project: project.as_bytes().to_vec(),
            prefix,
        }
    }

    /// The join keys and their types, in Feast's order.
    pub fn parts(&self) -> &[(String, JoinKeyType)] {
        &self.parts
    }

    /// Whether the entity is keyed by several join keys.
    pub fn is_composite(&self) -> bool {
        self.parts.len() > 1
    }

    /// The Redis key of entity `key` (for a composite key, its canonical
    /// text), as Feast writes it.
    pub fn redis_key(&self, key: &EntityKeyBuf) -> Result<Vec<u8>, KeyError> {
        let mut out = self.prefix.clone();
        let mut value = |kind: JoinKeyType, key: &EntityKeyBuf| -> Result<(), KeyError> {
            let (t, bytes): (u32, Vec<u8>) = match (kind, key) {
                (JoinKeyType::Int64, EntityKeyBuf::Id(id)) => (TYPE_INT64, id.to_le_bytes().to_vec()),
                (JoinKeyType::Int32, EntityKeyBuf::Id(id)) => (TYPE_INT32, (*id as i64 as i32).to_le_bytes().to_vec()),
                (JoinKeyType::String { .. }, EntityKeyBuf::Id(id)) => (TYPE_STRING, id.to_string().into_bytes()),
                (JoinKeyType::String { .. }, EntityKeyBuf::Str(s)) => (TYPE_STRING, s.clone()),
                (_, EntityKeyBuf::Str(_)) => return Err(KeyError::NotComposite("a string for an integer join key")),
            };
            out.extend_from_slice(&t.to_le_bytes());
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(&bytes);
            Ok(())
        };
        match (self.parts.as_slice(), key) {
            ([(_, kind)], key) => value(*kind, key)?,
            (parts, EntityKeyBuf::Str(text)) => {
                let values =
                    split_composite(text).ok_or(KeyError::NotComposite("an escape that is not \\\\ or \\|"))?;
                if values.len() != parts.len() {
                    return Err(KeyError::NotComposite("another number of parts than the view has join keys"));
                }
                for ((_, kind), v) in parts.iter().zip(values) {
                    let part = match kind {
                        JoinKeyType::String { .. } => EntityKeyBuf::Str(v),
                        JoinKeyType::Int64 | JoinKeyType::Int32 => {
                            let text = std::str::from_utf8(&v)
                                .map_err(|_| KeyError::NotComposite("a non-decimal integer part"))?;
                            let n: i64 =
                                text.parse().map_err(|_| KeyError::NotComposite("a non-decimal integer part"))?;
                            if *kind == JoinKeyType::Int32 && i32::try_from(n).is_err() {
                                return Err(KeyError::NotComposite("an int32 part out of its range"));
                            }
                            EntityKeyBuf::Id(n as u64)
                        }
                    };
                    value(*kind, &part)?;
                }
            }
            (_, EntityKeyBuf::Id(_)) => return Err(KeyError::NotComposite("an integer for a composite key")),
        }
        out.extend_from_slice(&self.project);
        Ok(out)
    }

    /// Whether `key` starts as this entity's keys do: `parse` then says
    /// whether it is one.
    pub fn claims(&self, key: &[u8]) -> bool {
        key.starts_with(&self.prefix)
    }

    /// The group key of Redis key `key`, one this codec `claims`: the one
    /// join key's value, or a composite key's canonical text.
    pub fn parse(&self, key: &[u8]) -> Result<EntityKeyBuf, KeyError> {
        if key.len() > REDIS_KEY_BYTES_MAX {
            return Err(KeyError::TooLong(key.len()));
        }
        let mut rest = key.strip_prefix(self.prefix.as_slice()).ok_or(KeyError::Truncated)?;
        let word = |b: &[u8]| -> Option<u32> { Some(u32::from_le_bytes(b.get(..4)?.try_into().ok()?)) };
        let mut values = Vec::with_capacity(self.parts.len());
        for (_, kind) in &self.parts {
            let found = word(rest).ok_or(KeyError::Truncated)?;
            let len = word(&rest[4..]).ok_or(KeyError::Truncated)?;
            let value = rest.get(8..8 + len as usize).ok_or(KeyError::Truncated)?;
            rest = &rest[8 + len as usize..];
            values.push(parse_value(*kind, found, len, value)?);
        }
        if rest != self.project.as_slice() {
            return Err(KeyError::OtherProject);
        }
        if !self.is_composite() {
            return values.pop().ok_or(KeyError::Truncated);
        }
        let parts: Vec<CompositePart<'_>> = values
            .iter()
            .map(|v| match v {
                EntityKeyBuf::Id(id) => CompositePart::Int(*id as i64),
                EntityKeyBuf::Str(s) => CompositePart::Str(s),
            })
            .collect();
        let text = composite_text(&parts);
        if text.len() > KEY_BYTES_MAX as usize {
            return Err(KeyError::StringTooLong { bytes: text.len(), bytes_max: KEY_BYTES_MAX });
        }
        Ok(EntityKeyBuf::Str(text))
    }
}

/// One join key's value (type `found`, `len` bytes) as the join key of
/// type `kind` reads it.
fn parse_value(kind: JoinKeyType, found: u32, len: u32, value: &[u8]) -> Result<EntityKeyBuf, KeyError> {
    match kind {
        JoinKeyType::Int64 if found == TYPE_INT64 => match <[u8; 8]>::try_from(value) {
            Ok(b) => Ok(EntityKeyBuf::Id(i64::from_le_bytes(b) as u64)),
            Err(_) => Err(KeyError::ValueLength(len, 8)),
        },
        JoinKeyType::Int32 if found == TYPE_INT32 => match <[u8; 4]>::try_from(value) {
            Ok(b) => Ok(EntityKeyBuf::Id(i64::from(i32::from_le_bytes(b)) as u64)),
            Err(_) => Err(KeyError::ValueLength(len, 4)),
        },
        JoinKeyType::String { bytes_max } if found == TYPE_STRING => {
            if value.len() > bytes_max as usize {
                return Err(KeyError::StringTooLong { bytes: value.len(), bytes_max });
            }
            Ok(EntityKeyBuf::Str(value.to_vec()))
        }
        _ => Err(KeyError::ValueType { found, expected: kind.name() }),
    }
}

/// The hash field Feast stores `view`'s `feature` under.
pub fn field_name(view: &str, feature: &str) -> [u8; 4] {
    let text = format!("{view}:{feature}");
    let hash =
        murmur3::murmur3_32(&mut std::io::Cursor::new(text.as_bytes()), 0).expect("reading from memory cannot fail");
    hash.to_le_bytes()
}

/// The hash field of `view`'s event time.
pub fn ts_field(view: &str) -> Vec<u8> {
    format!("_ts:{view}").into_bytes()
}

/// Why a stored value is not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("{0} bytes, past the {VALUE_BYTES_MAX} a number takes")]
    TooLong(usize),
    #[error("not a feast.types.Value: {0}")]
    Undecodable(String),
    #[error("a {0} value: only float, double, int32, int64 and bool are served")]
    Unserved(&'static str),
}

/// A stored `feast.types.Value` as the f32 served: `None` for missing
/// (empty, or a null).
pub fn value_f32(bytes: &[u8]) -> Result<Option<f32>, ValueError> {
    if bytes.len() > VALUE_BYTES_MAX {
        return Err(ValueError::TooLong(bytes.len()));
    }
    super::group_guard::check(bytes, &Value::descriptor()).map_err(ValueError::Undecodable)?;
    let value = Value::parse_from_bytes(bytes).map_err(|e| ValueError::Undecodable(e.to_string()))?;
    Ok(match value.val {
        None | Some(Val::NullVal(_)) => None,
        Some(Val::FloatVal(x)) => Some(x),
        Some(Val::DoubleVal(x)) => Some(x as f32),
        Some(Val::Int32Val(x)) => Some(x as f32),
        Some(Val::Int64Val(x)) => Some(x as f32),
        Some(Val::BoolVal(x)) => Some(if x { 1.0 } else { 0.0 }),
        Some(other) => return Err(ValueError::Unserved(kind_name(&other))),
    })
}

fn kind_name(v: &Val) -> &'static str {
    match v {
        Val::BytesVal(_) => "bytes",
        Val::StringVal(_) => "string",
        Val::UnixTimestampVal(_) => "unix timestamp",
        _ => "list, set, map or other non-scalar",
    }
}

/// A stored `_ts:` field as Unix seconds (the Timestamp's whole seconds).
pub fn ts_unix_s(bytes: &[u8]) -> Result<i64, ValueError> {
    if bytes.len() > VALUE_BYTES_MAX {
        return Err(ValueError::TooLong(bytes.len()));
    }
    use protobuf::well_known_types::timestamp::Timestamp;
    super::group_guard::check(bytes, &Timestamp::descriptor()).map_err(ValueError::Undecodable)?;
    Timestamp::parse_from_bytes(bytes).map(|t| t.seconds).map_err(|e| ValueError::Undecodable(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// What Python's `feast.infra.online_stores.helpers._mmh3` (mmh3 5.3.1)
    /// returned for these, computed with feast 0.67.0.
    #[test]
    fn field_names_match_feasts_mmh3() {
        assert_eq!(field_name("user_stats", "us_f32_0"), hex("7b89c527")[..]);
        assert_eq!(field_name("item_attrs", "it_i32_3"), hex("d45e38d2")[..]);
        assert_eq!(field_name("merchant_risk", "mr_f64_1"), hex("00f07a6a")[..]);
        assert_eq!(field_name("é", "ü"), hex("88c59959")[..]);
        assert_eq!(ts_field("user_stats"), b"_ts:user_stats");
    }

    /// Keys `feast.infra.online_stores.helpers._redis_key("proj", ...)`
    /// wrote with feast 0.67.0, in both serialization versions.
    #[test]
    fn keys_match_feasts_in_both_versions() {
        let cases = [
            (
                KeyVersion::V2,
                "user_id",
                JoinKeyType::Int64,
                "02000000757365725f69640400000008000000fbffffffffffffff70726f6a",
                EntityKeyBuf::Id(-5i64 as u64),
            ),
            (
                KeyVersion::V3,
                "user_id",
                JoinKeyType::Int64,
                "010000000200000007000000757365725f69640400000008000000fbffffffffffffff70726f6a",
                EntityKeyBuf::Id(-5i64 as u64),
            ),
            (
                KeyVersion::V2,
                "merchant_id",
                JoinKeyType::String { bytes_max: 64 },
                "020000006d65726368616e745f696402000000040000006d2dc3a970726f6a",
                EntityKeyBuf::Str("m-é".as_bytes().to_vec()),
            ),
            (
                KeyVersion::V3,
                "merchant_id",
                JoinKeyType::String { bytes_max: 64 },
                "01000000020000000b0000006d65726368616e745f696402000000040000006d2dc3a970726f6a",
                EntityKeyBuf::Str("m-é".as_bytes().to_vec()),
            ),
            (
                KeyVersion::V2,
                "shop",
                JoinKeyType::Int32,
                "0200000073686f7003000000040000000700000070726f6a",
                EntityKeyBuf::Id(7),
            ),
            (
                KeyVersion::V3,
                "shop",
                JoinKeyType::Int32,
                "01000000020000000400000073686f7003000000040000000700000070726f6a",
                EntityKeyBuf::Id(7),
            ),
        ];
        for (version, join_key, key, stored, want) in cases {
            let codec = EntityCodec::new(join_key, key, version, "proj");
            let stored = hex(stored);
            assert!(codec.claims(&stored));
            assert_eq!(codec.parse(&stored), Ok(want.clone()), "{join_key} v{}", version.number());
            assert_eq!(codec.redis_key(&want), Ok(stored));
        }
    }

    /// Composite keys `_redis_key("proj", EntityKey(join_keys=...))` wrote
    /// with feast 0.67.0 (join keys given out of order: Feast sorts them),
    /// in both versions, and their canonical text.
    #[test]
    fn composite_keys_match_feasts_in_both_versions() {
        let s = JoinKeyType::String { bytes_max: 64 };
        let user_merchant = vec![("user_id".to_string(), JoinKeyType::Int64), ("merchant_id".to_string(), s)];
        let three = vec![
            ("shop".to_string(), JoinKeyType::Int32),
            ("user_id".to_string(), JoinKeyType::Int64),
            ("b".to_string(), s),
        ];
        let cases = [
            (KeyVersion::V2, &user_merchant, "020000006d65726368616e745f696402000000757365725f696402000000070000006d2dc3a97c785c0400000008000000fbffffffffffffff70726f6a", "m-é\\|x\\\\|-5"),
            (KeyVersion::V3, &user_merchant, "02000000020000000b0000006d65726368616e745f69640200000007000000757365725f696402000000070000006d2dc3a97c785c0400000008000000fbffffffffffffff70726f6a", "m-é\\|x\\\\|-5"),
            (KeyVersion::V2, &three, "02000000620200000073686f7002000000757365725f696402000000000000000300000004000000070000000400000008000000ce5c00000000000070726f6a", "|7|23758"),
            (KeyVersion::V3, &three, "03000000020000000100000062020000000400000073686f700200000007000000757365725f696402000000000000000300000004000000070000000400000008000000ce5c00000000000070726f6a", "|7|23758"),
        ];
        for (version, parts, stored, text) in cases {
            let codec = EntityCodec::composite(parts, version, "proj");
            assert!(codec.is_composite());
            assert_eq!(codec.key, JoinKeyType::String { bytes_max: KEY_BYTES_MAX });
            let stored = hex(stored);
            let want = EntityKeyBuf::Str(text.as_bytes().to_vec());
            assert!(codec.claims(&stored));
            assert_eq!(codec.parse(&stored), Ok(want.clone()), "{} v{}", codec.join_key, version.number());
            assert_eq!(codec.redis_key(&want), Ok(stored));
        }
        assert_eq!(EntityCodec::composite(&user_merchant, KeyVersion::V3, "p").join_key, "merchant_id,user_id");
        // A single-key entity's codec is not one of its composites': the
        // count (v3) or the names (v2) differ.
        let user = EntityCodec::new("user_id", JoinKeyType::Int64, KeyVersion::V2, "proj");
        assert!(!user.claims(&hex(cases[0].2)));
    }

    #[test]
    fn composite_text_escapes_and_splits_back() {
        let parts = [CompositePart::Str(b"a|b\\c"), CompositePart::Int(-7), CompositePart::Str(b"")];
        let text = composite_text(&parts);
        assert_eq!(text, b"a\\|b\\\\c|-7|");
        assert_eq!(split_composite(&text), Some(vec![b"a|b\\c".to_vec(), b"-7".to_vec(), Vec::new()]));
        assert_eq!(split_composite(b"a\\x"), None);
        assert_eq!(split_composite(b"a\\"), None);
        let s = JoinKeyType::String { bytes_max: 64 };
        let codec =
            EntityCodec::composite(&[("a".to_string(), s), ("b".to_string(), JoinKeyType::Int32)], KeyVersion::V3, "p");
        let bad = |t: &str| codec.redis_key(&EntityKeyBuf::Str(t.as_bytes().to_vec())).unwrap_err();
        assert!(matches!(bad("x"), KeyError::NotComposite(_)));
        assert!(matches!(bad("x|1|2"), KeyError::NotComposite(_)));
        assert!(matches!(bad("x|y"), KeyError::NotComposite(_)));
        assert!(matches!(bad("x|4294967296"), KeyError::NotComposite(_)));
        assert!(matches!(codec.redis_key(&EntityKeyBuf::Id(1)), Err(KeyError::NotComposite(_))));
        // A key whose canonical text is past the replica's string keys: bad data.
        let long = "x".repeat(63);
        let stored = codec.redis_key(&EntityKeyBuf::Str(format!("{long}|1").into_bytes())).unwrap();
        assert_eq!(codec.parse(&stored), Err(KeyError::StringTooLong { bytes: 65, bytes_max: KEY_BYTES_MAX }));
        for cut in 0..stored.len() {
            assert!(codec.parse(&stored[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn keys_of_other_projects_entities_and_shapes_are_refused() {
        let user = EntityCodec::new("user_id", JoinKeyType::Int64, KeyVersion::V2, "proj");
        let mut key = user.redis_key(&EntityKeyBuf::Id(9)).unwrap();
        key.extend_from_slice(b"x");
        assert_eq!(user.parse(&key), Err(KeyError::OtherProject));
        // In version 2, "user" is a prefix of "user_id": the rest does not parse.
        let short = EntityCodec::new("user", JoinKeyType::Int64, KeyVersion::V2, "proj");
        let stored = user.redis_key(&EntityKeyBuf::Id(9)).unwrap();
        assert!(short.claims(&stored) && short.parse(&stored).is_err());
        let item = EntityCodec::new("item_id", JoinKeyType::Int64, KeyVersion::V3, "proj");
        assert!(!item.claims(&user.redis_key(&EntityKeyBuf::Id(9)).unwrap()));
        let s = EntityCodec::new("item_id", JoinKeyType::String { bytes_max: 4 }, KeyVersion::V3, "proj");
        let long = s.redis_key(&EntityKeyBuf::Str(b"abcde".to_vec())).unwrap();
        assert_eq!(s.parse(&long), Err(KeyError::StringTooLong { bytes: 5, bytes_max: 4 }));
        let as_int = item.redis_key(&EntityKeyBuf::Id(1)).unwrap();
        let wrong = EntityCodec::new("item_id", JoinKeyType::String { bytes_max: 64 }, KeyVersion::V3, "proj");
        assert_eq!(wrong.parse(&as_int), Err(KeyError::ValueType { found: 4, expected: "string" }));
        for cut in 0..as_int.len() {
            assert!(item.parse(&as_int[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(item.parse(&vec![b'k'; 2000]), Err(KeyError::TooLong(2000)));
    }

    #[test]
    fn values_become_f32_by_the_documented_rule() {
        let enc = |v: Val| {
            let mut m = Value::new();
            m.val = Some(v);
            m.write_to_bytes().unwrap()
        };
        assert_eq!(value_f32(&enc(Val::FloatVal(1.5))), Ok(Some(1.5)));
        assert_eq!(value_f32(&enc(Val::DoubleVal(1.0 / 3.0))), Ok(Some((1.0f64 / 3.0) as f32)));
        assert_eq!(value_f32(&enc(Val::Int32Val(-7))), Ok(Some(-7.0)));
        assert_eq!(value_f32(&enc(Val::Int64Val((1 << 40) + 1))), Ok(Some(((1i64 << 40) + 1) as f32)));
        assert_eq!(value_f32(&enc(Val::BoolVal(true))), Ok(Some(1.0)));
        assert_eq!(value_f32(&enc(Val::BoolVal(false))), Ok(Some(0.0)));
        assert_eq!(value_f32(b""), Ok(None));
        assert_eq!(value_f32(&enc(Val::NullVal(protobuf::EnumOrUnknown::default()))), Ok(None));
        assert_eq!(value_f32(&enc(Val::StringVal("x".into()))), Err(ValueError::Unserved("string")));
        assert!(matches!(value_f32(b"\xff\xff"), Err(ValueError::Undecodable(_))));
        assert_eq!(value_f32(&[0u8; 65]), Err(ValueError::TooLong(65)));
        // As Feast stores them: `Value(float_val=...)` and friends, and a
        // `_ts:` Timestamp of 2026-12-05 08:00:00 UTC.
        assert_eq!(value_f32(&hex("3500004040")), Ok(Some(3.0)));
        assert_eq!(value_f32(&hex("3801")), Ok(Some(1.0)));
        assert_eq!(ts_unix_s(&hex("088089cfd806")), Ok(1_796_457_600));
    }
}
