//! The data contract between feature writers and Quiver replicas, as stored in Redis.
//!
//! A group `g` is keyed by u64 entity ids or by strings of 1 to `bytes_max` bytes (at most
//! [`KEY_BYTES_MAX`]), and laid out one of two ways ([`Layout`]). An entity's key is `g:`
//! followed by the id's decimal digits, or by the string key's bytes as they are ([`EntityKey`]).
//!
//! **Plain** (one Redis node):
//! - `g:{id}` (or `g:{key}`) holds the entity's vector as packed little-endian f32 (dim × 4 bytes),
//!   and, for a group with a parent (`ad` → `campaign`), the parent's key right after it: a u64
//!   id as 8 bytes little-endian, a string key as its bytes; nothing after the vector names no
//!   parent ([`encode_value`]);
//! - `quiver:seq:g` counts changes (INCR), so sequence numbers are dense from 1;
//! - `quiver:stream:g` holds one entry per change with id `{seq}-0` and fields
//!   `k` (entity key), `v` (the new bytes) or `d` = `1` (deleted), and `t` (Redis time, ms);
//! - `quiver:epoch:g` is set once, from Redis `TIME` as `{secs}{micros:06}`, when the group is
//!   first written; a replica that sees it change knows the history it followed is gone;
//! - `quiver:keys:g` = `u64` or `string`, the group's key kind, set by the first write: a
//!   writer or a replica of the other kind is refused instead of mixing ids and strings (a
//!   group written before key kinds existed has none, and is a u64 group).
//!
//! **Bucketed** with `B` buckets (a Redis Cluster, or one node): entity `id` is in bucket
//! `b = ((h × 0x9E3779B97F4A7C15) mod 2^64 >> 32) mod B`, where `h` is the id, or a string key's
//! [`key_hash`] (xxh3-64), so both kinds spread alike; every key of bucket `b`
//! carries the hash tag `{g:b}`, so one script can change an entity, its bucket's counter
//! and its bucket's stream together on whichever cluster node owns the tag's slot:
//! `{g:b}:{id}` (the vector), `quiver:seq:{g:b}`, `quiver:stream:{g:b}`,
//! `quiver:epoch:{g:b}`, `quiver:keys:{g:b}` (as above, per bucket), and `quiver:buckets:{g:b}` = `B`, set by the
//! first write, so a writer or a replica configured with another bucket count is refused
//! instead of scattering entities.
//!
//! Writers must go through [`PUBLISH_LUA`] (the [`Publisher`] does) so that the entity, the
//! counter and the stream entry change together: a replica that applies each stream in order
//! then converges on exactly the keyspace.

use super::redis_cluster::{ClusterConn, ClusterError};
use super::resp::{RedisConn, RedisError, Reply};
pub use crate::features::replica::{key_hash, EntityKey, EntityKeyBuf, KeyKind, KEY_BYTES_MAX};

/// The publish script; see the comments in `publish.lua` for its keys and arguments.
pub const PUBLISH_LUA: &str = include_str!("publish.lua");

/// The largest vector dimension accepted (the replica format's bound).
pub const DIM_MAX: usize = crate::features::replica::DIM_MAX as usize;

/// Longest feature group name; it is part of every key.
pub const GROUP_BYTES_MAX: usize = 64;

/// Default approximate bound on stream length: enough history for a replica to catch up after
/// a restart without a full rebuild, bounded so the stream cannot grow without limit.
pub const STREAM_MAXLEN_DEFAULT: u64 = 1_000_000;

/// Commands per pipelined round trip in [`Publisher::put_many`]: large enough to hide the
/// round trip, small enough that one batch's replies and memory stay modest.
pub const PUT_BATCH_ROWS: usize = 1000;

/// Most buckets a group may have: each is a stream the refresher follows and a counter and
/// position it keeps, so the bound keeps a refresher round and a checkpoint small.
pub const BUCKETS_MAX: u16 = 1024;

/// Buckets of a group on a Redis Cluster when none are configured: enough to spread a group
/// over 16 masters, few enough that following every bucket's stream stays cheap.
pub const CLUSTER_BUCKETS_DEFAULT: u16 = 16;

impl EntityKey<'_> {
    /// The key kind's name as `quiver:keys:g` holds it.
    pub fn kind_name(self) -> &'static str {
        match self {
            EntityKey::Id(_) => KIND_U64,
            EntityKey::Str(_) => KIND_STRING,
        }
    }
}

/// `quiver:keys:g`'s value for a u64 group (also what a group without one is).
pub const KIND_U64: &str = "u64";
/// `quiver:keys:g`'s value for a string-keyed group.
pub const KIND_STRING: &str = "string";

/// The name `quiver:keys:g` holds for `kind`.
pub fn kind_name(kind: KeyKind) -> &'static str {
    match kind {
        KeyKind::U64 => KIND_U64,
        KeyKind::Str { .. } => KIND_STRING,
    }
}

/// Checks a string key against its group's limit: 1 to `bytes_max` bytes.
pub fn check_str_key(key: &[u8], bytes_max: u32) -> Result<(), ContractError> {
    if key.is_empty() || key.len() > bytes_max as usize {
        return Err(ContractError::KeyBytes { bytes: key.len(), bytes_max });
    }
    Ok(())
}

/// How a group's keys are laid out in Redis (see the module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One counter and one stream for the group; its keys are spread over hash slots, so a
    /// single Redis node only.
    Plain,
    /// `buckets` hash-tagged buckets, each with its own counter, stream and epoch.
    Bucketed { buckets: u16 },
}

