//! Feature replica v2: one memory-mapped file per feature group, key →
//! vector, read by every shard while one refresher thread rewrites it. A
//! file's keys are u64 ids, or strings of up to a limit the group names
//! (at most [`KEY_BYTES_MAX`] bytes), recorded in the superblock.
//!
//! The request path reads features from local memory and never waits on a
//! network. Redis is the source of truth (see `src/features/feed/`); this module is the
//! local copy: a file that is served from the moment it is opened, updated in
//! place while readers read it, and safe to `kill -9` at any instant.
//!
//! Concurrency (one writer, any number of readers, no locks):
//! - Every row starts with a sequence counter. The writer makes it odd, writes
//!   key, checksum and payload, then makes it even again (a seqlock). A reader
//!   copies the row between two loads of the counter and retries when they
//!   differ or are odd, so it never returns a torn vector. All accesses to
//!   shared bytes are atomic loads and stores, so there is no data race, and
//!   on x86 they compile to plain moves.
//! - A reader also checks the key stored in the row against the key it looked
//!   up, so a row that changed owner between the index probe and the copy is
//!   never served as someone else's features.
//! - String keys: the index and the row header hold the key's 64-bit
//!   [`key_hash`] (xxh3-64, stable across processes, platforms and
//!   releases), and the row holds the whole key (length, then bytes), copied
//!   and compared under the same seqlock and CRC as the payload. A row whose
//!   hash matches but whose key differs is a miss counted in
//!   [`Replica::key_collisions`], never the other entity's row. Two keys with
//!   one hash share one row: the last written is kept and the writer counts
//!   the displacement ([`ReplicaWriter::upsert_str`]).
//! - A key kind is fixed per file and checked per call: writing or building
//!   with the other kind's method is a typed [`ReplicaError::KeyKind`]; a
//!   lookup or delete with it (methods that return no `Result`) panics, as
//!   the kind is settled where the file is opened and a mismatch is a bug.
//! - Index slots go empty → used → tombstone and never back; a new key takes a
//!   fresh row and a fresh slot, published by a release store of the slot's
//!   tag after the row is written. When rows run out, the writer rehashes the
//!   live rows into a new file, renames it into place and swaps the table
//!   behind [`ReplicaHandle`]; readers on the old table finish on it.
//! - A retry loop is bounded: a row that stays busy past the bound (a writer
//!   that died mid-row) is served as missing, never as garbage.
//!
//! Crash safety: the writer only ever moves a row from one complete state to
//! another, with the odd counter marking the window between. After `kill -9`
//! a reopened file has at most the rows that were mid-write marked odd; the
//! writer's open drops them from the index (they fall back to the default
//! vector) and the stream replay from the last checkpoint rewrites them,
//! because a checkpoint is written only after the rows it covers were flushed.
//! Anything else that does not verify (checksums of the superblock, both
//! checkpoint records, the default vector and every indexed row; the file
//! length; index tags and row numbers) is damage: the file is refused and
//! rebuilt from Redis.
//!
//! Verification is split so that a restart serves at once: opening checks
//! the length, superblock, checkpoints and default vector (a few KB); the
//! scan of every slot and row can run later, on the writer's side, while
//! shards read. Until it passes, every read checks its row's CRC and row
//! number and serves the default vector for a row that fails, so no
//! unverified byte is ever served as features. Whole-file replacements (builds, full resyncs, growth)
//! go to a temporary file that is renamed into place only when complete.
//!
//! Layout (little-endian; sections 64-byte aligned; rows 16-byte aligned):
//!
//! | offset          | bytes                   | what                                        |
//! |-----------------|-------------------------|---------------------------------------------|
//! | 0               | 64                      | superblock (see [`layout`]); key kind at 20..24 |
//! | 64, 128         | 64 each                 | two checkpoint records: the newest valid wins |
//! | 192             | dim × 4, padded         | default vector (f32), served for unknown keys |
//! | index_offset    | slot_count × 16         | index: key u64, row u32, tag u32            |
//! | rows_offset     | row_capacity × stride   | rows: seq u32, crc u32, key u64, [string key], payload |
//!
//! The key kind's code is 0 for u64 keys, else the string keys' byte limit.
//! Files written before string keys hold 0 there, so they open and serve
//! exactly as before under the same format version (no version change). In
//! a string-keyed file `key` is the key's hash and the string key follows
//! the row header: its length u32, then its bytes zero-padded to the limit
//! rounded up to words; the row CRC covers it.

mod format;
mod table;
mod writer;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

pub use format::{
    decode_link, encode_link, key_hash, line_padding_helps, Cursor, EntityKey, EntityKeyBuf, Header, KeyKind, Storage,
    LINK_WORDS_MAX,
};
pub use table::{huge_pages, lock_pages, mem_available_bytes, Replica};
pub use writer::{GrowthPhase, OpenReport, ReplicaWriter};

