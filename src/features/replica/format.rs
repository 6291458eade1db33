//! Byte layout of a replica file: the superblock, the two checkpoint records,
//! section offsets, the row payload codecs (f32, f16, int8 with a scale) and
//! the string-key codec and hash.
//!
//! Kept apart from the mapping code so that every offset is computed in one
//! place and checked once, with overflow, before anything is dereferenced.
//!
//! The key kind sits in superblock bytes 20..24, which files written before
//! string keys existed hold as zero: code 0 is u64 keys, so those files open
//! and serve exactly as before, under the same format version. A string-keyed
//! file's rows are longer than its superblock's other fields imply to a build
//! that predates the field, so such a build refuses it as damaged (its
//! length), never serves it.
//!
//! A group with a parent (`ad` → `campaign`) stores, in each row, a link:
//! the key of the parent's row. Its kind (the parent's key kind) sits in the
//! upper half of the same superblock word, which files without links hold
//! as zero; a build that predates links reads the word as an unknown key
//! kind and refuses the file.

use super::{ReplicaError, DIM_MAX, FORMAT_VERSION, GROUP_NAME_BYTES_MAX, KEY_BYTES_MAX, MAGIC, ROW_CAPACITY_MAX};

pub const SUPERBLOCK_BYTES: usize = 64;
pub const CHECKPOINT_OFFSETS: [usize; 2] = [64, 128];
pub const DEFAULT_OFFSET: usize = 192;
pub const SLOT_BYTES: usize = 16;
/// seq u32, crc u32, key u64.
pub const ROW_HEADER_BYTES: usize = 16;

pub const TAG_EMPTY: u32 = 0;
pub const TAG_USED: u32 = 1;
pub const TAG_TOMBSTONE: u32 = 2;

/// How a group's vectors are stored. Readers always get f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    /// Exact.
    #[default]
    F32,
    /// Half the bytes; relative error at most 2^-11 for normal values.
    F16,
    /// A quarter of the bytes plus a per-row scale (max |x| / 127);
    /// absolute error at most scale / 2 per element.
    Int8,
}

impl Storage {
    pub fn code(self) -> u32 {
        match self {
            Storage::F32 => 0,
            Storage::F16 => 1,
            Storage::Int8 => 2,
        }
    }

    pub fn from_code(code: u32) -> Option<Storage> {
        match code {
            0 => Some(Storage::F32),
            1 => Some(Storage::F16),
            2 => Some(Storage::Int8),
            _ => None,
        }
    }

    pub fn parse(s: &str) -> Option<Storage> {
        match s {
            "f32" => Some(Storage::F32),
            "f16" => Some(Storage::F16),
            "int8" => Some(Storage::Int8),
            _ => None,
        }
    }

    /// Payload size in 32-bit words, so that every row is read and written
    /// with aligned word-sized atomics.
    pub fn payload_words(self, dim: usize) -> usize {
        match self {
            Storage::F32 => dim,
            Storage::F16 => dim.div_ceil(2),
            Storage::Int8 => 1 + dim.div_ceil(4),
        }
    }

    /// Encodes `v` into payload words.
    pub fn encode(self, v: &[f32], out: &mut [u32]) {
        debug_assert_eq!(out.len(), self.payload_words(v.len()));
        match self {
            Storage::F32 => {
                for (o, x) in out.iter_mut().zip(v) {
                    *o = x.to_bits();
                }
            }
            Storage::F16 => {
                out.fill(0);
                for (i, x) in v.iter().enumerate() {
                    let h = u32::from(half::f16::from_f32(*x).to_bits());
                    out[i / 2] |= h << ((i % 2) * 16);
                }
            }
            Storage::Int8 => {
                let max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let scale = if max > 0.0 { max / 127.0 } else { 0.0 };
                out.fill(0);
                out[0] = scale.to_bits();
                for (i, x) in v.iter().enumerate() {
                    // -128 is never a quantized value: it stores a NaN.
                    let q = if x.is_nan() {
                        i8::MIN
                    } else if scale > 0.0 {
                        (x / scale).round().clamp(-127.0, 127.0) as i8
                    } else {
                        0
                    };
                    out[1 + i / 4] |= u32::from(q as u8) << ((i % 4) * 8);
                }
            }
        }
    }