/// The keys of one bucket (the whole group, for [`Layout::Plain`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketKeys {
    pub seq: String,
    pub stream: String,
    pub epoch: String,
    /// `quiver:keys:g` (`quiver:keys:{g:b}`): the group's key kind.
    pub kind: String,
    /// `quiver:buckets:{g:b}`; none in the plain layout.
    pub buckets: Option<String>,
}

impl Layout {
    /// A bucketed layout, checked against [`BUCKETS_MAX`].
    pub fn bucketed(buckets: u16) -> Result<Layout, ContractError> {
        if buckets == 0 || buckets > BUCKETS_MAX {
            return Err(ContractError::Buckets { found: u64::from(buckets) });
        }
        Ok(Layout::Bucketed { buckets })
    }

    /// How many streams the group has: 1 when plain.
    pub fn bucket_count(self) -> usize {
        match self {
            Layout::Plain => 1,
            Layout::Bucketed { buckets } => usize::from(buckets),
        }
    }

    /// The bucket entity `id` belongs to (always 0 when plain). Fibonacci hashing, so that
    /// ids with a common stride still spread evenly.
    pub fn bucket_of(self, id: u64) -> usize {
        match self {
            Layout::Plain => 0,
            Layout::Bucketed { buckets } => {
                ((id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % u64::from(buckets)) as usize
            }
        }
    }

    /// The bucket of an entity of either key kind: [`Layout::bucket_of`] its [`EntityKey::bucket_hash`].
    pub fn bucket_of_key(self, key: EntityKey<'_>) -> usize {
        self.bucket_of(key.bucket_hash())
    }

    /// The key holding entity `id`'s vector.
    pub fn entity_key(self, group: &str, id: u64) -> String {
        match self {
            Layout::Plain => entity_key(group, id),
            Layout::Bucketed { .. } => format!("{{{group}:{}}}:{id}", self.bucket_of(id)),
        }
    }

    /// The key holding `key`'s vector: [`Layout::entity_key`] for an id, the
    /// same prefix followed by the bytes for a string key.
    pub fn key_of(self, group: &str, key: EntityKey<'_>) -> Vec<u8> {
        match key {
            EntityKey::Id(id) => self.entity_key(group, id).into_bytes(),
            EntityKey::Str(bytes) => {
                let mut out = match self {
                    Layout::Plain => format!("{group}:"),
                    Layout::Bucketed { .. } => format!("{{{group}:{}}}:", self.bucket_of_key(key)),
                }
                .into_bytes();
                out.extend_from_slice(bytes);
                out
            }
        }
    }

    /// The counter, stream, epoch (and bucket-count) keys of `bucket`.
    pub fn keys(self, group: &str, bucket: usize) -> BucketKeys {
        match self {
            Layout::Plain => BucketKeys {
                seq: seq_key(group),
                stream: stream_key(group),
                epoch: epoch_key(group),
                kind: kind_key(group),
                buckets: None,
            },
            Layout::Bucketed { .. } => {
                let tag = format!("{{{group}:{bucket}}}");
                BucketKeys {
                    seq: format!("quiver:seq:{tag}"),
                    stream: format!("quiver:stream:{tag}"),
                    epoch: format!("quiver:epoch:{tag}"),
                    kind: format!("quiver:keys:{tag}"),
                    buckets: Some(format!("quiver:buckets:{tag}")),
                }
            }
        }
    }

    /// The SCAN pattern matching `bucket`'s entity keys (every entity key of a plain group).
    pub fn scan_pattern(self, group: &str, bucket: usize) -> String {
        match self {
            Layout::Plain => format!("{group}:*"),
            Layout::Bucketed { .. } => format!("{{{group}:{bucket}}}:*"),
        }
    }

    /// The id in an entity key of `group`'s `bucket`, if `key` is one exactly as
    /// [`Layout::entity_key`] writes it: canonical digits, and the bucket the id hashes to.
    pub fn parse_entity_key(self, group: &str, bucket: usize, key: &[u8]) -> Option<u64> {
        match self {
            Layout::Plain => parse_entity_key(group, key),
            Layout::Bucketed { .. } => {
                let rest = key.strip_prefix(b"{")?.strip_prefix(group.as_bytes())?.strip_prefix(b":")?;
                let close = rest.iter().position(|&c| c == b'}')?;
                let (digits, id) = (&rest[..close], rest[close + 1..].strip_prefix(b":")?);
                let named: usize = canonical_u64(digits)?.try_into().ok()?;
                let id = canonical_u64(id)?;
                (named == bucket && self.bucket_of(id) == bucket).then_some(id)
            }
        }
    }

    /// The key in an entity key of `group`'s `bucket` whose keys are `kind`, if
    /// `key` is one exactly as [`Layout::key_of`] writes it: for a string
    /// key, 1 to `bytes_max` bytes that hash to the bucket.
    pub fn parse_key<'k>(self, group: &str, bucket: usize, kind: KeyKind, key: &'k [u8]) -> Option<EntityKey<'k>> {
        let KeyKind::Str { bytes_max } = kind else {
            return self.parse_entity_key(group, bucket, key).map(EntityKey::Id);
        };
        let bytes = match self {
            Layout::Plain => key.strip_prefix(group.as_bytes())?.strip_prefix(b":")?,
            Layout::Bucketed { .. } => {
                let rest = key.strip_prefix(b"{")?.strip_prefix(group.as_bytes())?.strip_prefix(b":")?;
                let close = rest.iter().position(|&c| c == b'}')?;
                let named: usize = canonical_u64(&rest[..close])?.try_into().ok()?;
                let bytes = rest[close + 1..].strip_prefix(b":")?;
                if named != bucket {
                    return None;
                }
                bytes
            }
        };
        check_str_key(bytes, bytes_max).ok()?;
        let key = EntityKey::Str(bytes);
        (self.bucket_of_key(key) == bucket).then_some(key)
    }
}