pub const MAGIC: [u8; 8] = *b"QVREPL02";
pub const FORMAT_VERSION: u32 = 2;
/// Widest vector a group may hold; bounds per-request scratch sizes.
pub const DIM_MAX: u32 = 4096;
/// Longest group name stored in the superblock.
pub const GROUP_NAME_BYTES_MAX: usize = 16;
/// Most rows one file may hold (row numbers are u32 in the index).
pub const ROW_CAPACITY_MAX: u64 = 1 << 30;
/// Longest string key a group may declare: every row of a string-keyed file
/// spends its group's limit, rounded up to words, on its key.
pub const KEY_BYTES_MAX: u32 = 64;

/// Why a replica file cannot be built, opened or written.
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
    #[error("{path}: superblock checksum mismatch: the file is corrupt")]
    HeaderChecksum { path: String },
    #[error("{path}: neither checkpoint record verifies: the file is corrupt")]
    Checkpoint { path: String },
    #[error("{path}: row {row} (key {key}) fails its checksum: the file is corrupt")]
    PayloadChecksum { path: String, row: u64, key: u64 },
    #[error("{path}: default vector checksum mismatch: the file is corrupt")]
    DefaultChecksum { path: String },
    #[error("{path}: {rows} row(s) were being written when their writer stopped; open it with a writer to repair")]
    Torn { path: String, rows: u64 },
    #[error("{path}: file is {actual} bytes, the superblock describes {expected}: truncated or extended")]
    Length { path: String, expected: u64, actual: u64 },
    #[error("{path}: invalid superblock: {what}")]
    Header { path: String, what: String },
    #[error("{path}: holds group '{found}', expected '{expected}'")]
    Group { path: String, found: String, expected: String },
    #[error("{path}: index slot {slot} is damaged: {what}")]
    Index { path: String, slot: u64, what: String },
    #[error("{path}: another process is writing this replica")]
    Locked { path: String },
    #[error(
        "{path}: cannot reserve {bytes} bytes on disk: {source}; the served replica is kept as it is (free space \
         on the data directory's file system)"
    )]
    NoSpace {
        path: String,
        bytes: u64,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: cannot lock its {bytes} bytes in memory (replica_lock = true): {source}; RLIMIT_MEMLOCK is \
         {limit}: raise it to at least the replica files' total size (ulimit -l, LimitMEMLOCK= in a systemd \
         unit) or set replica_lock = false"
    )]
    MemoryLock {
        path: String,
        bytes: u64,
        limit: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: replica_lock = true would lock its {bytes} bytes in memory, more than the {available} bytes \
         this machine has available (MemAvailable): give the node more memory, store the group as f16 or int8 \
         (docs/REPLICA.md), or set replica_lock = false"
    )]
    LockTooLarge { path: String, bytes: u64, available: u64 },
    #[error("{path}:{line}: {what}")]
    Input { path: String, line: usize, what: String },
    #[error("duplicate key {key}")]
    DuplicateKey { key: u64 },
    #[error("duplicate key '{key}'")]
    DuplicateStrKey { key: String },
    #[error("{path}: holds {kind}, used with {used}")]
    KeyKind { path: String, kind: KeyKind, used: &'static str },
    #[error("a string key of {bytes} bytes, the group's keys are at most {bytes_max} bytes")]
    KeyTooLong { bytes: usize, bytes_max: u32 },
    #[error("string keys of up to {bytes_max} bytes: the limit is 1 to {KEY_BYTES_MAX} bytes")]
    KeyBytesMax { bytes_max: u32 },
    #[error("{path}: {why}")]
    Link { path: String, why: String },
    #[error("vector of {found} floats, the group has dimension {dim}")]
    Dim { found: usize, dim: u32 },
    #[error("{path}: would need {rows} rows, above the limit of {ROW_CAPACITY_MAX}")]
    Full { path: String, rows: u64 },
}

impl ReplicaError {
    /// Whether this is damage to a file's contents (rebuild it from Redis), as
    /// opposed to an operating condition such as a missing file or a lock.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            ReplicaError::BadMagic { .. }
                | ReplicaError::Version { .. }
                | ReplicaError::HeaderChecksum { .. }
                | ReplicaError::Checkpoint { .. }
                | ReplicaError::PayloadChecksum { .. }
                | ReplicaError::DefaultChecksum { .. }
                | ReplicaError::Torn { .. }
                | ReplicaError::Length { .. }
                | ReplicaError::Header { .. }
                | ReplicaError::Index { .. }
        )
    }
}

/// The bucket entity `id` belongs to in a group split into `buckets` (the
/// Redis contract's bucketed layout; `src/features/feed/contract.rs`): Fibonacci
/// hashing, so ids that share a stride still spread evenly.
#[inline]
pub fn bucket_of(id: u64, buckets: usize) -> usize {
    debug_assert!(buckets > 0);
    ((id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % buckets as u64) as usize
}

/// The file of bucket `bucket` of a bucketed group whose replica is
/// configured at `path`: `user.qrep` → `user.b0003.qrep`.
pub fn bucket_path(path: &Path, bucket: usize) -> std::path::PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.b{bucket:04}.{}", ext.to_string_lossy()),
        None => format!("{stem}.b{bucket:04}"),
    };
    path.with_file_name(name)
}

