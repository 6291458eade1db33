//! The single writer of a replica file: creates, repairs, updates in place,
//! checkpoints, grows, and swaps whole files in behind a [`ReplicaHandle`].
//!
//! One writer per file is enforced twice: `ReplicaWriter` is not `Clone` and
//! its methods take `&mut self`, and it holds an exclusive `flock` on the file
//! so that a second process cannot write the same replica.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::format::{
    encode_checkpoint, encode_key, encode_link, encode_superblock, key_hash, line_padding_helps, row_crc,
    slot_count_for, slot_of, Cursor, EntityKey, Header, KeyKind, Layout, Storage, CHECKPOINT_OFFSETS, DEFAULT_OFFSET,
    ROW_HEADER_BYTES, TAG_EMPTY, TAG_TOMBSTONE, TAG_USED,
};
use super::table::{lower_thread_priority, Access};
use super::{
    temp_path, Replica, ReplicaError, ReplicaHandle, DIM_MAX, GROUP_NAME_BYTES_MAX, KEY_BYTES_MAX, ROW_CAPACITY_MAX,
};

mod growth;

pub use growth::GrowthPhase;
use growth::{copy_rows, Growth, GROW_AHEAD_QUARTERS};

/// Smallest row capacity a grown file gets, so that small tables do not
/// rehash on every few inserts.
const GROWN_ROWS_MIN: u64 = 1024;

/// What opening an existing file for writing found and repaired.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Rows that were mid-write when the last writer stopped; dropped from
    /// the index until the stream replay rewrites them.
    pub torn_rows: u64,
    pub live_rows: u64,
    pub cursor: Cursor,
}

pub struct ReplicaWriter {
    table: Arc<Replica>,
    /// The handle readers see this writer's table through, and its part there.
    handle: Option<(Arc<ReplicaHandle>, usize)>,
    path: PathBuf,
    /// Holds the exclusive lock for the writer's life.
    _lock: File,
    rows_used: u64,
    live: u64,
    cursor: Cursor,
    /// A row's words after its header (a string key's, then the payload's),
    /// encoded here before they are written.
    payload: Vec<u32>,
    /// String keys written over another key filed under the same hash (the
    /// last written is kept): see [`ReplicaWriter::upsert_str`].
    key_displacements: u64,
    /// Tables this writer replaced that readers may still hold. The writer
    /// drops each once it holds the last reference, so the unmapping of a
    /// possibly multi-GB file happens on the writer's thread, never on a
    /// shard that happened to read it last.
    retired: Vec<Arc<Replica>>,
    /// Opened with [`ReplicaWriter::open_deferred`] and not yet scanned:
    /// `rows_used` and the torn rows are unknown, so nothing may be written
    /// until [`ReplicaWriter::finish_open`] has run.
    scan_pending: bool,
    /// Whether a growth starts in the background before the file is full
    /// ([`ReplicaWriter::set_grow_ahead`]); otherwise the insert that finds
    /// it full rehashes it on the writer's thread.
    grow_ahead: bool,
    growth: Option<Box<Growth>>,
}

impl std::fmt::Debug for ReplicaWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaWriter").field("path", &self.path).field("live", &self.live).finish()
    }
}

fn lock(file: &File, path: &str) -> Result<(), ReplicaError> {
    // SAFETY: flock on a descriptor this process owns has no memory effects.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(ReplicaError::Locked { path: path.into() });
    }
    Ok(())
}

/// Gives the new file `file` its length with every block allocated, so the
/// writes that later go through the mapping never need a block the file
/// system no longer has: on a full disk they would raise SIGBUS in whatever
/// thread wrote, and stop the process. A file system without `fallocate`
/// gets a sparse file, as before, with a warning.
fn reserve(file: &File, bytes: u64, path: &str) -> Result<(), ReplicaError> {
    let len = libc::off_t::try_from(bytes).map_err(|_| ReplicaError::Full { path: path.into(), rows: bytes })?;
    // SAFETY: fallocate on an open, writable descriptor this function borrows;
    // it reads no memory of ours.
    let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(file), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) => {
            tracing::warn!(path, "the file system cannot reserve blocks (no fallocate): the replica is sparse");
            file.set_len(bytes).map_err(|source| ReplicaError::Io { path: path.into(), source })
        }
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => {
            Err(ReplicaError::NoSpace { path: path.into(), bytes, source: err })
        }
        _ => Err(ReplicaError::Io { path: path.into(), source: err }),
    }
}