    /// Decodes a row's payload words, in order, into `out`, the row's f32
    /// vector (an int8 row's first word is its scale). The storage is
    /// matched once, outside the loop over words: a lookup copies every
    /// word of every row it serves, so that loop must stay tight.
    #[inline(always)]
    pub fn decode(self, mut words: impl Iterator<Item = u32>, out: &mut [f32]) {
        match self {
            Storage::F32 => {
                for (o, w) in out.iter_mut().zip(words) {
                    *o = f32::from_bits(w);
                }
            }
            Storage::F16 => {
                for (pair, w) in out.chunks_mut(2).zip(words) {
                    for (j, o) in pair.iter_mut().enumerate() {
                        *o = half::f16::from_bits((w >> (j * 16)) as u16).to_f32();
                    }
                }
            }
            Storage::Int8 => {
                let scale = f32::from_bits(words.next().unwrap_or(0));
                for (quad, w) in out.chunks_mut(4).zip(words) {
                    for (j, o) in quad.iter_mut().enumerate() {
                        let q = ((w >> (j * 8)) as u8) as i8;
                        *o = if q == i8::MIN { f32::NAN } else { f32::from(q) * scale };
                    }
                }
            }
        }
    }
}

/// How a file's rows are keyed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeyKind {
    /// A u64 entity id, stored in the row header and the index slot.
    #[default]
    U64,
    /// Byte strings of at most `bytes_max` bytes (1 to [`KEY_BYTES_MAX`]):
    /// the slot and the row header hold the key's [`key_hash`], and the row
    /// holds the whole key (length, then bytes), which a lookup compares.
    Str { bytes_max: u32 },
}

impl std::fmt::Display for KeyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyKind::U64 => f.write_str("u64 keys"),
            KeyKind::Str { bytes_max } => write!(f, "string keys of up to {bytes_max} bytes"),
        }
    }
}

impl KeyKind {
    /// Superblock code: 0 for u64 keys (what every file written before
    /// string keys holds there), else the string keys' byte limit.
    pub fn code(self) -> u32 {
        match self {
            KeyKind::U64 => 0,
            KeyKind::Str { bytes_max } => bytes_max,
        }
    }

    pub fn from_code(code: u32) -> Option<KeyKind> {
        match code {
            0 => Some(KeyKind::U64),
            1..=KEY_BYTES_MAX => Some(KeyKind::Str { bytes_max: code }),
            _ => None,
        }
    }

    /// Words a row spends on the key beyond its header: none for u64 keys;
    /// a length word and the bytes, zero-padded to whole words, for strings.
    pub fn key_words(self) -> usize {
        match self {
            KeyKind::U64 => 0,
            KeyKind::Str { bytes_max } => 1 + (bytes_max as usize).div_ceil(4),
        }
    }

    /// Words a row spends on a link to a parent keyed by this kind: a
    /// presence word (0: the row names no parent), then the parent's key:
    /// a u64 as two words (low first), a string as its row encoding.
    pub fn link_words(self) -> usize {
        1 + match self {
            KeyKind::U64 => 2,
            KeyKind::Str { .. } => self.key_words(),
        }
    }
}

/// Most words a link takes in a row: a presence word and the longest
/// string key's encoding.
pub const LINK_WORDS_MAX: usize = 1 + KEY_WORDS_MAX;

/// Writes the row encoding of a link to `parent` (none: the row names no
/// parent) into `out`, [`KeyKind::link_words`] of the parent's kind long.
/// The caller has checked that the key fits the kind ([`EntityKey::fits`]).
pub fn encode_link(parent: Option<EntityKey<'_>>, out: &mut [u32]) {
    out.fill(0);
    match parent {
        None => {}
        Some(EntityKey::Id(id)) => {
            out[0] = 1;
            out[1] = id as u32;
            out[2] = (id >> 32) as u32;
        }
        Some(EntityKey::Str(bytes)) => {
            out[0] = 1;
            encode_key(bytes, &mut out[1..]);
        }
    }
}

/// The parent key a row's link words name, its string bytes copied into
/// `buf`; none when the row names no parent or the words are no link to a
/// key of `kind` (a reader never follows a malformed link).
pub fn decode_link<'b>(
    words: &[u32],
    kind: KeyKind,
    buf: &'b mut [u8; KEY_BYTES_MAX as usize],
) -> Option<EntityKey<'b>> {
    if words.first() != Some(&1) {
        return None;
    }
    match kind {
        KeyKind::U64 => Some(EntityKey::Id(u64::from(words[1]) | u64::from(words[2]) << 32)),
        KeyKind::Str { bytes_max } => {
            let len = words[1] as usize;
            if len == 0 || len > bytes_max as usize || len > (words.len() - 2) * 4 {
                return None;
            }
            for (chunk, w) in buf.chunks_exact_mut(4).zip(&words[2..]) {
                chunk.copy_from_slice(&w.to_le_bytes());
            }
            Some(EntityKey::Str(&buf[..len]))
        }
    }
}

