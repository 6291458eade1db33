//! Feature replica v1: one memory-mapped file per feature group, key u64 → f32 vector.
//!
//! The request path reads features from local memory and never waits on a
//! network. A replica file is written whole by [`ReplicaBuilder`] into a
//! temporary file, fsynced and renamed into place, so a mapped file is never
//! modified underneath a reader. [`Replica::open`] refuses anything that is
//! not exactly what a builder wrote: wrong magic or version, a header or
//! payload checksum mismatch, a truncated or extended file, an index entry
//! that points past the rows.
//!
//! Layout (all integers little-endian, sections 64-byte aligned):
//!
//! | offset        | bytes            | what                                         |
//! |---------------|------------------|----------------------------------------------|
//! | 0             | 64               | header (see [`Header`])                      |
//! | 64            | dim × 4, padded  | default vector, served for unknown keys      |
//! | index_offset  | slot_count × 16  | open-addressing index: key u64, row u32, tag u32 |
//! | rows_offset   | row_count × dim × 4 | f32 rows                                  |
//!
//! The index has a power-of-two slot count of at least twice the row count,
//! so a linear probe from the key's hash always reaches an empty slot.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use memmap2::{Mmap, MmapOptions};

pub const MAGIC: [u8; 8] = *b"QVREPL01";
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 64;
pub const SLOT_BYTES: usize = 16;
/// Widest vector a group may hold; bounds per-request scratch sizes.
pub const DIM_MAX: u32 = 4096;
/// Longest group name stored in the header.
pub const GROUP_NAME_BYTES_MAX: usize = 16;
const SLOT_EMPTY_TAG: u32 = 0;
const SLOT_USED_TAG: u32 = 1;

/// Why a replica file cannot be built or opened.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a Quiver replica file (bad magic)")]
    BadMagic { path: String },
    #[error("{path}: replica format version {found}, this build reads version {FORMAT_VERSION}")]
    Version { path: String, found: u32 },
    #[error("{path}: header checksum mismatch: the file is corrupt")]
    HeaderChecksum { path: String },
    #[error("{path}: payload checksum mismatch: the file is corrupt")]
    PayloadChecksum { path: String },
    #[error("{path}: file is {actual} bytes, the header describes {expected}: truncated or extended")]
    Length { path: String, expected: u64, actual: u64 },
    #[error("{path}: invalid header: {what}")]
    Header { path: String, what: String },
    #[error("{path}: holds group '{found}', expected '{expected}'")]
    Group { path: String, found: String, expected: String },
    #[error("{path}: index slot {slot} points at row {row}, but there are {rows} rows")]
    IndexRow { path: String, slot: u64, row: u32, rows: u64 },
    #[error("{path}:{line}: {what}")]
    Input { path: String, line: usize, what: String },
    #[error("duplicate key {key}")]
    DuplicateKey { key: u64 },
    #[error("vector of {found} floats, the group has dimension {dim}")]
    Dim { found: usize, dim: u32 },
}

/// The decoded fixed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub dim: u32,
    pub row_count: u64,
    pub slot_count: u64,
    pub group: String,
}

struct Layout {
    index_offset: usize,
    rows_offset: usize,
    file_bytes: usize,
}

fn align64(n: usize) -> usize {
    n.div_ceil(64) * 64
}

impl Header {
    fn layout(&self) -> Option<Layout> {
        let dim = self.dim as usize;
        let index_offset = align64(HEADER_BYTES + dim * 4);
        let index_bytes = usize::try_from(self.slot_count).ok()?.checked_mul(SLOT_BYTES)?;
        let rows_offset = index_offset.checked_add(index_bytes)?;
        let row_bytes = usize::try_from(self.row_count).ok()?.checked_mul(dim * 4)?;
        Some(Layout { index_offset, rows_offset, file_bytes: rows_offset.checked_add(row_bytes)? })
    }
}