/// One stream a replica follows, and the keys that go with it: a whole plain
/// group, or one bucket of a bucketed group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub group: String,
    pub layout: Layout,
    pub bucket: usize,
    pub keys: BucketKeys,
    /// The group's key kind: u64 unless [`Part::with_key_kind`] says otherwise.
    pub key_kind: KeyKind,
    /// The key kind of the parent the group's values name ([`Part::with_link`]).
    pub link: Option<KeyKind>,
}

impl Part {
    pub fn new(group: &str, layout: Layout, bucket: usize) -> Part {
        assert!(bucket < layout.bucket_count(), "bucket {bucket} of a {layout:?} group");
        Part {
            group: group.into(),
            layout,
            bucket,
            keys: layout.keys(group, bucket),
            key_kind: KeyKind::U64,
            link: None,
        }
    }

    /// The part of a group whose values name a parent keyed by `link`.
    pub fn with_link(mut self, link: Option<KeyKind>) -> Part {
        self.link = link;
        self
    }

    /// The part of a group keyed by `kind`.
    pub fn with_key_kind(mut self, kind: KeyKind) -> Part {
        self.key_kind = kind;
        self
    }

    /// The whole of a plain group.
    pub fn plain(group: &str) -> Part {
        Part::new(group, Layout::Plain, 0)
    }

    /// Every part of `group` laid out as `layout`, in bucket order.
    pub fn all(group: &str, layout: Layout) -> Vec<Part> {
        (0..layout.bucket_count()).map(|b| Part::new(group, layout, b)).collect()
    }

    /// `user`, or `user/3` for bucket 3: how logs and errors name it.
    pub fn name(&self) -> String {
        match self.layout {
            Layout::Plain => self.group.clone(),
            Layout::Bucketed { .. } => format!("{}/{}", self.group, self.bucket),
        }
    }

    /// The SCAN pattern of this part's entity keys.
    pub fn scan_pattern(&self) -> String {
        self.layout.scan_pattern(&self.group, self.bucket)
    }

    /// What every entity key of this part starts with.
    pub fn entity_prefix(&self) -> String {
        self.scan_pattern().trim_end_matches('*').to_string()
    }

    /// The id in one of this part's entity keys, if `key` is one of a u64 group.
    pub fn parse_entity_key(&self, key: &[u8]) -> Option<u64> {
        match self.key_kind {
            KeyKind::U64 => self.layout.parse_entity_key(&self.group, self.bucket, key),
            KeyKind::Str { .. } => None,
        }
    }

    /// The key in one of this part's entity keys, of the part's key kind, if `key` is one.
    pub fn parse_key<'k>(&self, key: &'k [u8]) -> Option<EntityKey<'k>> {
        self.layout.parse_key(&self.group, self.bucket, self.key_kind, key)
    }

    /// What its entity keys look like, for "not an entity key" reports.
    pub fn key_form(&self) -> String {
        let what = match self.key_kind {
            KeyKind::U64 => "u64".to_string(),
            KeyKind::Str { bytes_max } => format!("1 to {bytes_max} bytes"),
        };
        match self.layout {
            Layout::Plain => format!("{}:<{what}>", self.group),
            Layout::Bucketed { .. } => format!("{{{}:{}}}:<{what} in bucket {}>", self.group, self.bucket, self.bucket),
        }
    }
}

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
    #[error("{found} buckets; a bucketed group has 1 to {BUCKETS_MAX}")]
    Buckets { found: u64 },
    #[error("the plain layout spreads a group's keys over hash slots: on a Redis Cluster use buckets")]
    PlainOnCluster,
    #[error("publish script answered {0}, expected a sequence number")]
    UnexpectedReply(String),
    #[error("a key of {bytes} bytes; this group's keys are 1 to {bytes_max} bytes")]
    KeyBytes { bytes: usize, bytes_max: u32 },
    #[error("string keys of {bytes_max} bytes; a group's keys are 1 to {KEY_BYTES_MAX} bytes long")]
    KeyBytesMax { bytes_max: u32 },
    /// The publisher was set up for one key kind and given a key of the other.
    #[error("this publisher writes {kind}, not {used}")]
    KeyKindUsed { kind: KeyKind, used: &'static str },
    /// Redis records the group's keys as the other kind (`quiver:keys:g`).
    #[error(
        "{key} says group '{group}' has {stored} keys; this writer writes {writer} keys: one group holds one kind"
    )]
    KeyKind { group: String, key: String, stored: String, writer: String },
    /// The bytes after an entity's vector are no parent key of the group's parent.
    #[error("{0}")]
    Parent(String),
}

/// A row to publish: its key, its vector and the parent key it names.
pub type LinkedRow = (EntityKeyBuf, Vec<f32>, Option<EntityKeyBuf>);