/// The tables a feature group is served from now: one, or one per bucket of
/// a bucketed group (an id's table is [`bucket_of`] it). Shards read them
/// through a [`ReplicaView`] (lock-free); each table's writer swaps in a new
/// one when it grows the file or installs a full resync, and counts the swap
/// in `generation`. The dimension never changes.
pub struct ReplicaHandle {
    parts: Box<[ArcSwap<Replica>]>,
    /// Swaps installed so far: a view whose generation is older reloads.
    generation: AtomicU64,
    dim: usize,
}

impl std::fmt::Debug for ReplicaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaHandle")
            .field("parts", &self.parts.len())
            .field("first", &*self.parts[0].load())
            .finish()
    }
}

impl ReplicaHandle {
    pub fn new(replica: Replica) -> ReplicaHandle {
        ReplicaHandle::serving(Arc::new(replica))
    }

    fn serving(table: Arc<Replica>) -> ReplicaHandle {
        ReplicaHandle { dim: table.dim(), parts: Box::new([ArcSwap::new(table)]), generation: AtomicU64::new(0) }
    }

    /// One handle over `writers`, bucket `b`'s table being `writers[b]`'s;
    /// each writer installs what it grows or replaces into its part from now on.
    pub fn bucketed(writers: &mut [ReplicaWriter]) -> Arc<ReplicaHandle> {
        assert!(!writers.is_empty(), "a bucketed group has at least one bucket");
        let dim = writers[0].table().dim();
        assert!(writers.iter().all(|w| w.table().dim() == dim), "every bucket of a group has its dimension");
        let keys = writers[0].table().key_kind();
        assert!(writers.iter().all(|w| w.table().key_kind() == keys), "and its key kind");
        let parts = writers.iter().map(|w| ArcSwap::new(w.table().clone())).collect();
        let handle = Arc::new(ReplicaHandle { parts, dim, generation: AtomicU64::new(0) });
        for (b, w) in writers.iter_mut().enumerate() {
            w.serve_through(handle.clone(), b);
        }
        handle
    }

    /// Opens `path` read-only (see [`Replica::open`]).
    pub fn open(path: &Path, group: &str) -> Result<ReplicaHandle, ReplicaError> {
        Ok(ReplicaHandle::new(Replica::open(path, group)?))
    }

