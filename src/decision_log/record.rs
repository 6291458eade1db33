//! One logged decision as bytes: what the shard writes into its ring
//! ([`DecisionRef::encode`], from borrowed parts, no allocation) and what
//! the writer reads back ([`Decision::decode`], typed errors; its floats,
//! most of a record's bytes, are read where they lie in the ring,
//! [`Floats`], not copied out).
//!
//! Little-endian, in this order: the format version, the fixed fields (why
//! the decision was logged among them, [`why`]), the model's name, the
//! spans of the input row (which group's floats start where: the feature
//! columns' names, and the replica position each group was read at), every
//! group's keys, then the input rows, the scores and a shadow version's
//! scores, each present or not by a flag. The encoded length is computed first
//! ([`DecisionRef::encoded_len`]) so the ring can reserve it.
//!
//! The spans and keys (the record's middle, [`Middle`]) can be encoded ahead
//! into a buffer of the shard's ([`encode_middle`]): a request handed to the
//! inference thread keeps its keys that way, since its frame is gone by the
//! time its scores come back.

/// The layout written; a record of another version is refused.
pub const RECORD_VERSION: u8 = 3;
/// Spans of one input row: the groups a model reads, the context floats
/// and the context ids.
pub const SPANS_MAX: usize = crate::features::groups::GROUPS_MAX + 2;
/// Key groups of one record: the request's groups, and `user`/`item`
/// from its older fields.
pub const KEY_GROUPS_MAX: usize = crate::wire::REQUEST_GROUPS_MAX + 2;
/// Names are cut to this many bytes (group names are at most 64).
const NAME_BYTES_MAX: usize = u8::MAX as usize;

const FLAG_STALE: u8 = 1;
const FLAG_X: u8 = 2;
const FLAG_SCORES: u8 = 4;
const FLAG_SHADOW: u8 = 8;

/// Why a decision was logged: a set of these bits. A decision the sample
/// took and an always rule also took has both.
pub mod why {
    /// The sample (by key or request id, at the rate that applies).
    pub const SAMPLE: u8 = 1;
    /// `always = ["non_primary"]`.
    pub const NON_PRIMARY: u8 = 2;
    /// `always = ["errors"]`.
    pub const ERRORS: u8 = 4;
    /// `always_log_shadow_diff`: a shadow version's scores were that far
    /// from the returned ones.
    pub const SHADOW_DIFF: u8 = 8;

    /// The always rules in `bits`, as the `always` column names them
    /// (comma-separated); `None` for a decision only the sample took.
    pub fn always_name(bits: u8) -> Option<&'static str> {
        match bits & (NON_PRIMARY | ERRORS | SHADOW_DIFF) {
            0 => None,
            NON_PRIMARY => Some("non_primary"),
            ERRORS => Some("errors"),
            SHADOW_DIFF => Some("shadow_diff"),
            b if b == NON_PRIMARY | ERRORS => Some("non_primary,errors"),
            b if b == NON_PRIMARY | SHADOW_DIFF => Some("non_primary,shadow_diff"),
            b if b == ERRORS | SHADOW_DIFF => Some("errors,shadow_diff"),
            _ => Some("non_primary,errors,shadow_diff"),
        }
    }
}

/// Fixed fields: version, id, client, time, budget, server time, model
/// version, status, tier, reason, why logged, flags, missing, rows, row
/// width.
const FIXED_BYTES: usize = 1 + 8 + 4 + 8 + 4 + 4 + 4 + 1 + 1 + 1 + 1 + 1 + 2 + 4 + 4;

/// A shadow version's scores of a logged decision (one per row), when the
/// decision waited for them (`always_log_shadow_diff`).
#[derive(Clone, Copy, Debug)]
pub struct ShadowRef<'a> {
    pub version: u32,
    pub scores: &'a [f32],
}

/// Which part of the input row a span of floats holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span<'a> {
    /// A feature group's name, `context` or `context_id`.
    pub name: &'a str,
    pub offset: u32,
    pub dim: u32,
    /// The group's replica position when it was read: the change-stream
    /// sequence its refresher had applied, or its file's checkpoint; 0 for
    /// the context spans and a group at no position.
    pub position: u64,
}

impl Span<'_> {
    pub const EMPTY: Span<'static> = Span { name: "", offset: 0, dim: 0, position: 0 };
}

