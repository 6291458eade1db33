//! Feast's Redis online store layout, read exactly as Feast 0.67 writes it
//! (`feast/infra/online_stores/redis.py`, `feast/infra/key_encoding_utils.py`):
//!
//! - one hash per entity: its key is the serialized entity key followed by
//!   the project's name. Version 3 (Feast's default) writes the number of
//!   join keys, then each join key as `u32 type (STRING) | u32 length |
//!   bytes`, then each value as `u32 type | u32 length | bytes`, all little
//!   endian; version 2 writes neither the count nor the join key's length
//!   (feast #5357), so a join key that is another's prefix (`user`,
//!   `user_id`) is told apart by parsing the rest exactly.
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
use crate::features::replica::EntityKeyBuf;

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
}

/// How one entity's Redis keys are written: its join key, its type, the
/// serialization version and the project.
#[derive(Clone, Debug)]
pub struct EntityCodec {
    pub join_key: String,
    pub key: JoinKeyType,
    pub version: KeyVersion,
    project: Vec<u8>,
    /// The key's bytes before the entity value.
    prefix: Vec<u8>,
}

impl EntityCodec {
    pub fn new(join_key: &str, key: JoinKeyType, version: KeyVersion, project: &str) -> EntityCodec {
        let mut prefix = Vec::with_capacity(12 + join_key.len());
        if version == KeyVersion::V3 {
            prefix.extend_from_slice(&1u32.to_le_bytes());
        }
        prefix.extend_from_slice(&TYPE_STRING.to_le_bytes());
        if version == KeyVersion::V3 {
            prefix.extend_from_slice(&(join_key.len() as u32).to_le_bytes());
        }
        prefix.extend_from_slice(join_key.as_bytes());
        EntityCodec { join_key: join_key.into(), key, version, project: project.as_bytes().to_vec(), prefix }
    }

    /// The Redis key of entity `key`, as Feast writes it.
    pub fn redis_key(&self, key: &EntityKeyBuf) -> Vec<u8> {
        let mut out = self.prefix.clone();
        let (t, bytes): (u32, Vec<u8>) = match (self.key, key) {
            (JoinKeyType::Int64, EntityKeyBuf::Id(id)) => (TYPE_INT64, id.to_le_bytes().to_vec()),
            (JoinKeyType::Int32, EntityKeyBuf::Id(id)) => (TYPE_INT32, (*id as i64 as i32).to_le_bytes().to_vec()),
            (_, EntityKeyBuf::Id(id)) => (TYPE_STRING, id.to_string().into_bytes()),
            (_, EntityKeyBuf::Str(s)) => (TYPE_STRING, s.clone()),
        };
        out.extend_from_slice(&t.to_le_bytes());
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(&bytes);
        out.extend_from_slice(&self.project);
        out
    }

    /// Whether `key` starts as this entity's keys do: `parse` then says
    /// whether it is one.
    pub fn claims(&self, key: &[u8]) -> bool {
        key.starts_with(&self.prefix)
    }

    /// The group key of Redis key `key`, one this codec `claims`.
    pub fn parse(&self, key: &[u8]) -> Result<EntityKeyBuf, KeyError> {
        if key.len() > REDIS_KEY_BYTES_MAX {
            return Err(KeyError::TooLong(key.len()));
        }
        let rest = key.strip_prefix(self.prefix.as_slice()).ok_or(KeyError::Truncated)?;
        let word = |b: &[u8]| -> Option<u32> { Some(u32::from_le_bytes(b.get(..4)?.try_into().ok()?)) };
        let found = word(rest).ok_or(KeyError::Truncated)?;
        let len = word(&rest[4..]).ok_or(KeyError::Truncated)?;
        let value = rest.get(8..8 + len as usize).ok_or(KeyError::Truncated)?;
        if &rest[8 + len as usize..] != self.project.as_slice() {
            return Err(KeyError::OtherProject);
        }
        let expected = self.key.name();
        match self.key {
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
            _ => Err(KeyError::ValueType { found, expected }),
        }
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
            assert_eq!(codec.redis_key(&want), stored);
        }
    }

    #[test]
    fn keys_of_other_projects_entities_and_shapes_are_refused() {
        let user = EntityCodec::new("user_id", JoinKeyType::Int64, KeyVersion::V2, "proj");
        let mut key = user.redis_key(&EntityKeyBuf::Id(9));
        key.extend_from_slice(b"x");
        assert_eq!(user.parse(&key), Err(KeyError::OtherProject));
        // In version 2, "user" is a prefix of "user_id": the rest does not parse.
        let short = EntityCodec::new("user", JoinKeyType::Int64, KeyVersion::V2, "proj");
        let stored = user.redis_key(&EntityKeyBuf::Id(9));
        assert!(short.claims(&stored) && short.parse(&stored).is_err());
        let item = EntityCodec::new("item_id", JoinKeyType::Int64, KeyVersion::V3, "proj");
        assert!(!item.claims(&user.redis_key(&EntityKeyBuf::Id(9))));
        let s = EntityCodec::new("item_id", JoinKeyType::String { bytes_max: 4 }, KeyVersion::V3, "proj");
        let long = s.redis_key(&EntityKeyBuf::Str(b"abcde".to_vec()));
        assert_eq!(s.parse(&long), Err(KeyError::StringTooLong { bytes: 5, bytes_max: 4 }));
        let as_int = item.redis_key(&EntityKeyBuf::Id(1));
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