    /// Opens `path` read-only to serve it at once: only the length,
    /// superblock, checkpoints and default vector are checked before it
    /// returns. A `quiver-verify` thread (low priority) then scans every slot
    /// and row; reads check their row's CRC until that passes. A file the
    /// scan finds damaged (or with rows a killed writer left mid-write) keeps
    /// serving only the rows that pass their CRC, and the scan's finding is
    /// logged: a read-only server has no source to rebuild it from.
    pub fn open_serving(path: &Path, group: &str) -> Result<Arc<ReplicaHandle>, ReplicaError> {
        let table = Arc::new(Replica::map(path, group, table::Access::ReadOnly)?);
        let handle = Arc::new(ReplicaHandle::serving(table.clone()));
        let scanning = table.clone();
        std::thread::Builder::new()
            .name("quiver-verify".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let ms = || started.elapsed().as_millis() as u64;
                match scanning.scan() {
                    Ok(scan) if scan.torn_slots.is_empty() => {
                        tracing::info!(path = scanning.path(), rows = scan.live, ms = ms(), "replica verified");
                    }
                    Ok(scan) => tracing::error!(
                        path = scanning.path(),
                        rows = scan.torn_slots.len(),
                        "rows were left mid-write by a killed writer: served as unknown (open the file with its \
                         writer, `quiver serve` with [feed], to repair it)"
                    ),
                    Err(e) => tracing::error!(
                        path = scanning.path(),
                        ms = ms(),
                        "{e}: serving only the rows that pass their checksum; rebuild the file"
                    ),
                }
            })
            .map_err(|source| ReplicaError::Io { path: path.display().to_string(), source })?;
        Ok(handle)
    }

    /// The table of an unbucketed group (a bucketed group's first bucket);
    /// hold it for one request, not longer, so that a replaced table's
    /// mapping is released soon after a swap.
    #[inline]
    pub fn load(&self) -> arc_swap::Guard<Arc<Replica>> {
        self.parts[0].load()
    }

    /// The table of bucket `part`.
    #[inline]
    pub fn load_part(&self, part: usize) -> arc_swap::Guard<Arc<Replica>> {
        self.parts[part].load()
    }

    /// 1, or the group's bucket count.
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rows of every part.
    pub fn live_rows(&self) -> u64 {
        self.parts.iter().map(|p| p.load().live_rows()).sum()
    }

    /// [`Replica::read_into`] on the table `key` is in.
    #[inline]
    pub fn read_into(&self, key: u64, out: &mut [f32]) -> bool {
        self.part_of(key).load().read_into(key, out)
    }

    /// [`Replica::read_many_into`] over the tables the keys are in. Across
    /// tables the same three passes overlap the memory loads (slots, then
    /// rows, then copies); each pass loads the key's table again, so a swap
    /// between passes costs a prefetch, never a wrong row (the copy finds
    /// the key afresh in the table it reads).
    pub fn read_many_into(&self, keys: &[u64], rows: &mut [u32], out: &mut [f32], links: &mut [u32]) -> usize {
        if self.parts.len() == 1 {
            return self.parts[0].load().read_many_into(keys, rows, out, links);
        }
        let dim = self.dim;
        assert!(out.len() == keys.len() * dim && rows.len() >= keys.len());
        for &key in keys {
            self.part_of(key).load().prefetch_slot(key);
        }
        for &key in keys {
            self.part_of(key).load().prefetch_row(key);
        }
        let lw = self.link_words();
        let mut missing = 0;
        for (i, (&key, dst)) in keys.iter().zip(out.chunks_exact_mut(dim)).enumerate() {
            let link = links.get_mut(i * lw..(i + 1) * lw).unwrap_or_default();
            missing += usize::from(!self.part_of(key).load().read_linked_into(key, &[], dst, link));
        }
        missing
    }

    /// [`Replica::read_linked_into`] on the table the key is in.
    #[inline]
    pub fn read_linked_into(&self, filed: u64, str_key: &[u8], out: &mut [f32], link: &mut [u32]) -> bool {
        self.part_of(filed).load().read_linked_into(filed, str_key, out, link)
    }

    /// Words of a row's link to its parent (0: the group has none); the
    /// same in every part.
    pub fn link_words(&self) -> usize {
        self.parts[0].load().link_words()
    }

    /// The kind of key the rows' links name, for a group with a parent.
    pub fn link_kind(&self) -> Option<KeyKind> {
        self.parts[0].load().link_kind()
    }

    /// [`Replica::read_str_into`] on the table `key` is in (a bucketed
    /// group's string key goes to the bucket of its [`key_hash`]).
    #[inline]
    pub fn read_str_into(&self, key: &[u8], out: &mut [f32]) -> bool {
        let hash = key_hash(key);
        self.part_of(hash).load().read_str_hashed(hash, key, out)
    }

    /// [`Replica::read_many_str_into`] over the tables the keys are in, in
    /// the same passes as [`ReplicaHandle::read_many_into`].
    pub fn read_many_str_into<'k, I>(
        &self,
        keys: I,
        hashes: &mut [u64],
        rows: &mut [u32],
        out: &mut [f32],
        links: &mut [u32],
    ) -> usize
    where
        I: IntoIterator<Item = &'k [u8]>,
        I::IntoIter: ExactSizeIterator + Clone,
    {
        if self.parts.len() == 1 {
            return self.parts[0].load().read_many_str_into(keys, hashes, rows, out, links);
        }
        let keys = keys.into_iter();
        let dim = self.dim;
        assert!(out.len() == keys.len() * dim && hashes.len() >= keys.len());
        for (key, hash) in keys.clone().zip(hashes.iter_mut()) {
            *hash = key_hash(key);
            self.part_of(*hash).load().prefetch_slot(*hash);
        }
        for &hash in &hashes[..keys.len()] {
            self.part_of(hash).load().prefetch_row(hash);
        }
        let lw = self.link_words();
        let mut missing = 0;
        for (i, ((key, &hash), dst)) in keys.zip(hashes.iter()).zip(out.chunks_exact_mut(dim)).enumerate() {
            let link = links.get_mut(i * lw..(i + 1) * lw).unwrap_or_default();
            missing += usize::from(!self.part_of(hash).load().read_linked_into(hash, key, dst, link));
        }
        missing
    }

    /// How the group's files are keyed; it never changes while served.
    pub fn key_kind(&self) -> KeyKind {
        self.parts[0].load().key_kind()
    }

    #[inline]
    fn part_of(&self, key: u64) -> &ArcSwap<Replica> {
        match self.parts.len() {
            1 => &self.parts[0],
            n => &self.parts[bucket_of(key, n)],
        }
    }

    fn install(&self, part: usize, table: Arc<Replica>) {
        assert_eq!(table.dim(), self.dim, "a group's dimension never changes while served");
        assert_eq!(table.key_kind(), self.parts[part].load().key_kind(), "nor does its key kind");
        assert_eq!(table.link_kind(), self.parts[part].load().link_kind(), "nor its parent's");
        self.parts[part].store(table);
        // Release after the store: a view that sees the new generation
        // (Acquire) loads the new table.
        self.generation.fetch_add(1, Ordering::Release);
    }
}

/// One reader's tables of a feature group, as of the handle's generation at
/// its last [`ReplicaView::refresh`]: a shard refreshes once per request
/// (one atomic load; a reload of every part only after a swap), and its
/// lookups then touch no `ArcSwap` at all, where reading through the handle
/// loads a table per key and pass (three per key of a bucketed group).
///
/// A view keeps a replaced table mapped until its next refresh. The writer
/// keeps every replaced table until no reader holds it and unmaps it on its
/// own side, so a view's drop or refresh never unmaps on a shard; a shard
/// refreshes its views on its idle tick as well, so an idle shard does not
/// keep a replaced file's disk space. Rows written after a swap go only to
/// the new table: look up only right after a refresh.
pub struct ReplicaView {
    handle: Arc<ReplicaHandle>,
    generation: u64,
    /// One table per part of `handle`; sized once.
    tables: Box<[Arc<Replica>]>,
}