/// An entity's key: a u64 id, or the bytes of a string-keyed group's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntityKey<'a> {
    Id(u64),
    Str(&'a [u8]),
}

impl EntityKey<'_> {
    /// What the bucket formula hashes: the id itself, or the string's [`key_hash`].
    pub fn bucket_hash(self) -> u64 {
        match self {
            EntityKey::Id(id) => id,
            EntityKey::Str(bytes) => key_hash(bytes),
        }
    }

    pub fn to_buf(self) -> EntityKeyBuf {
        match self {
            EntityKey::Id(id) => EntityKeyBuf::Id(id),
            EntityKey::Str(bytes) => EntityKeyBuf::Str(bytes.to_vec()),
        }
    }

    /// Whether a group keyed by `kind` takes this key.
    pub fn fits(self, kind: KeyKind) -> bool {
        match (self, kind) {
            (EntityKey::Id(_), KeyKind::U64) => true,
            (EntityKey::Str(bytes), KeyKind::Str { bytes_max }) => {
                !bytes.is_empty() && bytes.len() <= bytes_max as usize
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for EntityKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EntityKey::Id(id) => write!(f, "{id}"),
            EntityKey::Str(bytes) => f.write_str(&String::from_utf8_lossy(bytes)),
        }
    }
}

/// An [`EntityKey`] that owns its bytes: what outlives the reply it was parsed from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EntityKeyBuf {
    Id(u64),
    Str(Vec<u8>),
}

impl EntityKeyBuf {
    pub fn as_key(&self) -> EntityKey<'_> {
        match self {
            EntityKeyBuf::Id(id) => EntityKey::Id(*id),
            EntityKeyBuf::Str(bytes) => EntityKey::Str(bytes),
        }
    }
}

/// The 64-bit hash of a string key: xxh3-64 with seed 0, a published
/// algorithm with reference vectors (checked in the tests), so a file
/// written by one build, machine or process is found by every other.
#[inline]
pub fn key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

/// Most words a string key takes in a row: its length, then
/// [`KEY_BYTES_MAX`] bytes.
pub const KEY_WORDS_MAX: usize = 1 + KEY_BYTES_MAX as usize / 4;

/// Writes the row encoding of `key` into `out` (a row's key words): the
/// length, then the bytes little-endian, zero-padded. Built once per lookup
/// and compared word by word against the stored key.
#[inline]
pub fn encode_key(key: &[u8], out: &mut [u32]) {
    debug_assert!(key.len() <= (out.len() - 1) * 4);
    let (len, words) = out.split_first_mut().expect("a length word");
    *len = key.len() as u32;
    let (whole, tail) = key.as_chunks::<4>();
    // A key too long for `out` (callers check first) is cut, never a panic:
    // its length word still tells it from every stored key.
    let (full, rest) = words.split_at_mut(whole.len().min(words.len()));
    for (o, c) in full.iter_mut().zip(whole) {
        *o = u32::from_le_bytes(*c);
    }
    rest.fill(0);
    if let Some(o) = rest.first_mut().filter(|_| !tail.is_empty()) {
        let mut w = [0u8; 4];
        w[..tail.len()].copy_from_slice(tail);
        *o = u32::from_le_bytes(w);
    }
}

/// The key bytes a row's key words hold, into `out`; false when the words
/// are no encoding of a key of at most `bytes_max` bytes (a length past the
/// limit, or padding that is not zero).
pub fn decode_key(words: &[u32], bytes_max: u32, out: &mut Vec<u8>) -> bool {
    out.clear();
    let len = words[0] as usize;
    if len > bytes_max as usize || len > (words.len() - 1) * 4 {
        return false;
    }
    out.extend(words[1..].iter().flat_map(|w| w.to_le_bytes()));
    let padding_zero = out[len..].iter().all(|&b| b == 0);
    out.truncate(len);
    padding_zero
}

/// The last change from Redis that this file contains: the stream's epoch,
/// the sequence number of the last applied entry, and that entry's write time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    pub epoch: u64,
    pub seq: u64,
    pub change_unix_ms: u64,
}