impl ReplicaWriter {
    /// Creates a new, empty replica file at `path` (replacing any file
    /// there), keyed by u64, with room for `row_capacity` rows before it
    /// must grow.
    pub fn create(
        path: &Path,
        group: &str,
        dim: u32,
        storage: Storage,
        row_capacity: u64,
        default: &[f32],
    ) -> Result<ReplicaWriter, ReplicaError> {
        ReplicaWriter::create_keyed(path, group, dim, storage, KeyKind::U64, row_capacity, default)
    }

    /// [`ReplicaWriter::create`] with the key kind `keys`; string keys of
    /// more than [`KEY_BYTES_MAX`] bytes (or of none) are refused.
    pub fn create_keyed(
        path: &Path,
        group: &str,
        dim: u32,
        storage: Storage,
        keys: KeyKind,
        row_capacity: u64,
        default: &[f32],
    ) -> Result<ReplicaWriter, ReplicaError> {
        ReplicaWriter::create_linked(path, group, dim, storage, keys, None, row_capacity, default)
    }

    /// [`ReplicaWriter::create_keyed`] for a group whose rows link to a
    /// parent keyed by `link` (none: no parent).
    #[allow(clippy::too_many_arguments)]
    pub fn create_linked(
        path: &Path,
        group: &str,
        dim: u32,
        storage: Storage,
        keys: KeyKind,
        link: Option<KeyKind>,
        row_capacity: u64,
        default: &[f32],
    ) -> Result<ReplicaWriter, ReplicaError> {
        let aligned = line_padding_helps(dim, storage, keys, link);
        ReplicaWriter::create_with(path, group, dim, storage, keys, link, aligned, row_capacity, default)
    }