impl std::fmt::Debug for ReplicaView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaView").field("parts", &self.tables.len()).field("generation", &self.generation).finish()
    }
}

impl ReplicaView {
    /// A view of `handle`'s tables now. Allocates (one slot per part): build
    /// views at start-up.
    pub fn new(handle: Arc<ReplicaHandle>) -> ReplicaView {
        let generation = handle.generation.load(Ordering::Acquire);
        let tables = handle.parts.iter().map(|p| p.load_full()).collect();
        ReplicaView { handle, generation, tables }
    }

    /// Takes the handle's current tables if a writer swapped any since the
    /// last refresh. Never allocates; returns whether it reloaded.
    #[inline]
    pub fn refresh(&mut self) -> bool {
        let generation = self.handle.generation.load(Ordering::Acquire);
        if generation == self.generation {
            return false;
        }
        for (table, part) in self.tables.iter_mut().zip(self.handle.parts.iter()) {
            *table = part.load_full();
        }
        self.generation = generation;
        true
    }

    pub fn handle(&self) -> &Arc<ReplicaHandle> {
        &self.handle
    }

    pub fn dim(&self) -> usize {
        self.handle.dim
    }

    #[inline]
    fn table_of(&self, key: u64) -> &Replica {
        match self.tables.len() {
            1 => &self.tables[0],
            n => &self.tables[bucket_of(key, n)],
        }
    }

    /// [`Replica::read_into`] on the table `key` is in.
    #[inline]
    pub fn read_into(&self, key: u64, out: &mut [f32]) -> bool {
        self.table_of(key).read_into(key, out)
    }

    /// The kind of key the handle's tables are filed by.
    pub fn key_kind(&self) -> KeyKind {
        self.tables[0].key_kind()
    }

    /// Starts loading the index slot of `key` (a u64 key, or a string
    /// key's [`key_hash`]), so lookups in several groups overlap.
    #[inline]
    pub fn prefetch_slot(&self, key: u64) {
        self.table_of(key).prefetch_slot(key);
    }

    /// Finds `key` (as [`ReplicaView::prefetch_slot`] takes it) and starts
    /// loading its row.
    #[inline]
    pub fn prefetch_row(&self, key: u64) {
        self.table_of(key).prefetch_row(key);
    }

    /// [`Replica::default_into`]: every part holds the group's one default.
    pub fn default_into(&self, out: &mut [f32]) {
        self.tables[0].default_into(out);
    }

    /// [`Replica::read_str_into`] on the table `key` is in.
    #[inline]
    pub fn read_str_into(&self, key: &[u8], out: &mut [f32]) -> bool {
        self.read_str_hashed_into(key_hash(key), key, out)
    }

    /// [`ReplicaView::read_str_into`] with the key's [`key_hash`] already
    /// computed (the request path hashes each key once).
    #[inline]
    pub fn read_str_hashed_into(&self, hash: u64, key: &[u8], out: &mut [f32]) -> bool {
        self.table_of(hash).read_str_hashed(hash, key, out)
    }

    /// [`Replica::read_many_str_into`] over the tables the keys are in (each
    /// key hashed once, into `hashes`, which also picks its bucket).
    pub fn read_many_str_into<'k, I>(
        &self,
        keys: I,
        hashes: &mut [u64],
        rows: &mut [u32],
        out: &mut [f32],
        links: &mut [u32],
    ) -> usize
    where
        I: IntoIterator<Item = &'k [u8]>,
        I::IntoIter: ExactSizeIterator + Clone,
    {
        if self.tables.len() == 1 {
            return self.tables[0].read_many_str_into(keys, hashes, rows, out, links);
        }
        let keys = keys.into_iter();
        let dim = self.dim();
        assert!(out.len() == keys.len() * dim && hashes.len() >= keys.len());
        for (key, hash) in keys.clone().zip(hashes.iter_mut()) {
            *hash = key_hash(key);
            self.table_of(*hash).prefetch_slot(*hash);
        }
        for &hash in &hashes[..keys.len()] {
            self.table_of(hash).prefetch_row(hash);
        }
        let lw = self.link_words();
        let mut missing = 0;
        for (i, ((key, &hash), dst)) in keys.zip(hashes.iter()).zip(out.chunks_exact_mut(dim)).enumerate() {
            let link = links.get_mut(i * lw..(i + 1) * lw).unwrap_or_default();
            missing += usize::from(!self.table_of(hash).read_linked_into(hash, key, dst, link));
        }
        missing
    }

    /// [`Replica::read_many_into`] over the tables the keys are in: across
    /// tables, the same three passes overlap the memory loads (slots, then
    /// rows, then copies). Returns how many keys were missing.
    pub fn read_many_into(&self, keys: &[u64], rows: &mut [u32], out: &mut [f32], links: &mut [u32]) -> usize {
        if self.tables.len() == 1 {
            return self.tables[0].read_many_into(keys, rows, out, links);
        }
        let dim = self.dim();
        assert!(out.len() == keys.len() * dim && rows.len() >= keys.len());
        for &key in keys {
            self.table_of(key).prefetch_slot(key);
        }
        for &key in keys {
            self.table_of(key).prefetch_row(key);
        }
        let lw = self.link_words();
        let mut missing = 0;
        for (i, (&key, dst)) in keys.iter().zip(out.chunks_exact_mut(dim)).enumerate() {
            let link = links.get_mut(i * lw..(i + 1) * lw).unwrap_or_default();
            missing += usize::from(!self.table_of(key).read_linked_into(key, &[], dst, link));
        }
        missing
    }

    /// [`Replica::read_linked_into`] on the table the key is in.
    #[inline]
    pub fn read_linked_into(&self, filed: u64, str_key: &[u8], out: &mut [f32], link: &mut [u32]) -> bool {
        self.table_of(filed).read_linked_into(filed, str_key, out, link)
    }

    /// Words of a row's link to its parent (0: the group has none).
    pub fn link_words(&self) -> usize {
        self.tables[0].link_words()
    }

    /// The kind of key the rows' links name, for a group with a parent.
    pub fn link_kind(&self) -> Option<KeyKind> {
        self.tables[0].link_kind()
    }
}

