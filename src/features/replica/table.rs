//! One mapped replica file: verification at open, the seqlock read path the
//! shards use, and the word-level stores the writer uses.
//!
//! Every shared byte is accessed through `AtomicU32`/`AtomicU64` references
//! into the mapping (see the module header of `replica` for the protocol), so
//! a reader racing the writer sees old or new words, never undefined
//! behaviour, and the sequence counter tells it whether the words it copied
//! belong together.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use super::format::{
    decode_checkpoint, decode_key, decode_superblock, encode_checkpoint, encode_key, key_hash, row_crc, slot_of,
    Cursor, EntityKeyBuf, Header, KeyKind, Layout, Storage, CHECKPOINT_OFFSETS, DEFAULT_OFFSET, KEY_WORDS_MAX,
    ROW_HEADER_BYTES, SLOT_BYTES, SUPERBLOCK_BYTES, TAG_EMPTY, TAG_TOMBSTONE, TAG_USED,
};
use super::ReplicaError;

/// Seqlock retries before a row is served as missing: far above the few
/// retries a live writer can cause (it holds a row for well under a
/// microsecond), low enough that a dead writer costs a reader only microseconds.
const READ_RETRIES_MAX: u32 = 1024;

/// Threads one scan splits the index across; each gets a contiguous range.
const SCAN_THREADS_MAX: usize = 8;

/// Slots below which a scan runs on the calling thread: starting threads
/// costs more than checking them.
const SCAN_SLOTS_PER_THREAD_MIN: u64 = 1 << 20;

/// Tables at least this large ask for huge pages: random lookups over them
/// miss the TLB more often than the lookups' cache misses cost.
const HUGE_PAGES_FROM_BYTES: u64 = 32 << 20;

/// An open, verified, mapped replica of one feature group.
pub struct Replica {
    map: MmapRaw,
    header: Header,
    layout: Layout,
    path: String,
    /// The cursor found at open.
    cursor: Cursor,
    /// The newest checkpoint record's counter. The lock serialises record
    /// writers (the refresher's flusher thread and the writer itself).
    checkpoint_counter: std::sync::Mutex<u64>,
    /// Keys present now; maintained by the writer.
    live_rows: AtomicU64,
    /// Reads that gave up on a row that stayed busy.
    torn_reads: AtomicU64,
    /// Set once every slot and row has been checked (at open, or by the
    /// writer's deferred scan). Until then each read checks its row's CRC.
    verified: AtomicBool,
    /// Reads that found a row failing its CRC (before verification passed)
    /// and served the default vector instead.
    corrupt_reads: AtomicU64,
    /// String-key lookups that found their key's hash in a row holding
    /// another key (a hash collision) and served the default vector.
    key_collisions: AtomicU64,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("path", &self.path).field("header", &self.header).finish()
    }
}

/// What a full index scan at open found.
#[derive(Debug, Default)]
pub(super) struct Scan {
    /// One past the highest row any slot refers to: where new rows go.
    pub rows_used: u64,
    pub live: u64,
    /// Slots whose row was mid-write when its writer stopped.
    pub torn_slots: Vec<u64>,
}

/// Whether replica mappings are locked in memory (`replica_lock`).
static LOCK_PAGES: AtomicBool = AtomicBool::new(false);

/// Locks every replica mapped from now on in memory (mlock), so a lookup
/// never takes a major fault after the kernel evicted a page: set once at
/// start-up from `replica_lock`, before any replica is opened. A mapping
/// that cannot be locked fails to open, naming RLIMIT_MEMLOCK.
pub fn lock_pages(on: bool) {
    LOCK_PAGES.store(on, Ordering::Relaxed);
}

/// Whether large replica mappings ask for huge pages (`replica_huge_pages`).
static HUGE_PAGES: AtomicBool = AtomicBool::new(false);

/// Asks for huge pages (`MADV_HUGEPAGE`) on every replica of at least
/// [`HUGE_PAGES_FROM_BYTES`] mapped from now on, or not: set once at
/// start-up from `replica_huge_pages`. On a file system with large folios
/// (ext4 from Linux 6.16, XFS) the page cache of such a file is then in
/// 2 MiB folios: fewer TLB misses for random lookups, but every update
/// dirties, and every checkpoint writes back, a whole 2 MiB folio
/// (measured in docs/BENCHMARKS.md, "Replica scale", steady updates: at
/// 50M rows, 36x the bytes written back and 60x the refresher's round p99,
/// for no lookup gain measured). Off unless asked for.
pub fn huge_pages(on: bool) {
    HUGE_PAGES.store(on, Ordering::Relaxed);
}