/// The decoded superblock plus the live row count found at open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub dim: u32,
    pub storage: Storage,
    pub slot_count: u64,
    pub row_capacity: u64,
    pub group: String,
    pub keys: KeyKind,
    /// The key kind of the parent each row links to; none for a group
    /// without a parent.
    pub link: Option<KeyKind>,
    /// Rows padded to whole cache lines (see [`Layout::new`]): set in files
    /// this build creates where padding changes the stride.
    pub line_aligned: bool,
    /// Keys present when the file was opened.
    pub row_count: u64,
}

/// Section offsets derived from a header, computed with overflow checks.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub index_offset: usize,
    pub rows_offset: usize,
    pub row_stride: usize,
    /// Words of a string key in a row (0 for u64 keys); they precede the
    /// link and the payload, and the row CRC covers them.
    pub key_words: usize,
    /// Words of the link to a parent row (0 without a parent); between the
    /// key and the payload, covered by the row CRC.
    pub link_words: usize,
    pub payload_words: usize,
    pub file_bytes: usize,
}

pub fn align(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Layout {
    /// Section offsets of a file with these rows. A row is 16-byte aligned;
    /// a stride of 48 past a multiple of 64 bytes (a 176-byte row: a u64 row
    /// of 40 floats, or one of 32 floats with a 16-byte string key) puts
    /// every other row across one more cache line than its size needs (3.5
    /// lines on average for 176 bytes, against 3), and every line is one
    /// more load per lookup. With `line_aligned` such a stride grows by 16
    /// bytes to a whole number of lines; every other stride already spans
    /// no more lines than its size needs, whatever row it starts.
    pub fn new(
        dim: u32,
        storage: Storage,
        keys: KeyKind,
        link: Option<KeyKind>,
        line_aligned: bool,
        slot_count: u64,
        row_capacity: u64,
    ) -> Option<Layout> {
        let dim = dim as usize;
        let index_offset = align(DEFAULT_OFFSET + dim * 4, 64);
        let index_bytes = usize::try_from(slot_count).ok()?.checked_mul(SLOT_BYTES)?;
        let rows_offset = align(index_offset.checked_add(index_bytes)?, 64);
        let payload_words = storage.payload_words(dim);
        let key_words = keys.key_words();
        let link_words = link.map_or(0, KeyKind::link_words);
        let natural = align(ROW_HEADER_BYTES + (key_words + link_words + payload_words) * 4, 16);
        let row_stride = if line_aligned && natural % 64 == 48 { natural + 16 } else { natural };
        let rows_bytes = usize::try_from(row_capacity).ok()?.checked_mul(row_stride)?;
        Some(Layout {
            index_offset,
            rows_offset,
            row_stride,
            key_words,
            link_words,
            payload_words,
            file_bytes: rows_offset.checked_add(rows_bytes)?,
        })
    }

    /// Words after a row's header: the key's, the link's, then the payload's.
    pub fn row_words(&self) -> usize {
        self.key_words + self.link_words + self.payload_words
    }

    /// Where the payload starts among a row's words.
    pub fn payload_at(&self) -> usize {
        self.key_words + self.link_words
    }
}

/// Whether padding rows to whole lines changes the stride of a file with
/// these rows (what a new file records in [`Header::line_aligned`]: files
/// whose rows it would not change stay readable by builds without it).
pub fn line_padding_helps(dim: u32, storage: Storage, keys: KeyKind, link: Option<KeyKind>) -> bool {
    let stride = |aligned| Layout::new(dim, storage, keys, link, aligned, 2, 1).map(|l| l.row_stride);
    stride(true) != stride(false)
}

/// Index slots for `row_capacity` rows: a power of two at least twice as
/// many, so that a probe always meets an empty slot.
pub fn slot_count_for(row_capacity: u64) -> u64 {
    (row_capacity * 2).max(2).next_power_of_two()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Superblock: magic, version, dim, storage, key kind, slot count, row
/// capacity, group name, default-vector CRC, then a CRC of bytes 0..60.
pub fn encode_superblock(h: &Header, default_crc: u32) -> [u8; SUPERBLOCK_BYTES] {
    let mut b = [0u8; SUPERBLOCK_BYTES];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&h.dim.to_le_bytes());
    b[16..20].copy_from_slice(&h.storage.code().to_le_bytes());
    let link_code = h.link.map_or(0, |k| 1 + k.code());
    let aligned = u32::from(h.line_aligned) << 15;
    b[20..24].copy_from_slice(&(h.keys.code() | aligned | link_code << 16).to_le_bytes());
    b[24..32].copy_from_slice(&h.slot_count.to_le_bytes());
    b[32..40].copy_from_slice(&h.row_capacity.to_le_bytes());
    b[40..40 + h.group.len()].copy_from_slice(h.group.as_bytes());
    b[56..60].copy_from_slice(&default_crc.to_le_bytes());
    let crc = crc32fast::hash(&b[0..60]);
    b[60..64].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes and checks a superblock; returns the header (with `row_count` 0)
/// and the default vector's CRC.
pub fn decode_superblock(b: &[u8], path: &str) -> Result<(Header, u32), ReplicaError> {
    if b[0..8] != MAGIC {
        if b[0..7] == MAGIC[0..7] {
            return Err(ReplicaError::Version { path: path.into(), found: u32::from(b[7].wrapping_sub(b'0')) });
        }
        return Err(ReplicaError::BadMagic { path: path.into() });
    }
    if crc32fast::hash(&b[0..60]) != u32_at(b, 60) {
        return Err(ReplicaError::HeaderChecksum { path: path.into() });
    }
    let found = u32_at(b, 8);
    if found != FORMAT_VERSION {
        return Err(ReplicaError::Version { path: path.into(), found });
    }
    let bad = |what: &str| ReplicaError::Header { path: path.into(), what: what.into() };
    let dim = u32_at(b, 12);
    if dim == 0 || dim > DIM_MAX {
        return Err(bad("dimension out of range"));
    }
    let storage = Storage::from_code(u32_at(b, 16)).ok_or_else(|| bad("unknown storage type"))?;
    let keys = KeyKind::from_code(u32_at(b, 20) & 0x7FFF).ok_or_else(|| bad("unknown key kind"))?;
    let line_aligned = u32_at(b, 20) & 0x8000 != 0;
    let link = match u32_at(b, 20) >> 16 {
        0 => None,
        code => Some(KeyKind::from_code(code - 1).ok_or_else(|| bad("unknown link kind"))?),
    };
    let slot_count = u64_at(b, 24);
    let row_capacity = u64_at(b, 32);
    if row_capacity > ROW_CAPACITY_MAX {
        return Err(bad("row capacity above the limit"));
    }
    if slot_count != slot_count_for(row_capacity) {
        return Err(bad("index slot count does not match the row capacity"));
    }
    let name = &b[40..40 + GROUP_NAME_BYTES_MAX];
    let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
    let group = std::str::from_utf8(&name[..end]).map_err(|_| bad("group name is not UTF-8"))?.to_string();
    Ok((
        Header { dim, storage, slot_count, row_capacity, group, keys, link, line_aligned, row_count: 0 },
        u32_at(b, 56),
    ))
}

/// A checkpoint record: counter, cursor, then a CRC of bytes 0..60. The
/// writer alternates between the two records, so a crash while writing one
/// leaves the other intact.
pub fn encode_checkpoint(counter: u64, c: Cursor) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[0..8].copy_from_slice(&counter.to_le_bytes());
    b[8..16].copy_from_slice(&c.epoch.to_le_bytes());
    b[16..24].copy_from_slice(&c.seq.to_le_bytes());
    b[24..32].copy_from_slice(&c.change_unix_ms.to_le_bytes());
    let crc = crc32fast::hash(&b[0..60]);
    b[60..64].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The counter and cursor of a record, if it verifies.
pub fn decode_checkpoint(b: &[u8]) -> Option<(u64, Cursor)> {
    if crc32fast::hash(&b[0..60]) != u32_at(b, 60) || u64_at(b, 0) == 0 {
        return None;
    }
    Some((u64_at(b, 0), Cursor { epoch: u64_at(b, 8), seq: u64_at(b, 16), change_unix_ms: u64_at(b, 24) }))
}

/// CRC of a row's key (a u64 key or a string key's hash), then its words
/// after the header (a string key's words, then the payload), as stored in
/// its header.
pub fn row_crc(key: u64, payload: &[u32]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&key.to_le_bytes());
    // Feed whole chunks: the hasher is fast on long slices, slow on 4 bytes.
    let mut buf = [0u8; 256];
    for chunk in payload.chunks(buf.len() / 4) {
        for (b, w) in buf.chunks_exact_mut(4).zip(chunk) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.finalize()
}

#[inline]
pub fn slot_of(key: u64, slot_count: u64) -> u64 {
    // Fibonacci hashing: the top bits of key × 2^64/φ spread sequential ids.
    let shift = 64 - slot_count.trailing_zeros();
    if shift == 64 {
        return 0;
    }
    key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift
}