/// Collects rows in memory and writes a complete replica file atomically:
/// a temporary file, fsync, rename.
pub struct ReplicaBuilder {
    group: String,
    dim: u32,
    storage: Storage,
    key_kind: KeyKind,
    default: Vec<f32>,
    keys: Vec<u64>,
    /// A string-keyed group's keys, in push order.
    str_keys: Vec<Box<[u8]>>,
    values: Vec<f32>,
    /// The kind of key the rows link to, for a group with a parent.
    link: Option<KeyKind>,
    /// Each row's parent key, in push order (rows pushed without one, and
    /// every row of a group without a parent: none).
    parents: Vec<Option<EntityKeyBuf>>,
}

/// One meaningful line of the text format, of any key kind and with the
/// parent column of a group with a parent.
#[derive(Clone, Debug, PartialEq)]
pub enum KeyedLine {
    Row { key: EntityKeyBuf, parent: Option<EntityKeyBuf>, values: Vec<f32> },
    Default(Vec<f32>),
}

/// The text form of "names no parent" in a parent column.
pub const NO_PARENT: &str = "-";

/// Parses one line of the text format for a group keyed by `keys` whose
/// rows link to a parent keyed by `link`: `key,f0,f1,…` without a parent,
/// `key,parent,f0,…` with one (`-` for a row that names none); `default,f0,…`
/// either way; fields separated by commas or whitespace; `Ok(None)` for a
/// blank line or a `#` comment. A u64 key is decimal, a string key its
/// bytes as written; a parent key is checked against its kind's limit, a
/// row's own string key is left to its group's (the builder's and the
/// publisher's errors name it). The one parser behind `quiver replica
/// build` and `quiver features load`: a line of separators only, like `,`,
/// is an error, never skipped or a panic.
pub fn parse_keyed_line(text: &str, keys: KeyKind, link: Option<KeyKind>) -> Result<Option<KeyedLine>, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() || trimmed.starts_with('#') {
        return Ok(None);
    }
    let mut fields = trimmed.split(|c: char| c == ',' || c.is_whitespace()).filter(|f| !f.is_empty());
    let Some(first) = fields.next() else {
        return Err("the line holds only separators; expected id,f0,f1,...".into());
    };
    // A key as written: a u64 in decimal, a string's bytes.
    let key_of = |field: &str, kind: KeyKind, what: &str| -> Result<EntityKeyBuf, String> {
        match kind {
            KeyKind::U64 => {
                field.parse().map(EntityKeyBuf::Id).map_err(|_| format!("'{field}' is not an unsigned 64-bit {what}"))
            }
            KeyKind::Str { .. } => Ok(EntityKeyBuf::Str(field.as_bytes().to_vec())),
        }
    };
    let parent_of = |field: &str, kind: KeyKind| -> Result<Option<EntityKeyBuf>, String> {
        match kind {
            _ if field == NO_PARENT => Ok(None),
            KeyKind::Str { bytes_max } if field.len() > bytes_max as usize => {
                Err(format!("parent key '{field}' is {} bytes; its keys are 1 to {bytes_max} bytes", field.len()))
            }
            _ => key_of(field, kind, "parent key").map(Some),
        }
    };
    let rest: Vec<&str> = fields.collect();
    let (key, parent, value_fields) = match (first, link) {
        ("default", _) => (None, None, &rest[..]),
        (k, None) => (Some(key_of(k, keys, "id")?), None, &rest[..]),
        (k, Some(kind)) => {
            let Some((&p, values)) = rest.split_first() else {
                return Err("no parent column: expected key,parent,f0,... ('-' for no parent)".into());
            };
            (Some(key_of(k, keys, "id")?), parent_of(p, kind)?, values)
        }
    };
    let mut values = Vec::with_capacity(value_fields.len());
    for f in value_fields {
        let x: f32 = f.parse().map_err(|_| format!("'{f}' is not a number"))?;
        if x.is_infinite() {
            return Err(format!("'{f}' is infinite; write nan for a missing value"));
        }
        values.push(x);
    }
    if values.is_empty() || values.len() > DIM_MAX as usize {
        return Err(format!("{} values; expected 1 to {DIM_MAX}", values.len()));
    }
    Ok(Some(match key {
        None => KeyedLine::Default(values),
        Some(key) => KeyedLine::Row { key, parent, values },
    }))
}