/// Why a publish failed: the values, or Redis.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Contract(#[from] ContractError),
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A row of a batch was refused on its own; the rows before it are written.
    #[error("entity {key}: {source}")]
    Row {
        key: String,
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

pub fn kind_key(group: &str) -> String {
    format!("quiver:keys:{group}")
}

/// The id in an entity key of `group`, if `key` is one exactly as [`entity_key`] writes it
/// (no sign, no leading zeros), so that parsing and formatting are inverses.
pub fn parse_entity_key(group: &str, key: &[u8]) -> Option<u64> {
    canonical_u64(key.strip_prefix(group.as_bytes())?.strip_prefix(b":")?)
}

/// `digits` as a u64 if they are written as `u64`'s Display writes them.
fn canonical_u64(digits: &[u8]) -> Option<u64> {
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

/// An entity's value: its vector packed as [`encode_vector`] does, then its parent's key, if
/// it names one: a u64 id as 8 bytes little-endian, a string key's bytes.
pub fn encode_value(values: &[f32], parent: Option<EntityKey<'_>>) -> Vec<u8> {
    let mut bytes = encode_vector(values);
    match parent {
        None => {}
        Some(EntityKey::Id(id)) => bytes.extend_from_slice(&id.to_le_bytes()),
        Some(EntityKey::Str(key)) => bytes.extend_from_slice(key),
    }
    bytes
}

/// Splits an entity value of a group with dimension `dim` into its vector's bytes and the
/// parent key after them ([`encode_value`]), for a group whose parent is keyed by `link`;
/// refuses bytes after the vector of a group without a parent, and any that are no key of
/// the parent's kind.
pub fn split_value(
    bytes: &[u8],
    dim: usize,
    link: Option<KeyKind>,
) -> Result<(&[u8], Option<EntityKey<'_>>), ContractError> {
    let Some(rest) = bytes.get(dim * 4..) else {
        return Err(ContractError::WrongLength { found_bytes: bytes.len(), dim });
    };
    let vector = &bytes[..dim * 4];
    let parent = match (link, rest.len()) {
        (_, 0) => None,
        (None, _) => return Err(ContractError::WrongLength { found_bytes: bytes.len(), dim }),
        (Some(KeyKind::U64), 8) => Some(EntityKey::Id(u64::from_le_bytes(rest.try_into().expect("8 bytes")))),
        (Some(KeyKind::U64), n) => {
            return Err(ContractError::Parent(format!("{n} bytes after the vector; a u64 parent id takes 8")))
        }
        (Some(KeyKind::Str { bytes_max }), n) if n <= bytes_max as usize => Some(EntityKey::Str(rest)),
        (Some(KeyKind::Str { bytes_max }), n) => {
            return Err(ContractError::Parent(format!(
                "a parent key of {n} bytes after the vector; the parent's keys are 1 to {bytes_max} bytes"
            )))
        }
    };
    Ok((vector, parent))
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

/// How long a publish on a cluster keeps retrying a batch while a node is
/// unreachable: long enough for the cluster to promote a replica (a few node
/// timeouts), bounded so a cluster that stays down surfaces as an error.
pub const CLUSTER_FAILOVER_WAIT_MS: u64 = 30_000;

/// Where a [`Publisher`] writes.
enum Target {
    Node(RedisConn),
    Cluster(ClusterConn),
}

/// Writes entities through the publish script, on one node or a cluster.
pub struct Publisher {
    target: Target,
    layout: Layout,
    key_kind: KeyKind,
    sha: String,
    stream_maxlen: u64,
}

impl Publisher {
    /// Loads the publish script on `conn`'s server; the plain layout (see
    /// [`Publisher::with_layout`]).
    pub fn new(conn: RedisConn) -> Result<Publisher, PublishError> {
        Publisher::on(Target::Node(conn), Layout::Plain)
    }

    /// Loads the publish script on every master of `conn`'s cluster; the
    /// bucketed layout with `buckets` buckets.
    pub fn cluster(conn: ClusterConn, buckets: u16) -> Result<Publisher, PublishError> {
        Publisher::on(Target::Cluster(conn), Layout::bucketed(buckets)?)
    }

    fn on(target: Target, layout: Layout) -> Result<Publisher, PublishError> {
        let mut p = Publisher {
            target,
            layout,
            key_kind: KeyKind::U64,
            sha: String::new(),
            stream_maxlen: STREAM_MAXLEN_DEFAULT,
        };
        p.load_script()?;
        Ok(p)
    }

    /// Writes with `layout` from now on; a cluster takes only a bucketed one.
    pub fn with_layout(mut self, layout: Layout) -> Result<Publisher, PublishError> {
        if layout == Layout::Plain && matches!(self.target, Target::Cluster(_)) {
            return Err(ContractError::PlainOnCluster.into());
        }
        self.layout = layout;
        Ok(self)
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The approximate bound passed to `XADD MAXLEN ~`.
    pub fn with_stream_maxlen(mut self, stream_maxlen: u64) -> Publisher {
        self.stream_maxlen = stream_maxlen;
        self
    }

    /// The connection, for reads alongside publishing; none on a cluster
    /// (its keys live on several nodes: see [`Publisher::cluster_conn`]).
    pub fn conn(&mut self) -> Option<&mut RedisConn> {
        match &mut self.target {
            Target::Node(conn) => Some(conn),
            Target::Cluster(_) => None,
        }
    }

    /// The cluster's connections, when publishing to one.
    pub fn cluster_conn(&mut self) -> Option<&mut ClusterConn> {
        match &mut self.target {
            Target::Node(_) => None,
            Target::Cluster(conn) => Some(conn),
        }
    }

    /// Writes string keys of at most `bytes_max` bytes (`KeyKind::Str`) with
    /// the `_str` methods, or u64 ids (`KeyKind::U64`, the default) with the
    /// others; the group's kind in Redis must agree.
    pub fn with_key_kind(mut self, kind: KeyKind) -> Result<Publisher, PublishError> {
        if let KeyKind::Str { bytes_max } = kind {
            if bytes_max == 0 || bytes_max > KEY_BYTES_MAX {
                return Err(ContractError::KeyBytesMax { bytes_max }.into());
            }
        }
        self.key_kind = kind;
        Ok(self)
    }

    pub fn key_kind(&self) -> KeyKind {
        self.key_kind
    }

    /// Sets entity `id` of `group` to `values`; returns the change's
    /// sequence number (in the entity's bucket, when bucketed).
    pub fn put(&mut self, group: &str, id: u64, values: &[f32]) -> Result<u64, PublishError> {
        self.put_key(group, EntityKey::Id(id), values)
    }

    /// [`Publisher::put`] for the string key `key` of a string-keyed group.
    pub fn put_str(&mut self, group: &str, key: &[u8], values: &[f32]) -> Result<u64, PublishError> {
        self.put_key(group, EntityKey::Str(key), values)
    }

    /// Deletes entity `id` of `group`; returns the change's sequence number. Deleting an
    /// absent entity still records the change, so replicas that missed the put agree as well.
    pub fn delete(&mut self, group: &str, id: u64) -> Result<u64, PublishError> {
        self.delete_key(group, EntityKey::Id(id))
    }

    /// [`Publisher::delete`] for the string key `key` of a string-keyed group.
    pub fn delete_str(&mut self, group: &str, key: &[u8]) -> Result<u64, PublishError> {
        self.delete_key(group, EntityKey::Str(key))
    }

    fn put_key(&mut self, group: &str, key: EntityKey<'_>, values: &[f32]) -> Result<u64, PublishError> {
        self.put_linked(group, key, values, None)
    }

    /// Sets entity `key` (of the publisher's kind) of `group` to `values`, naming `parent` as
    /// its parent's key (none: no parent): for a group configured with `parent`, whose
    /// replicas join the parent's row through it. A string parent key is 1 to
    /// [`KEY_BYTES_MAX`] bytes; whether it is of the parent's kind is the replicas' to check
    /// (they skip and count a value that is not).
    pub fn put_linked(
        &mut self,
        group: &str,
        key: EntityKey<'_>,
        values: &[f32],
        parent: Option<EntityKey<'_>>,
    ) -> Result<u64, PublishError> {
        check_group(group)?;
        self.check_key(key)?;
        check_values(values)?;
        if let Some(EntityKey::Str(bytes)) = parent {
            check_str_key(bytes, KEY_BYTES_MAX)?;
        }
        self.publish_many(group, 1, |_| (key, Op::Put(encode_value(values, parent))), |_, _| {}).map_err(unwrap_row)
    }

    fn delete_key(&mut self, group: &str, key: EntityKey<'_>) -> Result<u64, PublishError> {
        check_group(group)?;
        self.check_key(key)?;
        self.publish_many(group, 1, |_| (key, Op::Delete), |_, _| {}).map_err(unwrap_row)
    }

    /// Refuses, before anything is sent, a key of the other kind than the
    /// publisher's, and a string key outside its group's limit.
    fn check_key(&self, key: EntityKey<'_>) -> Result<(), ContractError> {
        match (key, self.key_kind) {
            (EntityKey::Id(_), KeyKind::U64) => Ok(()),
            (EntityKey::Str(bytes), KeyKind::Str { bytes_max }) => check_str_key(bytes, bytes_max),
            (EntityKey::Id(_), kind) => Err(ContractError::KeyKindUsed { kind, used: "u64 ids" }),
            (EntityKey::Str(_), kind) => Err(ContractError::KeyKindUsed { kind, used: "string keys" }),
        }
    }

    /// Writes `rows` in order, [`PUT_BATCH_ROWS`] per round trip, calling `progress(done, total)`
    /// after each batch; returns the highest sequence number (0 for no rows). Every row is
    /// checked before anything is sent, so bad values write nothing.
    pub fn put_many(
        &mut self,
        group: &str,
        rows: &[(u64, Vec<f32>)],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        self.put_many_keys(group, rows.len(), |i| (EntityKey::Id(rows[i].0), &rows[i].1, None), progress)
    }

    /// [`Publisher::put_many`] for a string-keyed group.
    pub fn put_many_str(
        &mut self,
        group: &str,
        rows: &[(Vec<u8>, Vec<f32>)],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        self.put_many_keys(group, rows.len(), |i| (EntityKey::Str(&rows[i].0), &rows[i].1, None), progress)
    }

    /// [`Publisher::put_many`] for keys of either kind (the publisher's).
    pub fn put_many_keyed(
        &mut self,
        group: &str,
        rows: &[(EntityKeyBuf, Vec<f32>)],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        self.put_many_keys(group, rows.len(), |i| (rows[i].0.as_key(), &rows[i].1, None), progress)
    }

    /// [`Publisher::put_many_keyed`] for rows that name their parent's key
    /// ([`Publisher::put_linked`]).
    pub fn put_many_linked(
        &mut self,
        group: &str,
        rows: &[LinkedRow],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        let row = |i: usize| {
            let (key, values, parent) = &rows[i];
            (key.as_key(), values, parent.as_ref().map(EntityKeyBuf::as_key))
        };
        self.put_many_keys(group, rows.len(), row, progress)
    }

    fn put_many_keys<'r>(
        &mut self,
        group: &str,
        n: usize,
        row: impl Fn(usize) -> (EntityKey<'r>, &'r Vec<f32>, Option<EntityKey<'r>>),
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        check_group(group)?;
        for i in 0..n {
            let (key, values, parent) = row(i);
            let checked = self.check_key(key).and_then(|()| check_values(values)).and_then(|()| match parent {
                Some(EntityKey::Str(bytes)) => check_str_key(bytes, KEY_BYTES_MAX),
                _ => Ok(()),
            });
            checked.map_err(|e| PublishError::Row { key: key.to_string(), source: Box::new(e.into()) })?;
        }
        self.publish_many(
            group,
            n,
            |i| {
                let (key, values, parent) = row(i);
                (key, Op::Put(encode_value(values, parent)))
            },
            progress,
        )
    }

    /// Deletes entity `id` of `group` for every id, in order, [`PUT_BATCH_ROWS`] per round trip,
    /// with progress as [`Publisher::put_many`]; returns the highest sequence number (0 for no ids).
    pub fn delete_many(
        &mut self,
        group: &str,
        ids: &[u64],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        self.delete_many_keys(group, ids.len(), |i| EntityKey::Id(ids[i]), progress)
    }

    /// [`Publisher::delete_many`] for a string-keyed group.
    pub fn delete_many_str(
        &mut self,
        group: &str,
        keys: &[Vec<u8>],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        self.delete_many_keys(group, keys.len(), |i| EntityKey::Str(&keys[i]), progress)
    }

    /// [`Publisher::delete_many`] for keys of either kind (the publisher's).
    pub fn delete_many_keyed(
        &mut self,
        group: &str,
        keys: &[EntityKeyBuf],
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        self.delete_many_keys(group, keys.len(), |i| keys[i].as_key(), progress)
    }

    fn delete_many_keys<'r>(
        &mut self,
        group: &str,
        n: usize,
        key: impl Fn(usize) -> EntityKey<'r>,
        progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        check_group(group)?;
        for i in 0..n {
            self.check_key(key(i))
                .map_err(|e| PublishError::Row { key: key(i).to_string(), source: Box::new(e.into()) })?;
        }
        self.publish_many(group, n, |i| (key(i), Op::Delete), progress)
    }

    /// Runs the `n` changes `change(i)` gives, pipelined by batch.
    fn publish_many<'r>(
        &mut self,
        group: &str,
        n: usize,
        change: impl Fn(usize) -> (EntityKey<'r>, Op),
        mut progress: impl FnMut(usize, usize),
    ) -> Result<u64, PublishError> {
        let mut last_seq = 0;
        for start in (0..n).step_by(PUT_BATCH_ROWS) {
            let batch: Vec<(EntityKey<'r>, Op)> = (start..n.min(start + PUT_BATCH_ROWS)).map(&change).collect();
            let cmds: Vec<(Vec<u8>, Vec<Vec<u8>>)> =
                batch.iter().map(|(key, op)| self.publish_command(group, *key, op)).collect();
            let mut replies = self.send(&cmds)?;
            // A server restart or SCRIPT FLUSH between batches (or within one) drops the script:
            // reload it and redo, in order, just the commands that did not run.
            if replies.iter().any(is_noscript) {
                self.load_script()?;
                let redo: Vec<usize> = (0..replies.len()).filter(|&i| is_noscript(&replies[i])).collect();
                let redo_cmds: Vec<(Vec<u8>, Vec<Vec<u8>>)> = redo.iter().map(|&i| cmds[i].clone()).collect();
                for (i, reply) in redo.into_iter().zip(self.send(&redo_cmds)?) {
                    replies[i] = reply;
                }
            }
            for ((key, _), reply) in batch.iter().zip(replies) {
                let seq = self
                    .seq_from(group, reply)
                    .map_err(|e| PublishError::Row { key: key.to_string(), source: Box::new(e) })?;
                last_seq = seq.max(last_seq);
            }
            progress(start + batch.len(), n);
        }
        Ok(last_seq)
    }

    /// One pipelined batch. On a cluster, a batch that met an unreachable
    /// node is sent again, whole, until the cluster has promoted a replica
    /// or [`CLUSTER_FAILOVER_WAIT_MS`] passes: publishing a change twice
    /// leaves the same values, in the same order.
    fn send(&mut self, cmds: &[(Vec<u8>, Vec<Vec<u8>>)]) -> Result<Vec<Reply>, PublishError> {
        match &mut self.target {
            Target::Node(conn) => {
                let plain: Vec<Vec<Vec<u8>>> = cmds.iter().map(|(_, c)| c.clone()).collect();
                Ok(conn.pipeline(&plain)?)
            }
            Target::Cluster(conn) => {
                let started = std::time::Instant::now();
                loop {
                    match conn.pipeline(cmds) {
                        Ok(replies) => return Ok(replies),
                        Err(e) if started.elapsed().as_millis() as u64 >= CLUSTER_FAILOVER_WAIT_MS => {
                            return Err(e.into())
                        }
                        Err(e) => {
                            tracing::warn!("publish batch: {e}; sending it again once the cluster answers");
                            std::thread::sleep(std::time::Duration::from_millis(200));
                            let _ = conn.refresh();
                        }
                    }
                }
            }
        }
    }

    fn load_script(&mut self) -> Result<(), PublishError> {
        let load: [&[u8]; 3] = [b"SCRIPT", b"LOAD", PUBLISH_LUA.as_bytes()];
        let replies = match &mut self.target {
            Target::Node(conn) => vec![conn.command(&load)?],
            Target::Cluster(conn) => {
                let masters: Vec<String> = conn.topology().masters().into_iter().map(String::from).collect();
                let mut replies = Vec::with_capacity(masters.len());
                for m in masters {
                    replies.push(conn.node(&m)?.command(&load)?);
                }
                replies
            }
        };
        for reply in replies {
            self.sha = match reply.into_bytes().map(String::from_utf8) {
                Some(Ok(sha)) => sha,
                _ => return Err(ContractError::UnexpectedReply("a non-text SCRIPT LOAD answer".into()).into()),
            };
        }
        Ok(())
    }

    /// The key that routes the change, and its EVALSHA (the script's keyed
    /// form: see `publish.lua`).
    fn publish_command(&self, group: &str, key: EntityKey<'_>, op: &Op) -> (Vec<u8>, Vec<Vec<u8>>) {
        let (op_name, bytes): (&[u8], &[u8]) = match op {
            Op::Put(bytes) => (b"put", bytes),
            Op::Delete => (b"del", b""),
        };
        let keys = self.layout.keys(group, self.layout.bucket_of_key(key));
        let entity = self.layout.key_of(group, key);
        let mut cmd = vec![
            b"EVALSHA".to_vec(),
            self.sha.clone().into_bytes(),
            if keys.buckets.is_some() { b"6".to_vec() } else { b"5".to_vec() },
            entity.clone(),
            keys.seq.into_bytes(),
            keys.stream.into_bytes(),
            keys.epoch.into_bytes(),
            keys.kind.into_bytes(),
        ];
        if let Some(buckets) = keys.buckets {
            cmd.push(buckets.into_bytes());
        }
        let buckets = match self.layout {
            Layout::Plain => 0,
            Layout::Bucketed { buckets } => buckets,
        };
        cmd.extend([
            op_name.to_vec(),
            bytes.to_vec(),
            self.stream_maxlen.to_string().into_bytes(),
            buckets.to_string().into_bytes(),
            key.kind_name().as_bytes().to_vec(),
        ]);
        (entity, cmd)
    }

    fn seq_from(&self, group: &str, reply: Reply) -> Result<u64, PublishError> {
        let addr = match &self.target {
            Target::Node(conn) => conn.addr().to_string(),
            Target::Cluster(_) => "cluster".to_string(),
        };
        match reply {
            Reply::Int(seq) if seq > 0 => Ok(seq as u64),
            Reply::Error(message) => match key_kind_refusal(group, &message) {
                Some(refused) => Err(refused.into()),
                None => Err(RedisError::Server { addr, message }.into()),
            },
            other => Err(ContractError::UnexpectedReply(format!("{other:?}")).into()),
        }
    }
}

/// The publish script's refusal of a writer of the other key kind, as a typed error:
/// `quiver: key kind STORED in KEY, this writer writes WRITER`.
fn key_kind_refusal(group: &str, message: &str) -> Option<ContractError> {
    let rest = message.strip_prefix("quiver: key kind ")?;
    let (stored, rest) = rest.split_once(" in ")?;
    let (key, writer) = rest.split_once(", this writer writes ")?;
    Some(ContractError::KeyKind { group: group.into(), key: key.into(), stored: stored.into(), writer: writer.into() })
}

enum Op {
    Put(Vec<u8>),
    Delete,
}

/// A one-row publish's error, without the row wrapper that names the entity.
fn unwrap_row(e: PublishError) -> PublishError {
    match e {
        PublishError::Row { source, .. } => *source,
        e => e,
    }
}

fn is_noscript(reply: &Reply) -> bool {
    matches!(reply, Reply::Error(m) if m.starts_with("NOSCRIPT"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_carries_its_parent_key_after_the_vector() {
        let v = [1.0, -2.0];
        let ids = Some(KeyKind::U64);
        let strs = Some(KeyKind::Str { bytes_max: 4 });
        let split = |bytes: &[u8], link| {
            split_value(bytes, 2, link).map(|(vector, p)| (vector.len(), p.map(EntityKey::to_buf)))
        };
        assert_eq!(split(&encode_value(&v, None), None).unwrap(), (8, None));
        assert_eq!(split(&encode_value(&v, None), ids).unwrap(), (8, None), "no parent named");
        assert_eq!(split(&encode_value(&v, Some(EntityKey::Id(9))), ids).unwrap(), (8, Some(EntityKeyBuf::Id(9))));
        let s = encode_value(&v, Some(EntityKey::Str(b"ab")));
        assert_eq!(split(&s, strs).unwrap(), (8, Some(EntityKeyBuf::Str(b"ab".to_vec()))));
        // A tail where the group has no parent, a u64 of other than 8 bytes, a string too long, a short vector.
        assert!(matches!(split(&s, None), Err(ContractError::WrongLength { .. })));
        let e = split(&s, ids).unwrap_err();
        assert!(e.to_string().contains("2 bytes after the vector; a u64 parent id takes 8"), "{e}");
        let e = split(&encode_value(&v, Some(EntityKey::Str(b"abcde"))), strs).unwrap_err();
        assert!(e.to_string().contains("parent's keys are 1 to 4 bytes"), "{e}");
        assert!(matches!(split(&s[..7], strs), Err(ContractError::WrongLength { found_bytes: 7, dim: 2 })));
    }

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
    fn a_bucketed_layout_keeps_each_bucket_in_one_slot_and_parses_only_its_own_keys() {
        use crate::features::feed::redis_cluster::key_slot;
        let layout = Layout::bucketed(16).unwrap();
        assert_eq!(layout.entity_key("user", 42), format!("{{user:{}}}:42", layout.bucket_of(42)));
        let mut per_bucket = [0u32; 16];
        // A stride shared by every id (the ids of one shard of an upstream system) still spreads.
        for id in (0..16_000u64).map(|i| i * 1024) {
            let b = layout.bucket_of(id);
            per_bucket[b] += 1;
            let keys = layout.keys("user", b);
            let entity = layout.entity_key("user", id);
            let slot = key_slot(entity.as_bytes());
            for k in [&keys.seq, &keys.stream, &keys.epoch, &keys.kind, keys.buckets.as_ref().unwrap()] {
                assert_eq!(key_slot(k.as_bytes()), slot, "{k} and {entity}");
            }
            assert_eq!(layout.parse_entity_key("user", b, entity.as_bytes()), Some(id));
            assert_eq!(layout.parse_entity_key("user", (b + 1) % 16, entity.as_bytes()), None);
            assert!(glob_match(layout.scan_pattern("user", b).as_bytes(), entity.as_bytes()));
        }
        assert!(per_bucket.iter().all(|&n| (800..1200).contains(&n)), "{per_bucket:?}");
        // Written into the wrong bucket, or not canonically: not an entity of the group.
        let wrong = (0..16).find(|&b| b != layout.bucket_of(7)).unwrap();
        for bad in [
            format!("{{user:{wrong}}}:7"),
            "{user:03}:7".into(),
            "{user:3}:07".into(),
            "{user:3}7".into(),
            "user:7".into(),
            "{item:3}:7".into(),
        ] {
            assert_eq!(layout.parse_entity_key("user", 3, bad.as_bytes()), None, "{bad}");
            assert_eq!(layout.parse_entity_key("user", wrong, bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(Layout::Plain.keys("item", 0).stream, "quiver:stream:item");
        assert_eq!(Layout::Plain.entity_key("item", 5), "item:5");
        assert_eq!(Layout::Plain.bucket_count(), 1);
        assert_eq!(layout.keys("item", 3).stream, "quiver:stream:{item:3}");
        assert!(matches!(Layout::bucketed(0), Err(ContractError::Buckets { found: 0 })));
        assert!(Layout::bucketed(BUCKETS_MAX + 1).is_err());
        assert!(Layout::bucketed(BUCKETS_MAX).is_ok());
    }

    #[test]
    fn string_keys_are_the_bytes_after_the_prefix_and_parse_back_only_in_their_bucket() {
        use crate::features::feed::redis_cluster::key_slot;
        let kind = KeyKind::Str { bytes_max: 8 };
        assert_eq!(Layout::Plain.key_of("device", EntityKey::Str(b"ab:c}")), b"device:ab:c}");
        assert_eq!(Layout::Plain.key_of("device", EntityKey::Id(7)), b"device:7");
        assert_eq!(Layout::Plain.keys("device", 0).kind, "quiver:keys:device");
        assert_eq!(Layout::Plain.parse_key("device", 0, kind, b"device:ab:c}"), Some(EntityKey::Str(b"ab:c}")));
        assert_eq!(Layout::Plain.parse_key("device", 0, kind, b"device:12345678"), Some(EntityKey::Str(b"12345678")));
        for bad in [&b"device:123456789"[..], b"device:", b"item:ab", b"deviceab"] {
            assert_eq!(Layout::Plain.parse_key("device", 0, kind, bad), None, "{}", String::from_utf8_lossy(bad));
        }
        // A u64 group's parse is the id parse, whatever the kind's limit would take.
        assert_eq!(Layout::Plain.parse_key("user", 0, KeyKind::U64, b"user:42"), Some(EntityKey::Id(42)));
        assert_eq!(Layout::Plain.parse_key("user", 0, KeyKind::U64, b"user:abc"), None);
        let layout = Layout::bucketed(16).unwrap();
        assert_eq!(layout.bucket_of_key(EntityKey::Id(42)), layout.bucket_of(42));
        let mut per_bucket = [0u32; 16];
        for n in 0..16_000u32 {
            let name = format!("dev-{n}");
            let key = EntityKey::Str(name.as_bytes());
            let b = layout.bucket_of_key(key);
            assert_eq!(b, layout.bucket_of(key_hash(name.as_bytes())));
            per_bucket[b] += 1;
            let entity = layout.key_of("device", key);
            assert_eq!(entity, format!("{{device:{b}}}:{name}").into_bytes());
            assert_eq!(key_slot(&entity), key_slot(layout.keys("device", b).kind.as_bytes()));
            let kind = KeyKind::Str { bytes_max: 16 };
            assert_eq!(layout.parse_key("device", b, kind, &entity), Some(key));
            assert_eq!(layout.parse_key("device", (b + 1) % 16, kind, &entity), None);
        }
        assert!(per_bucket.iter().all(|&n| (800..1200).contains(&n)), "{per_bucket:?}");
        assert!(matches!(check_str_key(b"", 8), Err(ContractError::KeyBytes { bytes: 0, bytes_max: 8 })));
        assert!(matches!(check_str_key(&[b'x'; 9], 8), Err(ContractError::KeyBytes { bytes: 9, .. })));
        assert!(check_str_key(&[b'x'; 8], 8).is_ok());
        let part = Part::plain("device").with_key_kind(kind);
        assert_eq!(part.parse_entity_key(b"device:7"), None, "a string group has no ids");
        assert_eq!(part.parse_key(b"device:7"), Some(EntityKey::Str(b"7")));
        assert_eq!(part.key_form(), "device:<1 to 8 bytes>");
    }

    #[test]
    fn the_scripts_key_kind_refusal_is_typed() {
        let refused =
            key_kind_refusal("device", "quiver: key kind string in quiver:keys:device, this writer writes u64");
        let Some(ContractError::KeyKind { group, key, stored, writer }) = refused else {
            panic!("not read as a key kind refusal: {refused:?}");
        };
        assert_eq!(
            (group.as_str(), key.as_str(), stored.as_str(), writer.as_str()),
            ("device", "quiver:keys:device", "string", "u64")
        );
        assert!(key_kind_refusal("device", "quiver: unknown publish op x").is_none());
        assert!(
            PUBLISH_LUA.contains("'quiver: key kind ' .. stored_kind .. ' in ' .. kind_key .. ', this writer writes '")
        );
    }

    /// Redis's MATCH for the patterns the layout writes: `*` and literals.
    fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some((b'*', rest)) => (0..=text.len()).any(|i| glob_match(rest, &text[i..])),
            Some((c, rest)) => text.first() == Some(c) && glob_match(rest, &text[1..]),
        }
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