/// One group's keys, as the request carried them.
#[derive(Clone, Copy)]
pub enum KeysRef<'a> {
    None,
    One(u64),
    Ids(flatbuffers::Vector<'a, u64>),
    Strs(flatbuffers::Vector<'a, flatbuffers::ForwardsUOffset<&'a str>>),
}

/// The spans and keys of a record: borrowed parts, or encoded ahead by
/// [`encode_middle`].
#[derive(Clone, Copy)]
pub enum Middle<'a> {
    Parts { spans: &'a [Span<'a>], keys: &'a [(&'a str, KeysRef<'a>)] },
    Encoded(&'a [u8]),
}

impl Middle<'_> {
    fn len(&self) -> usize {
        match self {
            Middle::Parts { spans, keys } => middle_len(spans, keys),
            Middle::Encoded(b) => b.len(),
        }
    }
}

/// Bytes [`encode_middle`] writes for `spans` and `keys`.
pub fn middle_len(spans: &[Span<'_>], keys: &[(&str, KeysRef<'_>)]) -> usize {
    let mut n = 1 + spans.iter().take(SPANS_MAX).map(|s| 1 + name_len(s.name) + 16).sum::<usize>();
    n += 1;
    for (name, keys) in keys.iter().take(KEY_GROUPS_MAX) {
        n += 1 + name_len(name) + 1 + 4;
        n += match keys {
            KeysRef::None => 0,
            KeysRef::One(_) => 8,
            KeysRef::Ids(v) => 8 * v.len(),
            KeysRef::Strs(v) => v.iter().map(|k| 2 + cut(k, u16::MAX as usize).len()).sum(),
        };
    }
    n
}

/// Writes the spans and keys into `out`, which is exactly
/// [`middle_len`] bytes.
pub fn encode_middle(spans: &[Span<'_>], keys: &[(&str, KeysRef<'_>)], out: &mut [u8]) {
    let mut w = Put { out, at: 0 };
    w.middle(spans, keys);
    debug_assert_eq!(w.at, w.out.len(), "middle_len and encode_middle disagree");
}

/// A decision's parts, borrowed from the shard's request path.
pub struct DecisionRef<'a> {
    pub request_id: u64,
    pub client_id: u32,
    pub received_unix_ns: i64,
    pub budget_us: u32,
    pub server_us: u32,
    pub model: &'a str,
    pub model_version: u32,
    /// `Status.0`, `Tier.0`, `Reason.0`.
    pub status: u8,
    pub tier: u8,
    pub reason: u8,
    pub features_missing: u16,
    pub features_stale: bool,
    pub rows: u32,
    pub row_dim: u32,
    pub middle: Middle<'a>,
    /// `rows × row_dim` floats, as the kernel saw them.
    pub x: Option<&'a [f32]>,
    /// `rows` scores, as answered.
    pub scores: Option<&'a [f32]>,
    /// Why it is logged: bits of [`why`].
    pub why: u8,
    /// The shadow version's `rows` scores, when it waited for them.
    pub shadow: Option<ShadowRef<'a>>,
}

#[cfg(test)]
impl DecisionRef<'static> {
    /// A decision of zeros and nothing else, for a test to fill in the
    /// fields it is about.
    pub(crate) const BLANK: DecisionRef<'static> = DecisionRef {
        request_id: 0,
        client_id: 0,
        received_unix_ns: 0,
        budget_us: 0,
        server_us: 0,
        model: "",
        model_version: 0,
        status: 0,
        tier: 0,
        reason: 0,
        features_missing: 0,
        features_stale: false,
        rows: 0,
        row_dim: 0,
        middle: Middle::Parts { spans: &[], keys: &[] },
        x: None,
        scores: None,
        why: 0,
        shadow: None,
    };
}

fn name_len(s: &str) -> usize {
    cut(s, NAME_BYTES_MAX).len()
}