/// RLIMIT_MEMLOCK in words, for the error that names it.
fn memlock_limit() -> String {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return "unknown".into();
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        format!("{} bytes", limit.rlim_cur)
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes, where it can be read.
pub fn mem_available_bytes() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Held while a mapping is checked against the memory available and locked.
static LOCKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Refuses to lock a mapping larger than the memory available: mlock would
/// succeed under a generous RLIMIT_MEMLOCK and then push the node into swap
/// or the OOM killer, long after start-up said yes.
fn check_lockable(path: &str, bytes: u64, available: Option<u64>) -> Result<(), ReplicaError> {
    match available {
        Some(available) if bytes > available => Err(ReplicaError::LockTooLarge { path: path.into(), bytes, available }),
        _ => Ok(()),
    }
}

impl Replica {
    /// Maps `path` read-only, pre-faults its pages and verifies it
    /// completely. `expected_group` guards against swapped files. A file
    /// with rows left mid-write by a killed writer is refused here (a reader
    /// cannot repair it); the server's writer opens such files instead.
    pub fn open(path: &Path, expected_group: &str) -> Result<Replica, ReplicaError> {
        let mut replica = Replica::map(path, expected_group, Access::ReadOnly)?;
        let scan = replica.scan()?;
        if !scan.torn_slots.is_empty() {
            return Err(ReplicaError::Torn { path: replica.path.clone(), rows: scan.torn_slots.len() as u64 });
        }
        replica.header.row_count = scan.live;
        Ok(replica)
    }

    /// Maps `path` and checks what is cheap to check: the file length, the
    /// superblock, the checkpoint records and the default vector. Slots and
    /// rows are not read: until [`Replica::scan`] passes, every read checks
    /// its row's CRC, so serving can start before a multi-GB file is read.
    pub(super) fn map(path: &Path, expected_group: &str, access: Access) -> Result<Replica, ReplicaError> {
        let writable = access != Access::ReadOnly;
        let p = path.display().to_string();
        let io = |source| ReplicaError::Io { path: p.clone(), source };
        let file = File::options().read(true).write(writable).open(path).map_err(io)?;
        let actual = file.metadata().map_err(io)?.len();
        if actual < DEFAULT_OFFSET as u64 {
            return Err(ReplicaError::Length { path: p, expected: DEFAULT_OFFSET as u64, actual });
        }
        let locking = LOCK_PAGES.load(Ordering::Relaxed);
        // Checked and locked under one process-wide lock: a locked file's
        // pages leave MemAvailable, so each check sees every replica and copy
        // locked before it, and two copies made at once (a sync's buckets on
        // threads of their own) cannot both pass against the same memory.
        let locking_guard = locking.then(|| LOCKING.lock().unwrap_or_else(|e| e.into_inner()));
        if locking {
            check_lockable(&p, actual, mem_available_bytes())?;
        }
        let map =
            if writable { MmapOptions::new().map_raw(&file) } else { MmapOptions::new().map_raw_read_only(&file) }
                .map_err(io)?;
        if locking {
            map.lock().map_err(|source| ReplicaError::MemoryLock {
                path: p.clone(),
                bytes: actual,
                limit: memlock_limit(),
                source,
            })?;
        }
        drop(locking_guard);
        if actual >= HUGE_PAGES_FROM_BYTES && HUGE_PAGES.load(Ordering::Relaxed) {
            // Only a hint: it takes effect where the kernel backs this file
            // with huge pages or large folios (tmpfs with huge=advise, ext4
            // from 6.16, XFS); elsewhere it changes nothing, so a refusal is
            // not an error.
            #[cfg(target_os = "linux")]
            if let Err(e) = map.advise(memmap2::Advice::HugePage) {
                tracing::debug!(path = %p, "no huge pages for the replica: {e}");
            }
        }
        // SAFETY: the mapping is at least DEFAULT_OFFSET bytes long (checked
        // above) and lives for this borrow; the superblock never changes after
        // the file is created.
        let superblock = unsafe { std::slice::from_raw_parts(map.as_ptr(), DEFAULT_OFFSET) };
        let (header, default_crc) = decode_superblock(&superblock[..SUPERBLOCK_BYTES], &p)?;
        let layout = Layout::new(
            header.dim,
            header.storage,
            header.keys,
            header.link,
            header.line_aligned,
            header.slot_count,
            header.row_capacity,
        )
        .ok_or_else(|| ReplicaError::Header { path: p.clone(), what: "sizes overflow".into() })?;
        if layout.file_bytes as u64 != actual {
            return Err(ReplicaError::Length { path: p, expected: layout.file_bytes as u64, actual });
        }
        let (checkpoint_counter, cursor) = CHECKPOINT_OFFSETS
            .iter()
            .filter_map(|&at| decode_checkpoint(&superblock[at..at + 64]))
            .max_by_key(|(counter, _)| *counter)
            .ok_or_else(|| ReplicaError::Checkpoint { path: p.clone() })?;
        if header.group != expected_group {
            return Err(ReplicaError::Group { path: p, found: header.group, expected: expected_group.into() });
        }
        let replica = Replica {
            map,
            header,
            layout,
            path: p,
            cursor,
            checkpoint_counter: std::sync::Mutex::new(checkpoint_counter),
            live_rows: AtomicU64::new(0),
            torn_reads: AtomicU64::new(0),
            verified: AtomicBool::new(access == Access::Created),
            corrupt_reads: AtomicU64::new(0),
            key_collisions: AtomicU64::new(0),
        };
        if crc32fast::hash(&replica.default_bytes()) != default_crc {
            return Err(ReplicaError::DefaultChecksum { path: replica.path });
        }
        Ok(replica)
    }

    fn default_bytes(&self) -> Vec<u8> {
        (0..self.dim())
            .flat_map(|i| self.u32_at(DEFAULT_OFFSET + i * 4).load(Ordering::Relaxed).to_le_bytes())
            .collect()
    }

    /// Reads the whole file in (sequentially, so that a file the page cache
    /// evicted comes back at disk speed rather than one random fault per
    /// row), then checks every index slot and the row it names, on up to
    /// [`SCAN_THREADS_MAX`] threads at low CPU priority: it may run while
    /// shards serve from this table. Rows left mid-write are reported, not
    /// treated as damage. Once it passes, reads stop checking row CRCs.
    pub(super) fn scan(&self) -> Result<Scan, ReplicaError> {
        // Only a hint: without it the scan faults the pages in itself.
        #[cfg(target_os = "linux")]
        let _ = self.map.advise(memmap2::Advice::PopulateRead);
        let slots = self.header.slot_count;
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = (slots / SCAN_SLOTS_PER_THREAD_MIN).clamp(1, cores.min(SCAN_THREADS_MAX) as u64);
        let per = slots.div_ceil(threads);
        let parts: Vec<Result<Scan, ReplicaError>> = if threads == 1 {
            vec![self.scan_slots(0, slots)]
        } else {
            std::thread::scope(|scope| {
                let workers: Vec<_> = (0..threads)
                    .map(|t| {
                        scope.spawn(move || {
                            lower_thread_priority();
                            self.scan_slots(t * per, ((t + 1) * per).min(slots))
                        })
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().expect("scan threads do not panic")).collect()
            })
        };
        let mut scan = Scan::default();
        for part in parts {
            let part = part?;
            scan.rows_used = scan.rows_used.max(part.rows_used);
            scan.live += part.live;
            scan.torn_slots.extend(part.torn_slots);
        }
        self.live_rows.store(scan.live, Ordering::Relaxed);
        self.verified.store(true, Ordering::Release);
        Ok(scan)
    }

    /// Whether every slot and row has been checked (see [`Replica::scan`]).
    pub fn verified(&self) -> bool {
        self.verified.load(Ordering::Acquire)
    }

    /// Reads that found a row failing its CRC before verification passed.
    pub fn corrupt_reads(&self) -> u64 {
        self.corrupt_reads.load(Ordering::Relaxed)
    }

    /// String-key lookups that met another key under their key's hash.
    pub fn key_collisions(&self) -> u64 {
        self.key_collisions.load(Ordering::Relaxed)
    }

    /// Adds the collisions counted on the table this one replaces, so the
    /// count a metric exports does not start again at a resync or a growth
    /// (lookups still on the old table after the swap are not carried).
    pub(super) fn carry_key_collisions(&self, from: &Replica) {
        self.key_collisions.fetch_add(from.key_collisions(), Ordering::Relaxed);
    }

    /// Checks slots `from..to` and the rows they name.
    fn scan_slots(&self, from: u64, to: u64) -> Result<Scan, ReplicaError> {
        let mut scan = Scan::default();
        let mut payload = vec![0u32; self.layout.row_words()];
        let mut key_bytes = Vec::new();
        for slot in from..to {
            let (key, row, tag) = self.slot(slot);
            let damaged = |what: String| ReplicaError::Index { path: self.path.clone(), slot, what };
            match tag.load(Ordering::Relaxed) {
                TAG_EMPTY => continue,
                TAG_USED | TAG_TOMBSTONE => {}
                other => return Err(damaged(format!("unknown tag {other}"))),
            }
            let row = u64::from(row.load(Ordering::Relaxed));
            if row >= self.header.row_capacity {
                return Err(damaged(format!("row {row} past the capacity of {}", self.header.row_capacity)));
            }
            scan.rows_used = scan.rows_used.max(row + 1);
            if tag.load(Ordering::Relaxed) == TAG_TOMBSTONE {
                continue;
            }
            let key = key.load(Ordering::Relaxed);
            match self.verify_row(row as u32, &mut payload) {
                None => scan.torn_slots.push(slot),
                Some((row_key, _)) if row_key != key => {
                    return Err(damaged(format!("key {key} names row {row}, which holds key {row_key}")));
                }
                Some((_, crc)) if crc != row_crc(key, &payload) => {
                    return Err(ReplicaError::PayloadChecksum { path: self.path.clone(), row, key });
                }
                Some(_) => {
                    // A string key's bytes must hash to the key the slot and
                    // the row are filed under, or lookups of it would miss.
                    if let KeyKind::Str { bytes_max } = self.header.keys {
                        let words = &payload[..self.layout.key_words];
                        if !decode_key(words, bytes_max, &mut key_bytes) || key_hash(&key_bytes) != key {
                            return Err(damaged(format!("row {row}'s key bytes are not a key hashing to {key}")));
                        }
                    }
                    scan.live += 1;
                }
            }
        }
        Ok(scan)
    }

    /// A consistent copy of a row's key, stored CRC and words after its
    /// header (`payload`: [`Layout::row_words`] of them, key words first), taken
    /// under the seqlock so that opening a file another process is writing
    /// does not mistake a row in flight for damage; `None` if the row stays
    /// mid-write (its writer was killed there).
    pub(super) fn verify_row(&self, row: u32, payload: &mut [u32]) -> Option<(u64, u32)> {
        let base = self.row_base(row);
        let seq = self.u32_at(base);
        for attempt in 0..READ_RETRIES_MAX {
            let before = seq.load(Ordering::Acquire);
            if before.is_multiple_of(2) {
                let key = self.u64_at(base + 8).load(Ordering::Relaxed);
                let crc = self.u32_at(base + 4).load(Ordering::Relaxed);
                for (i, w) in payload.iter_mut().enumerate() {
                    *w = self.u32_at(base + ROW_HEADER_BYTES + i * 4).load(Ordering::Relaxed);
                }
                fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) == before {
                    return Some((key, crc));
                }
            }
            if attempt > READ_RETRIES_MAX / 2 {
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
        None
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn dim(&self) -> usize {
        self.header.dim as usize
    }

    pub fn storage(&self) -> Storage {
        self.header.storage
    }

    pub fn key_kind(&self) -> KeyKind {
        self.header.keys
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// The Redis position this file had reached when it was opened.
    pub fn cursor_at_open(&self) -> Cursor {
        self.cursor
    }

    /// Makes `cursor` the file's durable position: flushes every dirty page
    /// (rows included) to disk, then writes the older of the two checkpoint
    /// records. A checkpoint thus never claims changes the file does not
    /// hold, even after a machine crash, and a crash while the record is
    /// written leaves the other record intact. Callable from any thread;
    /// `cursor` must describe rows already written.
    pub fn write_checkpoint(&self, cursor: Cursor) -> std::io::Result<()> {
        let mut counter = self.checkpoint_counter.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.map.flush()?;
        *counter += 1;
        let record = encode_checkpoint(*counter, cursor);
        let at = CHECKPOINT_OFFSETS[(*counter % 2) as usize];
        for (i, word) in record.chunks_exact(8).enumerate() {
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            self.u64_at(at + i * 8).store(w, Ordering::Relaxed);
        }
        Ok(())
    }

    pub(super) fn layout(&self) -> &Layout {
        &self.layout
    }

    pub(super) fn raw(&self) -> &MmapRaw {
        &self.map
    }

    /// Keys present now.
    pub fn live_rows(&self) -> u64 {
        self.live_rows.load(Ordering::Relaxed)
    }

    /// The file's size, all mapped.
    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// How much of the mapping is in memory now (`mincore`); after a scan,
    /// which reads every page, what serving it keeps resident.
    pub fn resident_bytes(&self) -> u64 {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        let len = self.map.len();
        let mut pages = vec![0u8; len.div_ceil(page)];
        // SAFETY: the mapping is `len` bytes from a page-aligned address and
        // lives for this borrow; `pages` has one byte per page of it.
        let rc = unsafe { libc::mincore(self.map.as_mut_ptr().cast(), len, pages.as_mut_ptr()) };
        if rc != 0 {
            return 0;
        }
        (pages.iter().filter(|&&p| p & 1 == 1).count() * page).min(len) as u64
    }

    pub(super) fn set_live_rows(&self, n: u64) {
        self.live_rows.store(n, Ordering::Relaxed);
    }

    /// Reads that gave up on a busy row and served the default vector.
    pub fn torn_reads(&self) -> u64 {
        self.torn_reads.load(Ordering::Relaxed)
    }

    #[inline(always)]
    pub(super) fn u32_at(&self, at: usize) -> &AtomicU32 {
        assert!(at.is_multiple_of(4) && at + 4 <= self.layout.file_bytes);
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned);
        // every access to shared bytes goes through atomics, and the
        // reference cannot outlive the mapping it borrows from.
        unsafe { &*self.map.as_ptr().add(at).cast::<AtomicU32>() }
    }

    /// The `n` words from byte `at` on, bounds-checked once.
    #[inline(always)]
    pub(super) fn u32s_at(&self, at: usize, n: usize) -> &[AtomicU32] {
        assert!(at.is_multiple_of(4) && at.checked_add(n * 4).is_some_and(|end| end <= self.layout.file_bytes));
        // SAFETY: as for `u32_at`: the n words lie in bounds and 4-aligned,
        // and every access to them goes through the atomics.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at).cast::<AtomicU32>(), n) }
    }

    #[inline(always)]
    pub(super) fn u64_at(&self, at: usize) -> &AtomicU64 {
        assert!(at.is_multiple_of(8) && at + 8 <= self.layout.file_bytes);
        // SAFETY: as for `u32_at`, with 8-byte alignment.
        unsafe { &*self.map.as_ptr().add(at).cast::<AtomicU64>() }
    }

    #[inline(always)]
    pub(super) fn slot(&self, slot: u64) -> (&AtomicU64, &AtomicU32, &AtomicU32) {
        let at = self.layout.index_offset + slot as usize * SLOT_BYTES;
        (self.u64_at(at), self.u32_at(at + 8), self.u32_at(at + 12))
    }

    #[inline(always)]
    pub(super) fn row_base(&self, row: u32) -> usize {
        self.layout.rows_offset + row as usize * self.layout.row_stride
    }

    /// The index slot holding `key`, and its row, if present.
    #[inline]
    pub(super) fn find_slot(&self, key: u64) -> Option<(u64, u32)> {
        let mask = self.header.slot_count - 1;
        let mut slot = slot_of(key, self.header.slot_count);
        // At least half the slots are empty, so this ends well before the bound.
        for _ in 0..self.header.slot_count {
            let (k, row, tag) = self.slot(slot);
            match tag.load(Ordering::Acquire) {
                TAG_EMPTY => return None,
                TAG_USED if k.load(Ordering::Relaxed) == key => {
                    let row = row.load(Ordering::Relaxed);
                    // Only an unverified, damaged file names a row past the
                    // end; it is served as missing rather than read.
                    return (u64::from(row) < self.header.row_capacity).then_some((slot, row));
                }
                _ => {}
            }
            slot = (slot + 1) & mask;
        }
        None
    }

    /// The row filed under `key` (a u64 key, or a string key's
    /// [`key_hash`], whichever key that row holds), if present.
    #[inline]
    pub fn find(&self, key: u64) -> Option<u32> {
        self.find_slot(key).map(|(_, row)| row)
    }

    /// The keys of the used index slots `from..from + slots_max` into `out`
    /// (a string key read whole from its row), for a writer walking its own
    /// rows a bounded stretch at a time (the Feast follower's sweep for
    /// keys deleted while it was not listening); returns the slot to go on
    /// from, 0 once the walk reached the end. A growth renumbers the slots,
    /// so a walk across one may skip or repeat keys until its next pass.
    pub fn keys_in_slots(&self, from: u64, slots_max: u64, out: &mut Vec<EntityKeyBuf>) -> u64 {
        let count = self.header.slot_count;
        let end = from.saturating_add(slots_max).min(count);
        let mut bytes = Vec::new();
        for slot in from.min(end)..end {
            let (key, row, tag) = self.slot(slot);
            if tag.load(Ordering::Acquire) != TAG_USED {
                continue;
            }
            let key = key.load(Ordering::Relaxed);
            match self.header.keys {
                KeyKind::U64 => out.push(EntityKeyBuf::Id(key)),
                KeyKind::Str { bytes_max } => {
                    let row = row.load(Ordering::Relaxed);
                    if u64::from(row) >= self.header.row_capacity {
                        continue;
                    }
                    let words = self.u32s_at(self.row_base(row) + ROW_HEADER_BYTES, self.layout.key_words);
                    let mut plain = [0u32; KEY_WORDS_MAX];
                    for (p, w) in plain.iter_mut().zip(words) {
                        *p = w.load(Ordering::Relaxed);
                    }
                    if decode_key(&plain[..words.len()], bytes_max, &mut bytes) {
                        out.push(EntityKeyBuf::Str(bytes.clone()));
                    }
                }
            }
        }
        if end >= count {
            0
        } else {
            end
        }
    }

    /// Copies row `row` into `out` (and its link words into `link`, when
    /// not empty) if it holds `key` (and, in a string-keyed file, the
    /// string `str_key` hashing to it) and a consistent copy can be taken;
    /// false otherwise (the row was deleted and reused, holds another string
    /// under the same hash, stayed busy past the retry bound, or, before
    /// verification passed, fails its CRC).
    #[inline]
    fn read_row(&self, row: u32, key: u64, str_key: &[u8], out: &mut [f32], link: &mut [u32]) -> bool {
        if self.verified.load(Ordering::Relaxed) {
            self.copy_row::<false>(row, key, str_key, out, link)
        } else {
            self.copy_row::<true>(row, key, str_key, out, link)
        }
    }

    /// `read_row`, checking the row's CRC when `CHECK`. The row's words
    /// after its header are borrowed once, as one bounds-checked slice:
    /// the string key is compared word by word, the link copied and the
    /// payload decoded from it under one seqlock read, in tight loops (the
    /// payload copy is most of a lookup's instructions). The CRC, checked
    /// only before verification has passed, reads the same words again in
    /// the same window.
    #[inline(always)]
    fn copy_row<const CHECK: bool>(
        &self,
        row: u32,
        key: u64,
        str_key: &[u8],
        out: &mut [f32],
        link: &mut [u32],
    ) -> bool {
        let base = self.row_base(row);
        let seq = self.u32_at(base);
        let layout = &self.layout;
        debug_assert!(link.is_empty() || link.len() == layout.link_words);
        let words = self.u32s_at(base + ROW_HEADER_BYTES, layout.row_words());
        let (key_words, rest) = words.split_at(layout.key_words);
        let (link_words, payload) = rest.split_at(layout.link_words);
        // The key's row words, built once: compared on every retry.
        let mut want = [0u32; KEY_WORDS_MAX];
        let want = &mut want[..key_words.len()];
        if !want.is_empty() {
            encode_key(str_key, want);
        }
        for _ in 0..READ_RETRIES_MAX {
            let before = seq.load(Ordering::Acquire);
            if before.is_multiple_of(2) {
                let row_key = self.u64_at(base + 8).load(Ordering::Relaxed);
                let same_key = key_words
                    .iter()
                    .zip(want.iter())
                    .fold(true, |same, (w, &expected)| same & (w.load(Ordering::Relaxed) == expected));
                for (l, w) in link.iter_mut().zip(link_words) {
                    *l = w.load(Ordering::Relaxed);
                }
                self.header.storage.decode(payload.iter().map(|w| w.load(Ordering::Relaxed)), out);
                let crc_ok = !CHECK || {
                    let stored_crc = self.u32_at(base + 4).load(Ordering::Relaxed);
                    let mut crc = CrcFeed::new(row_key);
                    words.iter().for_each(|w| crc.push(w.load(Ordering::Relaxed)));
                    crc.finalize() == stored_crc
                };
                fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) == before {
                    if row_key != key {
                        return false;
                    }
                    if !crc_ok {
                        self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                        return false;
                    }
                    if !same_key {
                        self.key_collisions.fetch_add(1, Ordering::Relaxed);
                        return false;
                    }
                    return true;
                }
            }
            std::hint::spin_loop();
        }
        self.torn_reads.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Whether row `row` holds the string key whose row words are `words`:
    /// for the writer, on its own rows, which are never mid-write.
    pub(super) fn row_key_is(&self, row: u32, words: &[u32]) -> bool {
        let base = self.row_base(row) + ROW_HEADER_BYTES;
        words.iter().enumerate().all(|(i, &w)| self.u32_at(base + i * 4).load(Ordering::Relaxed) == w)
    }

    fn copy_default(&self, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = f32::from_bits(self.u32_at(DEFAULT_OFFSET + i * 4).load(Ordering::Relaxed));
        }
    }

    /// Copies the vector of `key` into `out` (length `dim`); copies the
    /// default vector and returns false when the key is unknown.
    /// Panics on a string-keyed file (see [`Replica::read_str_into`]).
    #[inline]
    pub fn read_into(&self, key: u64, out: &mut [f32]) -> bool {
        assert_eq!(out.len(), self.dim());
        assert_eq!(self.header.keys, KeyKind::U64, "{}: a u64 lookup in a string-keyed file", self.path);
        self.read_filed(key, &[], out, &mut [])
    }

    /// The one-key lookup behind every other: the row filed under `filed`
    /// (a u64 key, or the hash of the string `str_key`) into `out` and its
    /// link into `link` (when not empty); the default vector and no link
    /// when it is missing. The caller has checked the key kind.
    #[inline]
    fn read_filed(&self, filed: u64, str_key: &[u8], out: &mut [f32], link: &mut [u32]) -> bool {
        if let Some(row) = self.find(filed) {
            if self.read_row(row, filed, str_key, out, link) {
                return true;
            }
        }
        self.copy_default(out);
        if !link.is_empty() {
            link.fill(0);
        }
        false
    }

    /// Words of a row's link to its parent: 0 for a group without one.
    pub fn link_words(&self) -> usize {
        self.layout.link_words
    }

    /// The kind of key each row's link names, for a group with a parent.
    pub fn link_kind(&self) -> Option<KeyKind> {
        self.header.link
    }

    /// [`Replica::read_into`] for a key of either kind (`filed`: a u64 key,
    /// or the [`key_hash`] of the string `str_key`), also copying the row's
    /// link words into `link` (empty, or [`Replica::link_words`] long; zero
    /// when the key is missing).
    #[inline]
    pub fn read_linked_into(&self, filed: u64, str_key: &[u8], out: &mut [f32], link: &mut [u32]) -> bool {
        assert_eq!(out.len(), self.dim());
        assert!(link.is_empty() || link.len() == self.layout.link_words, "{}: a whole link", self.path);
        match self.header.keys {
            KeyKind::U64 => assert!(str_key.is_empty(), "{}: a string lookup in a u64-keyed file", self.path),
            KeyKind::Str { bytes_max } => {
                if str_key.is_empty() || str_key.len() > bytes_max as usize {
                    self.copy_default(out);
                    if !link.is_empty() {
                        link.fill(0);
                    }
                    return false;
                }
            }
        }
        self.read_filed(filed, str_key, out, link)
    }

    /// Copies the vector of the string `key` into `out` (length `dim`);
    /// copies the default vector and returns false when the key is unknown,
    /// longer than the file's keys can be, or its hash is filed under
    /// another key (counted in [`Replica::key_collisions`]). Panics on a
    /// u64-keyed file: which kind a group's keys are is settled where its
    /// file is opened ([`Replica::key_kind`]), so a mismatch here is a bug,
    /// never data.
    #[inline]
    pub fn read_str_into(&self, key: &[u8], out: &mut [f32]) -> bool {
        self.read_str_hashed(key_hash(key), key, out)
    }

    /// [`Replica::read_str_into`] with the key's [`key_hash`] already
    /// computed (a bucketed group hashes once to pick the table).
    #[inline]
    pub(super) fn read_str_hashed(&self, hash: u64, key: &[u8], out: &mut [f32]) -> bool {
        assert_eq!(out.len(), self.dim());
        let KeyKind::Str { bytes_max } = self.header.keys else {
            panic!("{}: a string lookup in a u64-keyed file", self.path);
        };
        if key.len() <= bytes_max as usize {
            return self.read_filed(hash, key, out, &mut []);
        }
        self.copy_default(out);
        false
    }

    /// Looks up many keys at once, writing `keys.len()` vectors into `out`
    /// (row-major, `dim` floats each) and, when `links` is not empty, each
    /// row's link words into it ([`Replica::link_words`] per key, zero for
    /// a missing key); returns how many were missing.
    ///
    /// Three passes so the memory loads overlap instead of queueing behind
    /// each other: prefetch every key's index slot, then resolve rows and
    /// prefetch them, then copy.
    pub fn read_many_into(&self, keys: &[u64], rows: &mut [u32], out: &mut [f32], links: &mut [u32]) -> usize {
        let dim = self.dim();
        assert!(out.len() == keys.len() * dim && rows.len() >= keys.len());
        let lw = self.layout.link_words;
        assert!(links.is_empty() || links.len() == keys.len() * lw, "{}: a whole link per key", self.path);
        assert_eq!(self.header.keys, KeyKind::U64, "{}: a u64 lookup in a string-keyed file", self.path);
        for &key in keys {
            self.prefetch_slot(key);
        }
        for (&key, row) in keys.iter().zip(rows.iter_mut()) {
            *row = self.find(key).unwrap_or(u32::MAX);
            if *row != u32::MAX {
                self.prefetch_row_lines(*row);
            }
        }
        let mut missing = 0;
        if links.is_empty() {
            // The common case, kept free of the links' bookkeeping.
            for ((row, &key), dst) in rows.iter().zip(keys).zip(out.chunks_exact_mut(dim)) {
                if *row == u32::MAX || !self.read_row(*row, key, &[], dst, &mut []) {
                    missing += 1;
                    self.copy_default(dst);
                }
            }
            return missing;
        }
        for ((row, &key), (dst, link)) in
            rows.iter().zip(keys).zip(out.chunks_exact_mut(dim).zip(links.chunks_exact_mut(lw)))
        {
            if *row == u32::MAX || !self.read_row(*row, key, &[], dst, link) {
                missing += 1;
                self.copy_default(dst);
                link.fill(0);
            }
        }
        missing
    }

    /// [`Replica::read_str_into`] for many keys at once, in the three passes
    /// of [`Replica::read_many_into`]; `keys` is walked once per pass (so
    /// any cheap, cloneable iterator over a request's keys will do, with
    /// nothing collected), and each key is hashed once, into `hashes`.
    /// Returns how many keys were missing.
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
        let keys = keys.into_iter();
        let (n, dim) = (keys.len(), self.dim());
        assert!(out.len() == n * dim && rows.len() >= n && hashes.len() >= n);
        let lw = self.layout.link_words;
        assert!(links.is_empty() || links.len() == n * lw, "{}: a whole link per key", self.path);
        let KeyKind::Str { bytes_max } = self.header.keys else {
            panic!("{}: a string lookup in a u64-keyed file", self.path);
        };
        for (key, hash) in keys.clone().zip(hashes.iter_mut()) {
            *hash = key_hash(key);
            self.prefetch_slot(*hash);
        }
        for ((key, &hash), row) in keys.clone().zip(hashes.iter()).zip(rows.iter_mut()) {
            let found = if key.len() <= bytes_max as usize { self.find(hash) } else { None };
            *row = found.unwrap_or(u32::MAX);
            if *row != u32::MAX {
                self.prefetch_row_lines(*row);
            }
        }
        let mut missing = 0;
        let each = keys.zip(hashes.iter()).zip(rows.iter()).zip(out.chunks_exact_mut(dim));
        if links.is_empty() {
            // The common case, kept free of the links' bookkeeping.
            for (((key, &hash), &row), dst) in each {
                if row == u32::MAX || !self.read_row(row, hash, key, dst, &mut []) {
                    missing += 1;
                    self.copy_default(dst);
                }
            }
            return missing;
        }
        for ((((key, &hash), &row), dst), link) in each.zip(links.chunks_exact_mut(lw)) {
            if row == u32::MAX || !self.read_row(row, hash, key, dst, link) {
                missing += 1;
                self.copy_default(dst);
                link.fill(0);
            }
        }
        missing
    }

    /// Starts loading `key`'s index slot, for a batch of lookups spread over
    /// several tables (see `ReplicaHandle::read_many_into`).
    #[inline]
    pub fn prefetch_slot(&self, key: u64) {
        let slot = slot_of(key, self.header.slot_count) as usize;
        prefetch(self.map.as_ptr().wrapping_add(self.layout.index_offset + slot * SLOT_BYTES));
    }

    /// Finds `key` and starts loading its row, if it has one.
    #[inline]
    pub fn prefetch_row(&self, key: u64) {
        if let Some(row) = self.find(key) {
            self.prefetch_row_lines(row);
        }
    }

    /// Starts loading every cache line of `row` (its header, a string key,
    /// the payload), up to [`PREFETCH_ROW_BYTES_MAX`]: a row is 16-byte
    /// aligned, so even a small one may straddle two lines, and a string
    /// key puts the payload a line or two after the header. Past the bound
    /// the hardware's own stream prefetch takes over.
    #[inline]
    fn prefetch_row_lines(&self, row: u32) {
        let start = self.row_base(row);
        let end = start + self.layout.row_stride.min(PREFETCH_ROW_BYTES_MAX);
        let base = self.map.as_ptr();
        let mut line = start & !(CACHE_LINE_BYTES - 1);
        while line < end {
            prefetch(base.wrapping_add(line));
            line += CACHE_LINE_BYTES;
        }
    }

    /// Copies the default vector, served for unknown keys, into `out`
    /// (length `dim`).
    pub fn default_into(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.dim());
        self.copy_default(out);
    }

    /// The default vector served for unknown keys.
    pub fn default_vector(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.dim()];
        self.copy_default(&mut v);
        v
    }
}