impl ReplicaBuilder {
    pub fn new(group: &str, dim: u32) -> ReplicaBuilder {
        assert!(group.len() <= GROUP_NAME_BYTES_MAX && !group.is_empty(), "group name length");
        assert!(dim > 0 && dim <= DIM_MAX, "dimension out of range");
        ReplicaBuilder {
            group: group.into(),
            dim,
            storage: Storage::F32,
            key_kind: KeyKind::U64,
            default: vec![0.0; dim as usize],
            keys: Vec::new(),
            str_keys: Vec::new(),
            values: Vec::new(),
            link: None,
            parents: Vec::new(),
        }
    }

    pub fn storage(mut self, storage: Storage) -> ReplicaBuilder {
        self.storage = storage;
        self
    }

    /// Keys the file by strings of at most `bytes_max` bytes (1 to
    /// [`KEY_BYTES_MAX`]), added with [`ReplicaBuilder::push_str`]. Panics
    /// once rows were pushed.
    pub fn str_keys(mut self, bytes_max: u32) -> Result<ReplicaBuilder, ReplicaError> {
        assert!(self.keys.is_empty() && self.str_keys.is_empty(), "the key kind is set before any row");
        if bytes_max == 0 || bytes_max > KEY_BYTES_MAX {
            return Err(ReplicaError::KeyBytesMax { bytes_max });
        }
        self.key_kind = KeyKind::Str { bytes_max };
        Ok(self)
    }

    pub fn key_kind(&self) -> KeyKind {
        self.key_kind
    }