    /// [`ReplicaWriter::create_linked`] with the rows' line padding chosen
    /// (`line_aligned`; [`Layout::new`]): what this build writes, or, for
    /// tests, a file as builds before the padding wrote it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn create_with(
        path: &Path,
        group: &str,
        dim: u32,
        storage: Storage,
        keys: KeyKind,
        link: Option<KeyKind>,
        line_aligned: bool,
        row_capacity: u64,
        default: &[f32],
    ) -> Result<ReplicaWriter, ReplicaError> {
        assert!(!group.is_empty() && group.len() <= GROUP_NAME_BYTES_MAX, "group name length");
        assert!(dim > 0 && dim <= DIM_MAX, "dimension out of range");
        assert_eq!(default.len(), dim as usize);
        for kind in std::iter::once(keys).chain(link) {
            if let KeyKind::Str { bytes_max } = kind {
                if bytes_max == 0 || bytes_max > KEY_BYTES_MAX {
                    return Err(ReplicaError::KeyBytesMax { bytes_max });
                }
            }
        }
        let p = path.display().to_string();
        if row_capacity > ROW_CAPACITY_MAX {
            return Err(ReplicaError::Full { path: p, rows: row_capacity });
        }
        let io = |source| ReplicaError::Io { path: p.clone(), source };
        let header = Header {
            dim,
            storage,
            slot_count: slot_count_for(row_capacity),
            row_capacity,
            group: group.into(),
            keys,
            link,
            line_aligned,
            row_count: 0,
        };
        let layout = Layout::new(dim, storage, keys, link, header.line_aligned, header.slot_count, row_capacity)
            .expect("sizes within the row limit fit");
        let _ = std::fs::remove_file(path);
        let file = File::options().read(true).write(true).create_new(true).open(path).map_err(io)?;
        lock(&file, &p)?;
        let default_bytes: Vec<u8> = default.iter().flat_map(|x| x.to_le_bytes()).collect();
        if let Err(e) = reserve(&file, layout.file_bytes as u64, &p) {
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        file.write_all_at(&encode_superblock(&header, crc32fast::hash(&default_bytes)), 0).map_err(io)?;
        file.write_all_at(&encode_checkpoint(1, Cursor::default()), CHECKPOINT_OFFSETS[1] as u64).map_err(io)?;
        file.write_all_at(&default_bytes, DEFAULT_OFFSET as u64).map_err(io)?;
        let table = Replica::map(path, group, Access::Created)?;
        Ok(ReplicaWriter {
            scan_pending: false,
            grow_ahead: false,
            growth: None,
            retired: Vec::new(),
            payload: vec![0; table.layout().row_words()],
            key_displacements: 0,
            table: Arc::new(table),
            handle: None,
            path: path.into(),
            _lock: file,
            rows_used: 0,
            live: 0,
            cursor: Cursor::default(),
        })
    }

    /// Opens an existing file for writing: verifies it, drops rows left
    /// mid-write by a killed writer from the index, and removes temporary
    /// files a crash may have left beside it.
    pub fn open(path: &Path, group: &str) -> Result<(ReplicaWriter, OpenReport), ReplicaError> {
        let mut writer = ReplicaWriter::open_deferred(path, group)?;
        let report = writer.finish_open()?;
        Ok((writer, report))
    }

    /// Opens an existing file for writing after checking only its length,
    /// superblock, checkpoints and default vector, so that readers can be
    /// served from it at once (each read checks its row's CRC meanwhile).
    /// Nothing may be written until [`ReplicaWriter::finish_open`] has
    /// scanned it.
    pub fn open_deferred(path: &Path, group: &str) -> Result<ReplicaWriter, ReplicaError> {
        let p = path.display().to_string();
        let file = File::options()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| ReplicaError::Io { path: p.clone(), source })?;
        lock(&file, &p)?;
        // A file written sparse (before blocks were reserved, or copied with
        // holes) gets its blocks now; without room, writes to its holes could
        // still fail, so say so.
        let len = file.metadata().map_err(|source| ReplicaError::Io { path: p.clone(), source })?.len();
        if let Err(e) = reserve(&file, len, &p) {
            tracing::warn!(path = %p, "{e}: writes to the replica's unreserved pages may fail if the disk fills");
        }
        for why in ["grow", "sync", "build"] {
            let _ = std::fs::remove_file(temp_path(path, why));
        }
        let table = Replica::map(path, group, Access::ReadWrite)?;
        let cursor = table.cursor_at_open();
        Ok(ReplicaWriter {
            scan_pending: true,
            grow_ahead: false,
            growth: None,
            retired: Vec::new(),
            payload: vec![0; table.layout().row_words()],
            key_displacements: 0,
            table: Arc::new(table),
            handle: None,
            path: path.into(),
            _lock: file,
            rows_used: 0,
            live: 0,
            cursor,
        })
    }

    /// Scans a file opened with [`ReplicaWriter::open_deferred`]: checks
    /// every slot and row (readers keep reading meanwhile), drops rows left
    /// mid-write from the index, and makes the writer ready to write. A
    /// damaged file stays unwritable; it should be replaced (a full sync).
    pub fn finish_open(&mut self) -> Result<OpenReport, ReplicaError> {
        assert!(self.scan_pending, "finish_open runs once, after open_deferred");
        let scan = self.table.scan()?;
        for &slot in &scan.torn_slots {
            self.table.slot(slot).2.store(TAG_TOMBSTONE, Ordering::Release);
        }
        self.rows_used = scan.rows_used;
        self.live = scan.live;
        self.scan_pending = false;
        Ok(OpenReport { torn_rows: scan.torn_slots.len() as u64, live_rows: scan.live, cursor: self.cursor })
    }

    /// Whether [`ReplicaWriter::finish_open`] has yet to run.
    pub fn scan_pending(&self) -> bool {
        self.scan_pending
    }

    /// The handle readers load this writer's table through; created on
    /// first call and kept across growth and installs.
    pub fn handle(&mut self) -> Arc<ReplicaHandle> {
        let table = self.table.clone();
        self.handle.get_or_insert_with(|| (Arc::new(ReplicaHandle::serving(table)), 0)).0.clone()
    }

    /// Serves this writer's table as part `part` of `handle` from now on.
    pub(super) fn serve_through(&mut self, handle: Arc<ReplicaHandle>, part: usize) {
        self.handle = Some((handle, part));
    }

    pub fn table(&self) -> &Arc<Replica> {
        &self.table
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn live_rows(&self) -> u64 {
        self.live
    }

    /// The last change this file holds, as of the last `set_cursor`.
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Whether `key` is present. Panics on a string-keyed file.
    pub fn contains(&self, key: u64) -> bool {
        assert_eq!(self.table.key_kind(), KeyKind::U64, "{}: a u64 lookup in a string-keyed file", self.path.display());
        self.table.find(key).is_some()
    }

    /// Whether the string `key` is present (not merely another key under
    /// its hash). Panics on a u64-keyed file.
    pub fn contains_str(&self, key: &[u8]) -> bool {
        self.str_row(key).is_some()
    }

    /// The row of the string `key`, if present. Panics on a u64-keyed file.
    fn str_row(&self, key: &[u8]) -> Option<u32> {
        let layout = self.table.layout();
        let KeyKind::Str { bytes_max } = self.table.key_kind() else {
            panic!("{}: a string lookup in a u64-keyed file", self.path.display());
        };
        if key.len() > bytes_max as usize {
            return None;
        }
        let mut words = [0u32; 1 + KEY_BYTES_MAX as usize / 4];
        let words = &mut words[..layout.key_words];
        encode_key(key, words);
        self.table.find(key_hash(key)).filter(|&row| self.table.row_key_is(row, words))
    }

    /// String keys this writer (and the writers whose files it replaced)
    /// wrote over another key filed under the same hash: a metric, as a
    /// displacement is never an error.
    pub fn key_displacements(&self) -> u64 {
        self.key_displacements
    }

    fn key_kind_error(&self, used: &'static str) -> ReplicaError {
        ReplicaError::KeyKind { path: self.path.display().to_string(), kind: self.table.key_kind(), used }
    }

    /// Writes `v` as the vector of `key`, inserting the key if new (and
    /// growing the file if it is full). A string-keyed file refuses it. In
    /// a file with links, the row names no parent.
    pub fn upsert(&mut self, key: u64, v: &[f32]) -> Result<(), ReplicaError> {
        self.upsert_linked(EntityKey::Id(key), v, None)
    }

    /// Writes `v` as the vector of the string `key`, as [`upsert`](Self::upsert)
    /// does for a u64 key. A key longer than the file's limit, or a u64-keyed
    /// file, is refused.
    ///
    /// Two keys with the same [`key_hash`] share one row: the last written
    /// is kept, the other becomes unknown (its lookups miss and count a
    /// collision), and the displacement is counted
    /// ([`key_displacements`](Self::key_displacements)). With a 64-bit hash
    /// that takes billions of keys to be likely once.
    pub fn upsert_str(&mut self, key: &[u8], v: &[f32]) -> Result<(), ReplicaError> {
        self.upsert_linked(EntityKey::Str(key), v, None)
    }

    /// Writes `v` as the vector of `key` (of the file's key kind), its row
    /// naming `parent` as its parent's key (none: no parent). A parent in a
    /// file without links, or of another kind than its links, is refused.
    pub fn upsert_linked(
        &mut self,
        key: EntityKey<'_>,
        v: &[f32],
        parent: Option<EntityKey<'_>>,
    ) -> Result<(), ReplicaError> {
        let filed = match key {
            EntityKey::Id(id) => id,
            EntityKey::Str(bytes) => key_hash(bytes),
        };
        self.upsert_filed(filed, key, v, parent)
    }

    /// [`upsert_str`](Self::upsert_str) under the hash `hash`, whatever the
    /// key hashes to: tests file a key under another key's hash this way.
    #[cfg(test)]
    pub(super) fn upsert_hashed(&mut self, hash: u64, key: &[u8], v: &[f32]) -> Result<(), ReplicaError> {
        self.upsert_filed(hash, EntityKey::Str(key), v, None)
    }

    /// Encodes and writes one row filed under `filed` (the u64 key, or the
    /// string key's hash).
    fn upsert_filed(
        &mut self,
        filed: u64,
        key: EntityKey<'_>,
        v: &[f32],
        parent: Option<EntityKey<'_>>,
    ) -> Result<(), ReplicaError> {
        assert!(!self.scan_pending, "a writer writes only after finish_open");
        let str_key = match (self.table.key_kind(), key) {
            (KeyKind::U64, EntityKey::Id(_)) => &[][..],
            (KeyKind::Str { bytes_max }, EntityKey::Str(bytes)) => {
                if bytes.len() > bytes_max as usize {
                    return Err(ReplicaError::KeyTooLong { bytes: bytes.len(), bytes_max });
                }
                bytes
            }
            (KeyKind::U64, EntityKey::Str(_)) => return Err(self.key_kind_error("string keys")),
            (KeyKind::Str { .. }, EntityKey::Id(_)) => return Err(self.key_kind_error("u64 keys")),
        };
        if v.len() != self.table.dim() {
            return Err(ReplicaError::Dim { found: v.len(), dim: self.table.dim() as u32 });
        }
        if let Some(p) = parent {
            match self.table.link_kind() {
                Some(kind) if p.fits(kind) => {}
                Some(kind) => {
                    return Err(ReplicaError::Link {
                        path: self.path.display().to_string(),
                        why: format!("parent key '{p}' is not one of the parent's {kind}"),
                    })
                }
                None => {
                    return Err(ReplicaError::Link {
                        path: self.path.display().to_string(),
                        why: "the group has no parent: its rows name none".into(),
                    })
                }
            }
        }
        let layout = *self.table.layout();
        let mut words = std::mem::take(&mut self.payload);
        if layout.key_words > 0 {
            encode_key(str_key, &mut words[..layout.key_words]);
        }
        encode_link(parent, &mut words[layout.key_words..layout.payload_at()]);
        self.table.storage().encode(v, &mut words[layout.payload_at()..]);
        if layout.key_words > 0
            && self.table.find(filed).is_some_and(|row| !self.table.row_key_is(row, &words[..layout.key_words]))
        {
            self.key_displacements += 1;
        }
        let result = self.put_words(filed, &words);
        self.payload = words;
        result
    }

    /// Writes a row's words after its header (key words, then payload)
    /// under `key` (a u64 key, or a string key's hash).
    fn put_words(&mut self, key: u64, payload: &[u32]) -> Result<(), ReplicaError> {
        assert!(!self.scan_pending, "a writer writes only after finish_open");
        assert_eq!(payload.len(), self.table.layout().row_words(), "a whole row's words");
        let crc = row_crc(key, payload);
        if let Some(row) = self.table.find(key) {
            self.note_put(key, payload)?;
            self.write_row(row, key, payload, crc);
            return Ok(());
        }
        if self.rows_used == self.table.header().row_capacity {
            if self.growth.is_some() {
                // The spare quarter ran out before the growth was done.
                self.finish_growth()?;
            } else {
                self.grow()?;
            }
            return self.put_words(key, payload);
        }
        self.note_put(key, payload)?;
        let row = self.rows_used as u32;
        self.rows_used += 1;
        self.write_row(row, key, payload, crc);
        let t = &self.table;
        let mask = t.header().slot_count - 1;
        let mut slot = slot_of(key, t.header().slot_count);
        while t.slot(slot).2.load(Ordering::Relaxed) != TAG_EMPTY {
            slot = (slot + 1) & mask;
        }
        let (k, r, tag) = t.slot(slot);
        k.store(key, Ordering::Relaxed);
        r.store(row, Ordering::Relaxed);
        // Publishes key, row number and the row's contents together.
        tag.store(TAG_USED, Ordering::Release);
        self.live += 1;
        t.set_live_rows(self.live);
        if self.grow_ahead
            && self.growth.is_none()
            && self.rows_used >= self.table.header().row_capacity / 4 * GROW_AHEAD_QUARTERS
        {
            self.start_growth()?;
        }
        Ok(())
    }

    /// Tells a running growth that `key` is written: noted while the copy
    /// runs, written to the copy after.
    fn note_put(&mut self, key: u64, payload: &[u32]) -> Result<(), ReplicaError> {
        match self.growth.as_deref_mut() {
            None => Ok(()),
            Some(Growth { copy: Some(copy), .. }) => copy.put_words(key, payload),
            Some(growth) => {
                growth.touched.insert(key);
                Ok(())
            }
        }
    }

    /// `note_put` for a delete.
    fn note_delete(&mut self, key: u64) {
        match self.growth.as_deref_mut() {
            None => {}
            Some(Growth { copy: Some(copy), .. }) => {
                copy.delete(key);
            }
            Some(growth) => {
                growth.touched.insert(key);
            }
        }
    }

    /// The seqlock write: odd counter, contents, even counter.
    fn write_row(&self, row: u32, key: u64, payload: &[u32], crc: u32) {
        let t = &self.table;
        let base = t.row_base(row);
        let seq = t.u32_at(base);
        let s = seq.load(Ordering::Relaxed);
        // A row left odd by a killed writer is never reused, so `s` is even.
        debug_assert!(s.is_multiple_of(2));
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        t.u32_at(base + 4).store(crc, Ordering::Relaxed);
        t.u64_at(base + 8).store(key, Ordering::Relaxed);
        for (i, w) in payload.iter().enumerate() {
            t.u32_at(base + ROW_HEADER_BYTES + i * 4).store(*w, Ordering::Relaxed);
        }
        seq.store(s.wrapping_add(2), Ordering::Release);
    }

    /// Removes `key`; false if it was not present. Its row stays allocated
    /// (rows are never reused in place) until the file is next rebuilt.
    /// Panics on a string-keyed file (the key kind is settled where the
    /// file is opened, so a mismatch is a bug).
    pub fn delete(&mut self, key: u64) -> bool {
        assert_eq!(self.table.key_kind(), KeyKind::U64, "{}: a u64 delete in a string-keyed file", self.path.display());
        self.delete_hashed(key)
    }

    /// Removes the string `key`; false if it was not present (another key
    /// under its hash is left alone). Panics on a u64-keyed file.
    pub fn delete_str(&mut self, key: &[u8]) -> bool {
        if self.str_row(key).is_none() {
            return false;
        }
        self.delete_hashed(key_hash(key))
    }

    /// Removes the row filed under `key` (a u64 key or a string key's hash).
    fn delete_hashed(&mut self, key: u64) -> bool {
        assert!(!self.scan_pending, "a writer writes only after finish_open");
        self.note_delete(key);
        let Some((slot, _)) = self.table.find_slot(key) else { return false };
        self.table.slot(slot).2.store(TAG_TOMBSTONE, Ordering::Release);
        self.live -= 1;
        self.table.set_live_rows(self.live);
        true
    }

    /// Records `cursor` as the position the rows now reflect, durably (see
    /// [`Replica::write_checkpoint`]), on this thread.
    pub fn checkpoint(&mut self, cursor: Cursor) -> Result<(), ReplicaError> {
        self.reap_retired();
        self.cursor = cursor;
        self.table
            .write_checkpoint(cursor)
            .map_err(|source| ReplicaError::Io { path: self.path.display().to_string(), source })
    }

    /// Notes `cursor` without flushing; the next `checkpoint` makes it durable.
    pub fn set_cursor(&mut self, cursor: Cursor) {
        self.cursor = cursor;
    }

    /// Rehashes the live rows into a new file with room to spare, renames it
    /// into place and swaps it in, on this thread; readers never wait.
    fn grow(&mut self) -> Result<(), ReplicaError> {
        let capacity = self.grown_capacity(0)?;
        let mut fresh = self.create_grown(&temp_path(&self.path, "grow"), capacity)?;
        copy_rows(&self.table, &mut fresh, None)?;
        fresh.checkpoint(self.cursor)?;
        tracing::info!(path = %self.path.display(), rows = self.live, capacity, "replica grown");
        self.replace(fresh)
    }

    /// An empty file at `tmp` with this file's group, shape and default,
    /// and room for `capacity` rows: what a growth copies into.
    fn create_grown(&self, tmp: &Path, capacity: u64) -> Result<ReplicaWriter, ReplicaError> {
        let h = self.table.header();
        let default = self.table.default_vector();
        ReplicaWriter::create_linked(tmp, &h.group, h.dim, h.storage, h.keys, h.link, capacity, &default)
    }

    /// The capacity a grown file gets: twice the live rows plus `spare`.
    fn grown_capacity(&self, spare: u64) -> Result<u64, ReplicaError> {
        if self.live + 1 > ROW_CAPACITY_MAX {
            return Err(ReplicaError::Full { path: self.path.display().to_string(), rows: self.live + 1 });
        }
        Ok((self.live + 1 + spare).saturating_mul(2).clamp(GROWN_ROWS_MIN, ROW_CAPACITY_MAX))
    }

    /// Makes `fresh` (complete, checkpointed, at a temporary path) the file
    /// at this writer's path and the table readers see.
    pub fn replace(&mut self, fresh: ReplicaWriter) -> Result<(), ReplicaError> {
        self.replace_with(fresh, true)
    }

    /// `replace`, flushing `fresh` before the rename when `flush`.
    fn replace_with(&mut self, mut fresh: ReplicaWriter, flush: bool) -> Result<(), ReplicaError> {
        assert_eq!(fresh.table.key_kind(), self.table.key_kind(), "a replacement keeps the file's key kind");
        if flush {
            fresh.flush()?;
        }
        // Unflushed, the swap need not be durable either: after a crash that
        // loses the rename, the old file and its checkpoint are still there.
        fresh.rename_only(&self.path, flush)?;
        if let Some(growth) = self.growth.take() {
            growth.abandon(&self.path);
        }
        fresh.grow_ahead = self.grow_ahead;
        fresh.key_displacements += self.key_displacements;
        fresh.table.carry_key_collisions(&self.table);
        if let Some((handle, part)) = self.handle.take() {
            handle.install(part, fresh.table.clone());
            fresh.handle = Some((handle, part));
        }
        fresh.retired = std::mem::take(&mut self.retired);
        fresh.retired.push(self.table.clone());
        *self = fresh;
        self.reap_retired();
        Ok(())
    }

    /// Drops a copy that will not be swapped in, and removes its file.
    pub fn discard(self) {
        let path = self.path.clone();
        drop(self);
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), "could not remove a discarded replica copy: {e}");
        }
    }

    /// Releases the replaced tables no reader holds any more, to the
    /// `quiver-unmap` thread (see [`unmap_later`]).
    pub fn reap_retired(&mut self) {
        let (held, free): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.retired).into_iter().partition(|t| Arc::strong_count(t) > 1);
        self.retired = held;
        // No reader can take a new reference: the handle no longer names them.
        free.into_iter().for_each(unmap_later);
    }

    /// Replaced tables some reader still holds.
    pub fn retired_held(&self) -> usize {
        self.retired.iter().filter(|t| Arc::strong_count(t) > 1).count()
    }

    /// Flushes the file and renames it to `path`, syncing the directory.
    pub fn rename_to(&mut self, path: &Path) -> Result<(), ReplicaError> {
        self.flush()?;
        self.rename_only(path, true)
    }

    fn flush(&self) -> Result<(), ReplicaError> {
        self.table.raw().flush().map_err(|source| ReplicaError::Io { path: self.path.display().to_string(), source })
    }

    /// Renames the file to `path`, then syncs the directory when `durable`
    /// (an fsync of the directory also waits for the journal to take the
    /// file's dirty data, hundreds of milliseconds after a large replay).
    fn rename_only(&mut self, path: &Path, durable: bool) -> Result<(), ReplicaError> {
        let p = path.display().to_string();
        let io = |source| ReplicaError::Io { path: p.clone(), source };
        std::fs::rename(&self.path, path).map_err(io)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && durable) {
            File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        }
        self.path = path.into();
        Ok(())
    }
}

/// Replaced tables queued for the `quiver-unmap` thread at most; past it, a
/// table is unmapped on the caller's thread.
const UNMAP_QUEUE_MAX: usize = 64;

/// Drops `table` on the `quiver-unmap` thread: unmapping a multi-GB file,
/// and freeing its page cache once it was renamed over, takes hundreds of
/// milliseconds that the writer would otherwise not apply the stream for.
/// Never a shard's thread either way.
fn unmap_later(table: Arc<Replica>) {
    static UNMAPPER: std::sync::OnceLock<Option<std::sync::mpsc::SyncSender<Arc<Replica>>>> =
        std::sync::OnceLock::new();
    let unmapper = UNMAPPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Arc<Replica>>(UNMAP_QUEUE_MAX);
        let spawned = std::thread::Builder::new().name("quiver-unmap".into()).spawn(move || {
            lower_thread_priority();
            rx.into_iter().for_each(drop);
        });
        spawned.ok().map(|_| tx)
    });
    if let Some(tx) = unmapper {
        // Refused (queue full): the error holds the table, dropped here.
        let _ = tx.try_send(table);
    }
}