#[inline]
fn slot_of(key: u64, slot_count: u64) -> u64 {
    // Fibonacci hashing: the top bits of key × 2^64/φ spread sequential ids.
    let shift = 64 - slot_count.trailing_zeros();
    if shift == 64 {
        return 0;
    }
    key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift
}

/// An open, verified, read-only replica of one feature group.
pub struct Replica {
    map: Mmap,
    header: Header,
    index_offset: usize,
    rows_offset: usize,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("header", &self.header).finish()
    }
}

impl Replica {
    /// Maps `path`, pre-faults its pages and verifies it completely.
    /// `expected_group` guards against swapped files.
    pub fn open(path: &Path, expected_group: &str) -> Result<Replica, ReplicaError> {
        let p = path.display().to_string();
        let io = |source| ReplicaError::Io { path: p.clone(), source };
        let file = File::open(path).map_err(io)?;
        let actual = file.metadata().map_err(io)?.len();
        if actual < HEADER_BYTES as u64 {
            return Err(ReplicaError::Length { path: p, expected: HEADER_BYTES as u64, actual });
        }
        // SAFETY: replica files are only ever replaced by rename, never
        // written in place (see ReplicaBuilder::write), so the mapped bytes
        // do not change while this mapping lives.
        let map = unsafe { MmapOptions::new().populate().map(&file) }.map_err(io)?;
        let header = parse_header(&map[..HEADER_BYTES], &p)?;
        let layout =
            header.layout().ok_or_else(|| ReplicaError::Header { path: p.clone(), what: "sizes overflow".into() })?;
        if layout.file_bytes as u64 != actual {
            return Err(ReplicaError::Length { path: p, expected: layout.file_bytes as u64, actual });
        }
        let stored = u32::from_le_bytes(map[48..52].try_into().expect("4 bytes"));
        if crc32fast::hash(&map[HEADER_BYTES..]) != stored {
            return Err(ReplicaError::PayloadChecksum { path: p });
        }
        if header.group != expected_group {
            return Err(ReplicaError::Group { path: p, found: header.group, expected: expected_group.into() });
        }
        let replica = Replica { map, index_offset: layout.index_offset, rows_offset: layout.rows_offset, header };
        replica.check_index(&p)?;
        Ok(replica)
    }