/// `s` cut to at most `bytes_max` bytes at a character's start, so the
/// record holds whole UTF-8 (the writer drops a record that does not).
fn cut(s: &str, bytes_max: usize) -> &str {
    let mut end = s.len().min(bytes_max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl DecisionRef<'_> {
    pub fn encoded_len(&self) -> usize {
        let mut n = FIXED_BYTES + 2 + cut(self.model, u16::MAX as usize).len();
        n += self.middle.len();
        n += self.x.map_or(0, |x| 4 * x.len());
        n += self.scores.map_or(0, |s| 4 * s.len());
        n += self.shadow.map_or(0, |s| 4 + 4 * s.scores.len());
        n
    }

    /// Writes the record into `out`, which is exactly `encoded_len` bytes.
    pub fn encode(&self, out: &mut [u8]) {
        let mut w = Put { out, at: 0 };
        w.u8(RECORD_VERSION);
        w.u64(self.request_id);
        w.u32(self.client_id);
        w.u64(self.received_unix_ns as u64);
        w.u32(self.budget_us);
        w.u32(self.server_us);
        w.u32(self.model_version);
        w.u8(self.status);
        w.u8(self.tier);
        w.u8(self.reason);
        w.u8(self.why);
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        let flags = flag(self.features_stale, FLAG_STALE)
            | flag(self.x.is_some(), FLAG_X)
            | flag(self.scores.is_some(), FLAG_SCORES)
            | flag(self.shadow.is_some(), FLAG_SHADOW);
        w.u8(flags);
        w.u16(self.features_missing);
        w.u32(self.rows);
        w.u32(self.row_dim);
        let model = cut(self.model, u16::MAX as usize).as_bytes();
        w.u16(model.len() as u16);
        w.bytes(model);
        match self.middle {
            Middle::Parts { spans, keys } => w.middle(spans, keys),
            Middle::Encoded(b) => w.bytes(b),
        }
        for part in [self.x, self.scores] {
            w.floats(part.unwrap_or_default());
        }
        if let Some(s) = self.shadow {
            w.u32(s.version);
            w.floats(s.scores);
        }
        debug_assert_eq!(w.at, w.out.len(), "encoded_len and encode disagree");
    }
}

/// A cursor over the ring's bytes for one record.
struct Put<'b> {
    out: &'b mut [u8],
    at: usize,
}

impl Put<'_> {
    fn bytes(&mut self, b: &[u8]) {
        self.out[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    /// Floats as their little-endian bits, in one bounds check: the input
    /// rows are most of a record's bytes, and the shard pays for them.
    fn floats(&mut self, v: &[f32]) {
        let out = &mut self.out[self.at..self.at + 4 * v.len()];
        #[cfg(target_endian = "little")]
        out.copy_from_slice(bytemuck::cast_slice(v));
        #[cfg(not(target_endian = "little"))]
        for (o, f) in out.chunks_exact_mut(4).zip(v) {
            o.copy_from_slice(&f.to_le_bytes());
        }
        self.at += 4 * v.len();
    }
    fn middle(&mut self, spans: &[Span<'_>], keys: &[(&str, KeysRef<'_>)]) {
        self.u8(spans.len().min(SPANS_MAX) as u8);
        for s in spans.iter().take(SPANS_MAX) {
            self.name(s.name);
            self.u32(s.offset);
            self.u32(s.dim);
            self.u64(s.position);
        }
        self.u8(keys.len().min(KEY_GROUPS_MAX) as u8);
        for (name, keys) in keys.iter().take(KEY_GROUPS_MAX) {
            self.name(name);
            match keys {
                KeysRef::None => {
                    self.u8(0);
                    self.u32(0);
                }
                KeysRef::One(id) => {
                    self.u8(0);
                    self.u32(1);
                    self.u64(*id);
                }
                KeysRef::Ids(v) => {
                    self.u8(0);
                    self.u32(v.len() as u32);
                    for id in v.iter() {
                        self.u64(id);
                    }
                }
                KeysRef::Strs(v) => {
                    self.u8(1);
                    self.u32(v.len() as u32);
                    for k in v.iter() {
                        let k = cut(k, u16::MAX as usize).as_bytes();
                        self.u16(k.len() as u16);
                        self.bytes(k);
                    }
                }
            }
        }
    }
    fn name(&mut self, s: &str) {
        let b = cut(s, NAME_BYTES_MAX).as_bytes();
        self.u8(b.len() as u8);
        self.bytes(b);
    }
}

/// A group's keys, owned.
#[derive(Clone, Debug, PartialEq)]
pub enum Keys {
    Ids(Vec<u64>),
    Strs(Vec<String>),
}

/// Little-endian `f32`s borrowed from a record. The writer copies each
/// float once, from the ring into its column, instead of first into a
/// decoded `Vec` (a tenth of its time at 32 x 80 floats a decision).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Floats<'a>(&'a [u8]);