    fn key_kind_error(&self, used: &'static str) -> ReplicaError {
        ReplicaError::KeyKind { path: format!("group '{}'", self.group), kind: self.key_kind, used }
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

    /// Makes the file's rows link to a parent keyed by `kind`
    /// ([`ReplicaBuilder::push_linked`]).
    pub fn links_to(mut self, kind: KeyKind) -> Result<ReplicaBuilder, ReplicaError> {
        if let KeyKind::Str { bytes_max } = kind {
            if bytes_max == 0 || bytes_max > KEY_BYTES_MAX {
                return Err(ReplicaError::KeyBytesMax { bytes_max });
            }
        }
        self.link = Some(kind);
        Ok(self)
    }

    /// Adds a row. Duplicate keys are refused when the file is written.
    pub fn push(&mut self, key: u64, v: &[f32]) -> Result<(), ReplicaError> {
        self.push_linked(EntityKey::Id(key), v, None)
    }

    /// Adds a row whose key is of the builder's kind, naming `parent` (none:
    /// no parent); a parent needs [`ReplicaBuilder::links_to`] of its kind.
    pub fn push_linked(
        &mut self,
        key: EntityKey<'_>,
        v: &[f32],
        parent: Option<EntityKey<'_>>,
    ) -> Result<(), ReplicaError> {
        if let Some(p) = parent {
            let path = format!("group '{}'", self.group);
            match self.link {
                Some(kind) if p.fits(kind) => {}
                Some(kind) => {
                    return Err(ReplicaError::Link { path, why: format!("parent key '{p}' is not one of {kind}") })
                }
                None => {
                    return Err(ReplicaError::Link { path, why: "rows of a group without a parent name none".into() })
                }
            }
        }
        match (key, self.key_kind) {
            (EntityKey::Id(id), KeyKind::U64) => {
                self.check_dim(v)?;
                self.keys.push(id);
            }
            (EntityKey::Str(bytes), KeyKind::Str { bytes_max }) => {
                if bytes.len() > bytes_max as usize {
                    return Err(ReplicaError::KeyTooLong { bytes: bytes.len(), bytes_max });
                }
                self.check_dim(v)?;
                self.str_keys.push(bytes.into());
            }
            (EntityKey::Id(_), _) => return Err(self.key_kind_error("u64 keys")),
            (EntityKey::Str(_), _) => return Err(self.key_kind_error("string keys")),
        }
        self.values.extend_from_slice(v);
        self.parents.push(parent.map(EntityKey::to_buf));
        Ok(())
    }

    /// Adds a row of a string-keyed group ([`ReplicaBuilder::str_keys`]).
    /// Duplicate keys are refused when the file is written; two keys with
    /// one hash keep the later (see [`ReplicaWriter::upsert_str`]).
    pub fn push_str(&mut self, key: &[u8], v: &[f32]) -> Result<(), ReplicaError> {
        self.push_linked(EntityKey::Str(key), v, None)
    }

    /// Writes the file to `path`: readers of an older file at `path` keep it
    /// whole; a crash leaves either the old file or the new one.
    pub fn write(&self, path: &Path) -> Result<(), ReplicaError> {
        self.write_at(path, Cursor::default())
    }

    /// [`write`](Self::write), the file's checkpoint naming `cursor` (what
    /// the rows reflect, for whoever resumes from the file).
    pub fn write_at(&self, path: &Path, cursor: Cursor) -> Result<(), ReplicaError> {
        let tmp = temp_path(path, "build");
        let rows = (self.keys.len() + self.str_keys.len()) as u64;
        let (group, dim, storage) = (&self.group, self.dim, self.storage);
        let mut w =
            ReplicaWriter::create_linked(&tmp, group, dim, storage, self.key_kind, self.link, rows, &self.default)?;
        let rows = self.values.chunks_exact(dim as usize).zip(&self.parents);
        for (key, (v, parent)) in self.keys.iter().zip(rows.clone()) {
            if w.contains(*key) {
                let _ = std::fs::remove_file(&tmp);
                return Err(ReplicaError::DuplicateKey { key: *key });
            }
            w.upsert_linked(EntityKey::Id(*key), v, parent.as_ref().map(EntityKeyBuf::as_key))?;
        }
        for (key, (v, parent)) in self.str_keys.iter().zip(rows) {
            if w.contains_str(key) {
                let _ = std::fs::remove_file(&tmp);
                return Err(ReplicaError::DuplicateStrKey { key: String::from_utf8_lossy(key).into_owned() });
            }
            w.upsert_linked(EntityKey::Str(key), v, parent.as_ref().map(EntityKeyBuf::as_key))?;
        }
        w.checkpoint(cursor)?;
        w.rename_to(path)
    }

    /// Parses the documented text input format (see `docs/REPLICA.md`)
    /// line by line with `parse_keyed_line`, the parser `quiver features
    /// load` uses too.
    pub fn from_text(group: &str, text: &str, path_for_errors: &str) -> Result<ReplicaBuilder, ReplicaError> {
        ReplicaBuilder::from_text_keyed(group, KeyKind::U64, text, path_for_errors)
    }

    /// [`ReplicaBuilder::from_text`] for a group keyed by `keys`. With
    /// string keys, a line's first field is the key's bytes as written (no
    /// separators in it; `default` still names the default vector).
    pub fn from_text_keyed(
        group: &str,
        keys: KeyKind,
        text: &str,
        path_for_errors: &str,
    ) -> Result<ReplicaBuilder, ReplicaError> {
        ReplicaBuilder::from_text_linked(group, keys, None, text, path_for_errors)
    }

    /// [`ReplicaBuilder::from_text_keyed`] for a group whose rows link to a
    /// parent keyed by `link` (none: no parent): each row line then carries
    /// the parent's key after its own (`-`: none), as [`parse_keyed_line`]
    /// reads it.
    pub fn from_text_linked(
        group: &str,
        keys: KeyKind,
        link: Option<KeyKind>,
        text: &str,
        path_for_errors: &str,
    ) -> Result<ReplicaBuilder, ReplicaError> {
        let start = |dim: usize| -> Result<ReplicaBuilder, ReplicaError> {
            let b = ReplicaBuilder::new(group, dim as u32);
            let b = match keys {
                KeyKind::U64 => b,
                KeyKind::Str { bytes_max } => b.str_keys(bytes_max)?,
            };
            match link {
                Some(kind) => b.links_to(kind),
                None => Ok(b),
            }
        };
        // Checked before the first line, so that a bad limit is named as such.
        start(1)?;
        let mut builder: Option<ReplicaBuilder> = None;
        let mut default: Option<Vec<f32>> = None;
        for (n, line) in text.lines().enumerate() {
            let err = |what: String| ReplicaError::Input { path: path_for_errors.into(), line: n + 1, what };
            let Some(parsed) = parse_keyed_line(line, keys, link).map_err(err)? else { continue };
            let values = match &parsed {
                KeyedLine::Row { values, .. } | KeyedLine::Default(values) => values,
            };
            let b = match &mut builder {
                Some(b) => b,
                None => builder.insert(start(values.len())?),
            };
            if values.len() != b.dim as usize {
                return Err(err(format!("{} values, earlier lines have {}", values.len(), b.dim)));
            }
            match parsed {
                KeyedLine::Default(values) => default = Some(values),
                KeyedLine::Row { key, parent, values } => {
                    match b.push_linked(key.as_key(), &values, parent.as_ref().map(EntityKeyBuf::as_key)) {
                        Err(e @ ReplicaError::KeyTooLong { .. }) => return Err(err(e.to_string())),
                        other => other?,
                    }
                }
            }
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
    use std::io::Write;
    let p = path.display().to_string();
    let io = |source| ReplicaError::Io { path: p.clone(), source };
    let tmp = temp_path(path, "write");
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(())
}

/// `path` with a suffix naming why a temporary copy exists.
pub fn temp_path(path: &Path, why: &str) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{why}.tmp"));
    std::path::PathBuf::from(name)
}

#[cfg(test)]
mod tests;