/// The CRC of a row fed a word at a time, in chunks: the hasher is fast on
/// long slices, slow on 4 bytes.
struct CrcFeed {
    hasher: crc32fast::Hasher,
    chunk: [u8; 256],
    filled: usize,
}

impl CrcFeed {
    #[inline(always)]
    fn new(key: u64) -> CrcFeed {
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&key.to_le_bytes());
        CrcFeed { hasher, chunk: [0; 256], filled: 0 }
    }

    #[inline(always)]
    fn push(&mut self, w: u32) {
        self.chunk[self.filled..self.filled + 4].copy_from_slice(&w.to_le_bytes());
        self.filled += 4;
        if self.filled == self.chunk.len() {
            self.hasher.update(&self.chunk);
            self.filled = 0;
        }
    }

    fn finalize(mut self) -> u32 {
        self.hasher.update(&self.chunk[..self.filled]);
        self.hasher.finalize()
    }
}

/// How a file is mapped, and what `map` may assume about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Access {
    /// For readers only.
    ReadOnly,
    /// For the writer, over a file of unchecked slots and rows.
    ReadWrite,
    /// For the writer, over a file it has just created: every slot is empty,
    /// so there is nothing to scan and reads need no CRC checks.
    Created,
}

/// Makes the calling thread yield the CPU to the shards' threads: a scan of
/// a large replica must not slow the requests served meanwhile.
pub(super) fn lower_thread_priority() {
    // SAFETY: setpriority on the calling thread (who = 0 with PRIO_PROCESS
    // names the calling thread on Linux) has no memory effects; raising the
    // nice value needs no privilege, and a refusal only leaves it as it was.
    #[cfg(target_os = "linux")]
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 10);
    }
}

const CACHE_LINE_BYTES: usize = 64;
/// Most bytes of one row a batched lookup prefetches (8 lines).
const PREFETCH_ROW_BYTES_MAX: usize = 512;

/// Asks the CPU to start loading the cache line at `p`.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod lock_tests {
    use super::*;

    #[test]
    fn a_lock_larger_than_available_memory_is_refused_at_open() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert!(check_lockable("u.qrep", 1 << 30, Some(2 << 30)).is_ok());
        assert!(check_lockable("u.qrep", 1 << 30, None).is_ok(), "unknown: mlock decides");
        let err = check_lockable("u.qrep", 3 << 30, Some(2 << 30)).unwrap_err().to_string();
        assert!(err.contains("u.qrep") && err.contains("MemAvailable") && err.contains("replica_lock"), "{err}");
        assert!(mem_available_bytes().is_some_and(|b| b > 0), "this machine's /proc/meminfo reads");
    }
}