    fn check_index(&self, path: &str) -> Result<(), ReplicaError> {
        for slot in 0..self.header.slot_count {
            let (_, row, tag) = self.slot(slot);
            if tag == SLOT_USED_TAG && u64::from(row) >= self.header.row_count {
                return Err(ReplicaError::IndexRow { path: path.into(), slot, row, rows: self.header.row_count });
            }
        }
        Ok(())
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn dim(&self) -> usize {
        self.header.dim as usize
    }

    #[inline]
    fn slot(&self, slot: u64) -> (u64, u32, u32) {
        let at = self.index_offset + slot as usize * SLOT_BYTES;
        let s = &self.map[at..at + SLOT_BYTES];
        (
            u64::from_le_bytes(s[0..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(s[8..12].try_into().expect("4 bytes")),
            u32::from_le_bytes(s[12..16].try_into().expect("4 bytes")),
        )
    }

    /// The row index of `key`, if present.
    #[inline]
    pub fn find(&self, key: u64) -> Option<u32> {
        let mask = self.header.slot_count - 1;
        let mut slot = slot_of(key, self.header.slot_count);
        // At least half the slots are empty, so this ends well before the bound.
        for _ in 0..self.header.slot_count {
            let (k, row, tag) = self.slot(slot);
            if tag == SLOT_EMPTY_TAG {
                return None;
            }
            if k == key {
                return Some(row);
            }
            slot = (slot + 1) & mask;
        }
        None
    }

    fn copy_f32(&self, offset: usize, out: &mut [f32]) {
        let bytes = &self.map[offset..offset + out.len() * 4];
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
    }

    /// Copies the vector of `key` into `out` (length `dim`); copies the
    /// default vector and returns false when the key is unknown.
    #[inline]
    pub fn read_into(&self, key: u64, out: &mut [f32]) -> bool {
        assert_eq!(out.len(), self.dim());
        match self.find(key) {
            Some(row) => {
                self.copy_f32(self.rows_offset + row as usize * self.dim() * 4, out);
                true
            }
            None => {
                self.copy_f32(HEADER_BYTES, out);
                false
            }
        }
    }

    /// Looks up many keys at once, writing `keys.len()` vectors into `out`
    /// (row-major, `dim` floats each) and returning how many were missing.
    ///
    /// Three passes so the memory loads overlap instead of queueing behind
    /// each other: prefetch every key's index slot, then resolve rows and
    /// prefetch them, then copy.
    pub fn read_many_into(&self, keys: &[u64], rows: &mut [u32], out: &mut [f32]) -> usize {
        let dim = self.dim();
        assert!(out.len() == keys.len() * dim && rows.len() >= keys.len());
        for &key in keys {
            let slot = slot_of(key, self.header.slot_count) as usize;
            prefetch(&self.map[self.index_offset + slot * SLOT_BYTES..]);
        }
        let row_bytes = dim * 4;
        for (&key, row) in keys.iter().zip(rows.iter_mut()) {
            *row = self.find(key).unwrap_or(u32::MAX);
            if *row != u32::MAX {
                prefetch(&self.map[self.rows_offset + *row as usize * row_bytes..]);
            }
        }
        let mut missing = 0;
        for (row, dst) in rows.iter().zip(out.chunks_exact_mut(dim)) {
            if *row == u32::MAX {
                missing += 1;
                self.copy_f32(HEADER_BYTES, dst);
            } else {
                self.copy_f32(self.rows_offset + *row as usize * row_bytes, dst);
            }
        }
        missing
    }

    /// The default vector served for unknown keys.
    pub fn default_vector(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.dim()];
        self.copy_f32(HEADER_BYTES, &mut v);
        v
    }
}

/// Asks the CPU to start loading the cache line at the start of `bytes`.
#[inline(always)]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is only a hint; it never faults and the pointer
        // comes from a live slice.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

fn parse_header(h: &[u8], path: &str) -> Result<Header, ReplicaError> {
    if h[0..8] != MAGIC {
        return Err(ReplicaError::BadMagic { path: path.into() });
    }
    let u32_at = |at: usize| u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    if crc32fast::hash(&h[0..52]) != u32_at(52) {
        return Err(ReplicaError::HeaderChecksum { path: path.into() });
    }
    let found = u32_at(8);
    if found != FORMAT_VERSION {
        return Err(ReplicaError::Version { path: path.into(), found });
    }
    let bad = |what: &str| ReplicaError::Header { path: path.into(), what: what.into() };
    let dim = u32_at(12);
    let row_count = u64_at(16);
    let slot_count = u64_at(24);
    if dim == 0 || dim > DIM_MAX {
        return Err(bad("dimension out of range"));
    }
    if !slot_count.is_power_of_two() || slot_count < row_count.saturating_mul(2).max(2) {
        return Err(bad("index slot count is not a power of two at least twice the row count"));
    }
    if row_count >= u64::from(u32::MAX) {
        return Err(bad("too many rows"));
    }
    let name = &h[32..48];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let group = std::str::from_utf8(&name[..end]).map_err(|_| bad("group name is not UTF-8"))?.to_string();
    Ok(Header { dim, row_count, slot_count, group })
}

/// Collects rows in memory and writes a replica file atomically.
pub struct ReplicaBuilder {
    group: String,
    dim: u32,
    default: Vec<f32>,
    keys: Vec<u64>,
    values: Vec<f32>,
}

impl ReplicaBuilder {
    pub fn new(group: &str, dim: u32) -> ReplicaBuilder {
        assert!(group.len() <= GROUP_NAME_BYTES_MAX && !group.is_empty(), "group name length");
        assert!(dim > 0 && dim <= DIM_MAX, "dimension out of range");
        ReplicaBuilder {
            group: group.into(),
            dim,
            default: vec![0.0; dim as usize],
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    pub fn dim(&self) -> u32 {
        self.dim
    }

    pub fn set_default(&mut self, v: &[f32]) -> Result<(), ReplicaError> {
        self.check_dim(v)?;
        self.default.copy_from_slice(v);
        Ok(())
    }

    fn check_dim(&self, v: &[f32]) -> Result<(), ReplicaError> {
        if v.len() != self.dim as usize {
            return Err(ReplicaError::Dim { found: v.len(), dim: self.dim });
        }
        Ok(())
    }

    /// Adds a row. Duplicate keys are detected when the file is written.
    pub fn push(&mut self, key: u64, v: &[f32]) -> Result<(), ReplicaError> {
        self.check_dim(v)?;
        self.keys.push(key);
        self.values.extend_from_slice(v);
        Ok(())
    }

    /// Serialises the whole file into memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ReplicaError> {
        let row_count = self.keys.len() as u64;
        let header = Header {
            dim: self.dim,
            row_count,
            slot_count: (row_count * 2).max(2).next_power_of_two(),
            group: self.group.clone(),
        };
        let layout = header.layout().expect("sizes of an in-memory builder fit");
        let mut buf = vec![0u8; layout.file_bytes];
        for (i, x) in self.default.iter().enumerate() {
            buf[HEADER_BYTES + i * 4..HEADER_BYTES + i * 4 + 4].copy_from_slice(&x.to_le_bytes());
        }
        let mask = header.slot_count - 1;
        for (row, &key) in self.keys.iter().enumerate() {
            let mut slot = slot_of(key, header.slot_count);
            loop {
                let at = layout.index_offset + slot as usize * SLOT_BYTES;
                let tag = u32::from_le_bytes(buf[at + 12..at + 16].try_into().expect("4 bytes"));
                if tag == SLOT_EMPTY_TAG {
                    buf[at..at + 8].copy_from_slice(&key.to_le_bytes());
                    buf[at + 8..at + 12].copy_from_slice(&(row as u32).to_le_bytes());
                    buf[at + 12..at + 16].copy_from_slice(&SLOT_USED_TAG.to_le_bytes());
                    break;
                }
                if u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes")) == key {
                    return Err(ReplicaError::DuplicateKey { key });
                }
                slot = (slot + 1) & mask;
            }
        }
        for (i, x) in self.values.iter().enumerate() {
            let at = layout.rows_offset + i * 4;
            buf[at..at + 4].copy_from_slice(&x.to_le_bytes());
        }
        buf[0..8].copy_from_slice(&MAGIC);
        buf[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf[12..16].copy_from_slice(&self.dim.to_le_bytes());
        buf[16..24].copy_from_slice(&row_count.to_le_bytes());
        buf[24..32].copy_from_slice(&header.slot_count.to_le_bytes());
        buf[32..32 + self.group.len()].copy_from_slice(self.group.as_bytes());
        let payload_crc = crc32fast::hash(&buf[HEADER_BYTES..]);
        buf[48..52].copy_from_slice(&payload_crc.to_le_bytes());
        let header_crc = crc32fast::hash(&buf[0..52]);
        buf[52..56].copy_from_slice(&header_crc.to_le_bytes());
        Ok(buf)
    }

    /// Writes the file to `path` atomically: temporary file, fsync, rename.
    pub fn write(&self, path: &Path) -> Result<(), ReplicaError> {
        let bytes = self.to_bytes()?;
        write_atomically(path, &bytes)
    }

    /// Parses the documented text input format (see `docs/REPLICA.md`):
    /// one entity per line, `id,f0,f1,…`; a line `default,f0,…` sets the
    /// default vector; blank lines and lines starting with `#` are skipped.
    /// Fields may be separated by commas or whitespace.
    pub fn from_text(group: &str, text: &str, path_for_errors: &str) -> Result<ReplicaBuilder, ReplicaError> {
        let mut builder: Option<ReplicaBuilder> = None;
        let mut default: Option<Vec<f32>> = None;
        let mut values = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |what: String| ReplicaError::Input { path: path_for_errors.into(), line: n + 1, what };
            let mut fields = line.split(|c: char| c == ',' || c.is_whitespace()).filter(|f| !f.is_empty());
            let id_field = fields.next().expect("a non-empty line has a field");
            values.clear();
            for f in fields {
                let x: f32 = f.parse().map_err(|_| err(format!("'{f}' is not a number")))?;
                if !x.is_finite() {
                    return Err(err(format!("'{f}' is not finite")));
                }
                values.push(x);
            }
            if values.is_empty() || values.len() > DIM_MAX as usize {
                return Err(err(format!("{} values; expected 1 to {DIM_MAX}", values.len())));
            }
            let b = builder.get_or_insert_with(|| ReplicaBuilder::new(group, values.len() as u32));
            if values.len() != b.dim as usize {
                return Err(err(format!("{} values, earlier lines have {}", values.len(), b.dim)));
            }
            if id_field == "default" {
                default = Some(values.clone());
                continue;
            }
            let key: u64 = id_field.parse().map_err(|_| err(format!("'{id_field}' is not an unsigned 64-bit id")))?;
            b.push(key, &values)?;
        }
        let mut b = builder.ok_or_else(|| ReplicaError::Input {
            path: path_for_errors.into(),
            line: 0,
            what: "no rows".into(),
        })?;
        if let Some(d) = default {
            b.set_default(&d)?;
        }
        Ok(b)
    }
}

/// Writes `bytes` to `path` so that readers see either the old or the new file whole.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ReplicaError> {
    let p = path.display().to_string();
    let io = |source| ReplicaError::Io { path: p.clone(), source };
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp_name);
    {
        let mut f = File::create(&tmp).map_err(io)?;
        f.write_all(bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("quiver-replica-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn sample(rows: u64, dim: u32) -> ReplicaBuilder {
        let mut b = ReplicaBuilder::new("item", dim);
        b.set_default(&vec![-1.0; dim as usize]).unwrap();
        for k in 0..rows {
            let key = k * 7919 + 3;
            let v: Vec<f32> = (0..dim).map(|j| key as f32 + j as f32 * 0.5).collect();
            b.push(key, &v).unwrap();
        }
        b
    }

    #[test]
    fn build_open_lookup() {
        let dir = tmpdir("lookup");
        let path = dir.join("item.qrep");
        sample(1000, 5).write(&path).unwrap();
        let r = Replica::open(&path, "item").unwrap();
        assert_eq!(r.header().row_count, 1000);
        let mut out = [0.0; 5];
        for k in 0..1000u64 {
            let key = k * 7919 + 3;
            assert!(r.read_into(key, &mut out));
            assert_eq!(out, [key as f32, key as f32 + 0.5, key as f32 + 1.0, key as f32 + 1.5, key as f32 + 2.0]);
        }
        assert!(!r.read_into(4, &mut out));
        assert_eq!(out, [-1.0; 5]);
        assert!(!r.read_into(u64::MAX, &mut out));
        assert!(matches!(Replica::open(&path, "user"), Err(ReplicaError::Group { .. })));
    }

    #[test]
    fn batched_lookup_matches_single_lookups() {
        let dir = tmpdir("batch");
        let path = dir.join("item.qrep");
        sample(500, 3).write(&path).unwrap();
        let r = Replica::open(&path, "item").unwrap();
        let keys: Vec<u64> = (0..64u64).map(|i| if i % 5 == 0 { i + 1 } else { i * 7919 + 3 }).collect();
        let mut rows = vec![0u32; 64];
        let mut got = vec![0.0; 64 * 3];
        let missing = r.read_many_into(&keys, &mut rows, &mut got);
        let mut want = vec![0.0; 64 * 3];
        let mut want_missing = 0;
        for (k, dst) in keys.iter().zip(want.chunks_exact_mut(3)) {
            want_missing += usize::from(!r.read_into(*k, dst));
        }
        assert_eq!(got, want);
        assert_eq!(missing, want_missing);
        assert!(missing > 0);
    }

    #[test]
    fn empty_and_single_row_files_work() {
        let dir = tmpdir("tiny");
        let path = dir.join("user.qrep");
        let mut b = ReplicaBuilder::new("user", 2);
        b.push(0, &[1.0, 2.0]).unwrap();
        b.write(&path).unwrap();
        let r = Replica::open(&path, "user").unwrap();
        let mut out = [0.0; 2];
        assert!(r.read_into(0, &mut out));
        assert!(!r.read_into(1, &mut out));
        ReplicaBuilder::new("user", 2).write(&path).unwrap();
        let r = Replica::open(&path, "user").unwrap();
        assert!(!r.read_into(0, &mut out));
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let mut b = ReplicaBuilder::new("user", 1);
        b.push(5, &[1.0]).unwrap();
        b.push(5, &[2.0]).unwrap();
        assert!(matches!(b.to_bytes(), Err(ReplicaError::DuplicateKey { key: 5 })));
        assert!(matches!(b.push(6, &[1.0, 2.0]), Err(ReplicaError::Dim { found: 2, dim: 1 })));
    }

    #[test]
    fn corruption_is_detected() {
        let dir = tmpdir("corrupt");
        let path = dir.join("item.qrep");
        let good = sample(100, 4).to_bytes().unwrap();

        let truncated = &good[..good.len() - 4];
        std::fs::write(&path, truncated).unwrap();
        assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::Length { .. })));