impl<'a> Floats<'a> {
    /// The floats of `bytes`, a whole number of them.
    fn new(bytes: &'a [u8]) -> Floats<'a> {
        assert!(bytes.len().is_multiple_of(4), "whole floats");
        Floats(bytes)
    }

    pub fn len(&self) -> usize {
        self.0.len() / 4
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<f32> {
        let b = self.0.get(4 * i..4 * i + 4)?;
        Some(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn iter(&self) -> impl Iterator<Item = f32> + 'a {
        self.0.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    }

    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = Vec::new();
        self.copy_into(&mut v);
        v
    }

    /// The floats into `out` (its length made theirs), in one copy on a
    /// little-endian machine: the writer's way to the input rows, most of
    /// a record's bytes.
    pub fn copy_into(&self, out: &mut Vec<f32>) {
        out.resize(self.len(), 0.0);
        #[cfg(target_endian = "little")]
        bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(self.0);
        #[cfg(not(target_endian = "little"))]
        for (o, f) in out.iter_mut().zip(self.iter()) {
            *o = f;
        }
    }
}

/// A decoded decision, on the writer's side: its floats borrow the record.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision<'a> {
    pub request_id: u64,
    pub client_id: u32,
    pub received_unix_ns: i64,
    pub budget_us: u32,
    pub server_us: u32,
    pub model: String,
    pub model_version: u32,
    pub status: u8,
    pub tier: u8,
    pub reason: u8,
    pub features_missing: u16,
    pub features_stale: bool,
    pub rows: u32,
    pub row_dim: u32,
    /// (name, offset, dim) of each span of the input row.
    pub spans: Vec<(String, u32, u32)>,
    /// Each span's replica position ([`Span::position`]), in span order.
    pub positions: Vec<u64>,
    pub keys: Vec<(String, Keys)>,
    pub x: Option<Floats<'a>>,
    pub scores: Option<Floats<'a>>,
    /// Bits of [`why`].
    pub why: u8,
    /// The shadow version and its scores, when the decision waited for them.
    pub shadow: Option<(u32, Floats<'a>)>,
}

/// A record the writer cannot read (never written by this version's shards).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("record ends at byte {at}, inside a field")]
    Truncated { at: usize },
    #[error("record format version {0}, this build reads {RECORD_VERSION}")]
    Version(u8),
    #[error("a name or key that is not UTF-8")]
    Utf8,
    #[error("{0} bytes after the record's last field")]
    Trailing(usize),
}

struct Get<'b> {
    b: &'b [u8],
    at: usize,
}

impl<'b> Get<'b> {
    fn take(&mut self, n: usize) -> Result<&'b [u8], RecordError> {
        let end =
            self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or(RecordError::Truncated { at: self.at })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, RecordError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap_or_default()))
    }
    fn u32(&mut self) -> Result<u32, RecordError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64, RecordError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn str(&mut self, n: usize) -> Result<String, RecordError> {
        std::str::from_utf8(self.take(n)?).map(str::to_owned).map_err(|_| RecordError::Utf8)
    }
    fn floats(&mut self, n: usize) -> Result<Floats<'b>, RecordError> {
        Ok(Floats::new(self.take(n.checked_mul(4).ok_or(RecordError::Truncated { at: self.at })?)?))
    }
}

impl Decision<'_> {
    pub fn decode(b: &[u8]) -> Result<Decision<'_>, RecordError> {
        let mut r = Get { b, at: 0 };
        let version = r.u8()?;
        if version != RECORD_VERSION {
            return Err(RecordError::Version(version));
        }
        let request_id = r.u64()?;
        let client_id = r.u32()?;
        let received_unix_ns = r.u64()? as i64;
        let budget_us = r.u32()?;
        let server_us = r.u32()?;
        let model_version = r.u32()?;
        let (status, tier, reason, why, flags) = (r.u8()?, r.u8()?, r.u8()?, r.u8()?, r.u8()?);
        let features_missing = r.u16()?;
        let rows = r.u32()?;
        let row_dim = r.u32()?;
        let n = r.u16()? as usize;
        let model = r.str(n)?;
        let mut spans = Vec::new();
        let mut positions = Vec::new();
        for _ in 0..r.u8()? {
            let n = r.u8()? as usize;
            spans.push((r.str(n)?, r.u32()?, r.u32()?));
            positions.push(r.u64()?);
        }
        let mut keys = Vec::new();
        for _ in 0..r.u8()? {
            let n = r.u8()? as usize;
            let name = r.str(n)?;
            let kind = r.u8()?;
            let count = r.u32()? as usize;
            // Each key takes at least 2 bytes: a count past the record's
            // end is refused before anything is reserved for it.
            if count > b.len() / 2 {
                return Err(RecordError::Truncated { at: r.at });
            }
            keys.push((
                name,
                if kind == 0 {
                    Keys::Ids((0..count).map(|_| r.u64()).collect::<Result<_, _>>()?)
                } else {
                    Keys::Strs(
                        (0..count)
                            .map(|_| {
                                let n = r.u16()? as usize;
                                r.str(n)
                            })
                            .collect::<Result<_, _>>()?,
                    )
                },
            ));
        }
        let x_len = (rows as usize).checked_mul(row_dim as usize).ok_or(RecordError::Truncated { at: r.at })?;
        let x = if flags & FLAG_X != 0 { Some(r.floats(x_len)?) } else { None };
        let scores = if flags & FLAG_SCORES != 0 { Some(r.floats(rows as usize)?) } else { None };
        let shadow = if flags & FLAG_SHADOW != 0 { Some((r.u32()?, r.floats(rows as usize)?)) } else { None };
        if r.at != b.len() {
            return Err(RecordError::Trailing(b.len() - r.at));
        }
        Ok(Decision {
            request_id,
            client_id,
            received_unix_ns,
            budget_us,
            server_us,
            model,
            model_version,
            status,
            tier,
            reason,
            features_missing,
            features_stale: flags & FLAG_STALE != 0,
            rows,
            row_dim,
            spans,
            positions,
            keys,
            x,
            scores,
            why,
            shadow,
        })
    }
}