        std::fs::write(&path, &good[..10]).unwrap();
        assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::Length { .. })));

        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::PayloadChecksum { .. })));

        let mut header = good.clone();
        header[13] ^= 1;
        std::fs::write(&path, &header).unwrap();
        assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::HeaderChecksum { .. })));

        let mut magic = good.clone();
        magic[0] = b'X';
        std::fs::write(&path, &magic).unwrap();
        assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::BadMagic { .. })));

        // Flip every single byte in turn: each must be refused, never accepted.
        for at in (0..good.len()).step_by(37) {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            std::fs::write(&path, &bad).unwrap();
            assert!(Replica::open(&path, "item").is_err(), "byte {at} flipped but accepted");
        }
        std::fs::write(&path, &good).unwrap();
        Replica::open(&path, "item").unwrap();
    }

    #[test]
    fn text_input_format() {
        let text = "# users\ndefault, 0.5, 0.5\n1,1.0,2.0\n2 3.0 4.0\n\n";
        let b = ReplicaBuilder::from_text("user", text, "in.csv").unwrap();
        let dir = tmpdir("text");
        let path = dir.join("user.qrep");
        b.write(&path).unwrap();
        let r = Replica::open(&path, "user").unwrap();
        let mut out = [0.0; 2];
        assert!(r.read_into(2, &mut out));
        assert_eq!(out, [3.0, 4.0]);
        assert!(!r.read_into(3, &mut out));
        assert_eq!(out, [0.5, 0.5]);

        let err = ReplicaBuilder::from_text("user", "1,1.0\n2,1.0,2.0\n", "in.csv").err().unwrap();
        assert_eq!(err.to_string(), "in.csv:2: 2 values, earlier lines have 1");
        let err = ReplicaBuilder::from_text("user", "x,1.0\n", "in.csv").err().unwrap();
        assert!(err.to_string().contains("not an unsigned 64-bit id"));
        let err = ReplicaBuilder::from_text("user", "1,abc\n", "in.csv").err().unwrap();
        assert!(err.to_string().contains("'abc' is not a number"));
    }
}