/// A request's payload (its frame without the length prefix) with these
/// key groups and nothing else: tests borrow the `KeysRef::Ids` and
/// `KeysRef::Strs` keys of a record from it, as a shard does.
#[cfg(test)]
pub(crate) fn request_payload(groups: Vec<(String, crate::wire::GroupKeySpec)>) -> Vec<u8> {
    let spec = crate::wire::RequestSpec {
        request_id: 1,
        model: String::new(),
        budget_us: 0,
        priority: 0,
        client_id: 0,
        user_id: 0,
        item_ids: Vec::new(),
        context: Vec::new(),
        context_ids: Vec::new(),
        groups,
        ..crate::wire::RequestSpec::default()
    };
    let mut out = Vec::new();
    crate::wire::RequestEncoder::new().encode(&spec, &mut out);
    out.split_off(crate::wire::FRAME_PREFIX_BYTES)
}

/// Limits [`request_payload`]'s payloads decode within.
#[cfg(test)]
pub(crate) const PAYLOAD_LIMITS: crate::wire::RequestLimits =
    crate::wire::RequestLimits { frame_bytes_max: 1 << 16, candidates_max: 64, context_len_max: 64 };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips() {
        use crate::wire::GroupKeySpec;
        let payload = request_payload(vec![
            ("item".into(), GroupKeySpec::Ids(vec![7, u64::MAX, 0])),
            ("card".into(), GroupKeySpec::Strs(vec!["card-1".into(), "ünïcode".into()])),
        ]);
        let request = crate::wire::decode_request(&payload, &PAYLOAD_LIMITS).unwrap();
        let groups = request.groups();
        let ids = groups.get(0).ids().unwrap();
        let strs = groups.get(1).keys().unwrap();
        let x: Vec<f32> = (0..3 * 5).map(|i| i as f32 * 0.5 - 1.0).collect();
        let scores = [0.25f32, f32::MIN_POSITIVE, -0.0];
        let spans = [
            Span { name: "user", offset: 0, dim: 2, position: 1_234 },
            Span { name: "context", offset: 2, dim: 3, position: 0 },
        ];
        let keys = [("user", KeysRef::One(42)), ("item", KeysRef::Ids(ids)), ("card", KeysRef::Strs(strs))];
        let d = DecisionRef {
            request_id: u64::MAX - 1,
            client_id: 9,
            received_unix_ns: 1_764_900_000_123_456_789,
            budget_us: 5000,
            server_us: 321,
            model: "ranker",
            model_version: 3,
            status: 0,
            tier: 2,
            reason: 1,
            features_missing: 4,
            features_stale: true,
            rows: 3,
            row_dim: 5,
            middle: Middle::Parts { spans: &spans, keys: &keys },
            x: Some(&x),
            scores: Some(&scores),
            why: why::SAMPLE | why::SHADOW_DIFF,
            shadow: Some(ShadowRef { version: 4, scores: &[0.5, 0.75, 1.0] }),
        };
        let mut out = vec![0u8; d.encoded_len()];
        d.encode(&mut out);
        let back = Decision::decode(&out).unwrap();
        assert_eq!(back.request_id, u64::MAX - 1);
        assert_eq!(
            (back.client_id, back.received_unix_ns, back.budget_us, back.server_us),
            (9, d.received_unix_ns, 5000, 321)
        );
        assert_eq!((back.model.as_str(), back.model_version), ("ranker", 3));
        assert_eq!(
            (back.status, back.tier, back.reason, back.features_missing, back.features_stale),
            (0, 2, 1, 4, true)
        );
        assert_eq!(back.spans, vec![("user".into(), 0, 2), ("context".into(), 2, 3)]);
        assert_eq!(back.positions, vec![1_234, 0]);
        assert_eq!(
            back.keys,
            vec![
                ("user".into(), Keys::Ids(vec![42])),
                ("item".into(), Keys::Ids(vec![7, u64::MAX, 0])),
                ("card".into(), Keys::Strs(vec!["card-1".into(), "ünïcode".into()])),
            ]
        );
        assert_eq!(back.x.map(|x| x.to_vec()), Some(x.clone()));
        let bits = |s: &[f32]| s.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.scores.unwrap().to_vec()), bits(&scores));
        assert_eq!(back.scores.unwrap().get(1), Some(f32::MIN_POSITIVE));
        assert_eq!(back.scores.unwrap().get(3), None);
        assert_eq!(back.why, why::SAMPLE | why::SHADOW_DIFF);
        assert_eq!(back.shadow.map(|(v, s)| (v, s.to_vec())), Some((4, vec![0.5, 0.75, 1.0])));
        assert_eq!(why::always_name(back.why), Some("shadow_diff"));
        assert_eq!(why::always_name(why::SAMPLE), None);

        // The middle encoded ahead (a handed-off request's) makes the same record.
        let mut middle = vec![0u8; middle_len(&spans, &keys)];
        encode_middle(&spans, &keys, &mut middle);
        let ahead = DecisionRef { middle: Middle::Encoded(&middle), ..d };
        let mut again = vec![0u8; ahead.encoded_len()];
        ahead.encode(&mut again);
        assert_eq!(again, out);

        // Every cut of it is refused with a typed error, never a panic.
        for cut in 0..out.len() {
            assert!(Decision::decode(&out[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = out.clone();
        longer.push(0);
        assert_eq!(Decision::decode(&longer), Err(RecordError::Trailing(1)));
        out[0] = RECORD_VERSION - 1;
        assert_eq!(Decision::decode(&out), Err(RecordError::Version(RECORD_VERSION - 1)));
    }

    #[test]
    fn names_too_long_are_cut_at_a_character_and_still_decode() {
        // 'é' is two bytes, straddling each limit.
        let span = format!("{}é", "s".repeat(NAME_BYTES_MAX - 1));
        let group = format!("{}é", "g".repeat(NAME_BYTES_MAX - 1));
        let model = format!("{}é", "m".repeat(u16::MAX as usize - 1));
        let spans = [Span { name: &span, offset: 0, dim: 1, position: 0 }];
        let keys = [(group.as_str(), KeysRef::One(1))];
        let d = DecisionRef {
            request_id: 1,
            model: &model,
            rows: 1,
            row_dim: 1,
            middle: Middle::Parts { spans: &spans, keys: &keys },
            x: Some(&[0.5]),
            scores: Some(&[0.25]),
            why: why::SAMPLE,
            ..DecisionRef::BLANK
        };
        let mut out = vec![0u8; d.encoded_len()];
        d.encode(&mut out);
        let back = Decision::decode(&out).unwrap();
        assert_eq!(back.model, model[..u16::MAX as usize - 1]);
        assert_eq!(back.spans[0].0, span[..NAME_BYTES_MAX - 1]);
        assert_eq!(back.keys[0].0, group[..NAME_BYTES_MAX - 1]);
    }

    #[test]
    fn a_failure_without_rows_or_scores_round_trips() {
        let d = DecisionRef {
            request_id: 1,
            status: 4,
            row_dim: 7,
            middle: Middle::Parts { spans: &[], keys: &[("user", KeysRef::None)] },
            why: why::ERRORS,
            ..DecisionRef::BLANK
        };
        let mut out = vec![0u8; d.encoded_len()];
        d.encode(&mut out);
        let back = Decision::decode(&out).unwrap();
        assert_eq!((back.status, back.x, back.scores, back.shadow), (4, None, None, None));
        assert_eq!(back.keys, vec![("user".into(), Keys::Ids(vec![]))]);
    }
}
