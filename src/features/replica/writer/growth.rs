//! Growth of a replica file in the background, for the refresher: a
//! `quiver-grow` thread rehashes the live rows into a file twice the size
//! while the writer keeps applying the stream, then the writer replays the
//! keys it changed meanwhile a time slice per poll and swaps the copy in.
//! Split from the writer because only the refresher's writers use it
//! (one-off builds grow on the writer's thread, in `ReplicaWriter::grow`).

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{unmap_later, ReplicaWriter};
use crate::features::replica::format::TAG_USED;
use crate::features::replica::table::lower_thread_priority;
use crate::features::replica::{temp_path, Replica, ReplicaError};

/// With growth ahead on, a growth starts in the background once this many
/// quarters of the rows are used: the last quarter takes the inserts that
/// arrive while the copy runs, so the writer does not wait for it.
pub(super) const GROW_AHEAD_QUARTERS: u64 = 3;

/// Time a poll spends replaying noted keys into a finished growth's copy,
/// at least: as long as the writer spent on everything else since the last
/// poll, within [`REPLAY_BUDGET_MIN`] and [`REPLAY_BUDGET_MAX`]. So the
/// replay gets at least half the refresher's time while it runs however
/// costly the stream's own writes are (with both files written, each can
/// cost a page-cache folio's writeback), and the refresher's pause per
/// round stays bounded. A key costs from a microsecond to tens of them, or
/// a disk read where the files do not fit in memory: the bound is on time,
/// not keys.
const REPLAY_BUDGET_MIN: std::time::Duration = std::time::Duration::from_millis(10);
const REPLAY_BUDGET_MAX: std::time::Duration = std::time::Duration::from_millis(250);

/// Keys replayed between two looks at the clock; also the least a poll
/// replays, so that a replay always moves on.
const REPLAY_KEYS_PER_CLOCK_READ: usize = 8;

/// A growth of the file in the background. A thread rehashes the live rows
/// into a file twice the size while the writer keeps applying changes to
/// the current file and notes every key it changes. Once the copy is done,
/// every change goes to both files, and the keys noted during the copy are
/// replayed into the new one a slice per poll; when none is left, the new
/// file is swapped in. The copy may be stale anywhere; the replay and the
/// writes to both make it current, so nothing is lost.
pub(super) struct Growth {
    /// Until the copy is collected.
    thread: Option<std::thread::JoinHandle<Result<ReplicaWriter, ReplicaError>>>,
    /// The copy, once collected: written alongside the current file.
    pub(super) copy: Option<ReplicaWriter>,
    /// Keys changed while the copy ran. Bounded by the keys the file can
    /// hold: a key is noted once however often it changes.
    pub(super) touched: std::collections::HashSet<u64>,
    /// Those keys, once the copy is collected, still to replay.
    pending: Vec<u64>,
    /// The copy's file, created on the writer's thread before the copy
    /// starts, so that an abandoned growth can remove it at once.
    tmp: PathBuf,
    /// Set when the growth is abandoned: the thread stops copying.
    cancel: Arc<AtomicBool>,
    /// When the last poll that replayed returned.
    last_poll: Option<std::time::Instant>,
    started: std::time::Instant,
}

impl Growth {
    /// Drops a growth that will not be swapped in (its file was replaced
    /// under it, by a full resync): removes the copy's file now, stops the
    /// copy, and leaves the unmapping of the copy to another thread, so the
    /// writer neither waits for the copy nor frees its pages itself.
    pub(super) fn abandon(self, path: &Path) {
        self.cancel.store(true, Ordering::Relaxed);
        // The copy's mapping holds the inode open: the unlink is cheap, and
        // its pages are freed by whichever thread drops the mapping last.
        if let Err(e) = std::fs::remove_file(&self.tmp) {
            tracing::warn!(path = %self.tmp.display(), "could not remove an abandoned growth's copy: {e}");
        }
        if let Some(copy) = self.copy {
            unmap_later(copy.table.clone());
        }
        // A running thread is detached: it sees `cancel`, and its result,
        // with the copy's mapping, is dropped on its own thread.
        tracing::info!(path = %path.display(), "replica growth abandoned: the file was replaced");
    }
}

/// Where a background growth stands ([`ReplicaWriter::growth_phase`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrowthPhase {
    /// The `quiver-grow` thread copies the live rows (or has just finished
    /// and the next poll collects the copy).
    Copying,
    /// The copy is collected; these noted keys are still to replay before
    /// the swap.
    Replaying { keys_left: usize },
}

impl ReplicaWriter {
    /// Starts growing in the background (see [`Growth`]), with room in the
    /// new file for the inserts the current file can still take meanwhile.
    pub(super) fn start_growth(&mut self) -> Result<(), ReplicaError> {
        let spare = self.table.header().row_capacity - self.rows_used;
        let capacity = self.grown_capacity(spare)?;
        let tmp = temp_path(&self.path, "grow");
        let fresh = self.create_grown(&tmp, capacity)?;
        let old = self.table.clone();
        // Every change after this position is noted, then replayed: the
        // copy's rows hold at least what the stream had reached here.
        let from = self.cursor;
        let cancel = Arc::new(AtomicBool::new(false));
        let cancelled = cancel.clone();
        let thread = std::thread::Builder::new()
            .name("quiver-grow".into())
            .spawn(move || {
                lower_thread_priority();
                let mut fresh = fresh;
                copy_rows(&old, &mut fresh, Some(&cancelled))?;
                if !cancelled.load(Ordering::Relaxed) {
                    // Flushes the copy, off the writer's thread, and names the
                    // position its rows are complete to: after a crash, a
                    // swapped in copy replays the stream from there.
                    fresh.checkpoint(from)?;
                }
                Ok(fresh)
            })
            .map_err(|source| ReplicaError::Io { path: "quiver-grow thread".into(), source })?;
        tracing::info!(path = %self.path.display(), rows = self.live, capacity, "replica growth started in the background");
        self.growth = Some(Box::new(Growth {
            thread: Some(thread),
            copy: None,
            touched: std::collections::HashSet::new(),
            pending: Vec::new(),
            tmp,
            cancel,
            last_poll: None,
            started: std::time::Instant::now(),
        }));
        Ok(())
    }

    /// Takes the finished copy from the growth thread (waiting for it) and
    /// turns the keys noted meanwhile into the replay list.
    fn collect_copy(&mut self) -> Result<(), ReplicaError> {
        let growth = self.growth.as_mut().expect("a growth is running");
        let Some(thread) = growth.thread.take() else { return Ok(()) };
        match thread.join() {
            Ok(Ok(copy)) => {
                growth.copy = Some(copy);
                growth.pending = growth.touched.drain().collect();
                Ok(())
            }
            Ok(Err(e)) => {
                self.growth = None;
                Err(e)
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Replays noted keys from the current file into the copy, until
    /// `budget` has passed (`None`: all of them); true when none is left.
    fn replay(&mut self, budget: Option<std::time::Duration>) -> Result<bool, ReplicaError> {
        let started = std::time::Instant::now();
        let growth = self.growth.as_mut().expect("a growth is running");
        let copy = growth.copy.as_mut().expect("the copy is collected");
        // Not `self.payload`: an upsert that waits for the growth holds it.
        let mut payload = vec![0u32; self.table.layout().row_words()];
        for i in 0.. {
            if i % REPLAY_KEYS_PER_CLOCK_READ == 0 && i > 0 && budget.is_some_and(|b| started.elapsed() >= b) {
                break;
            }
            let Some(key) = growth.pending.pop() else { break };
            match self.table.find(key) {
                Some(row) => {
                    let copied = self.table.verify_row(row, &mut payload);
                    assert!(copied.is_some_and(|(k, _)| k == key), "the writer's own rows are never busy");
                    copy.put_words(key, &payload)?;
                }
                None => {
                    copy.delete(key);
                }
            }
        }
        Ok(growth.pending.is_empty())
    }

    /// Swaps in the copy of a growth with nothing left to replay. The copy
    /// is not flushed here (its rows were, by the growth thread, and its
    /// record names the position they are complete to); the next checkpoint
    /// flushes what the replay wrote.
    fn swap_growth(&mut self) -> Result<(), ReplicaError> {
        let growth = self.growth.take().expect("a growth is running");
        assert!(growth.pending.is_empty() && growth.thread.is_none());
        let mut copy = growth.copy.expect("the copy is collected");
        assert_eq!(copy.live, self.live, "the copy holds every live key");
        copy.set_cursor(self.cursor);
        tracing::info!(
            path = %self.path.display(), rows = self.live, capacity = copy.table.header().row_capacity,
            ms = growth.started.elapsed().as_millis() as u64, "replica grown in the background"
        );
        self.replace_with(copy, false)
    }

    /// Finishes a running growth now, waiting for its copy and replaying
    /// every noted key: for an insert that finds the current file full.
    pub(super) fn finish_growth(&mut self) -> Result<(), ReplicaError> {
        self.collect_copy()?;
        self.replay(None)?;
        self.swap_growth()
    }

    /// With `on`, the writer grows its file in the background once three
    /// quarters of its rows are used, instead of rehashing it on the
    /// writer's thread when it is full; [`ReplicaWriter::poll_growth`] must
    /// then be called between changes. The refresher turns it on; one-off
    /// builds and copies, sized for what they hold, leave it off.
    pub fn set_grow_ahead(&mut self, on: bool) {
        self.grow_ahead = on;
    }

    /// Whether a background growth is running.
    pub fn growing(&self) -> bool {
        self.growth.is_some()
    }

    /// Where a background growth stands, if one runs.
    pub fn growth_phase(&self) -> Option<GrowthPhase> {
        let growth = self.growth.as_ref()?;
        Some(match growth.thread {
            Some(_) => GrowthPhase::Copying,
            None => GrowthPhase::Replaying { keys_left: growth.pending.len() },
        })
    }

    /// Moves a background growth on by a bounded step: starts one if due,
    /// collects a finished copy, replays noted keys into it for a bounded
    /// time (see [`REPLAY_BUDGET_MIN`]), and swaps it in when none is left. Returns
    /// whether a grown file was swapped in by this call (it then wants a
    /// checkpoint).
    pub fn poll_growth(&mut self) -> Result<bool, ReplicaError> {
        self.poll_growth_within(REPLAY_BUDGET_MAX)
    }

    /// [`poll_growth`](Self::poll_growth), replaying for at most
    /// `replay_max`: with zero, only the first few keys, however fast the
    /// machine (tests hold a growth in its replay this way).
    pub(crate) fn poll_growth_within(&mut self, replay_max: std::time::Duration) -> Result<bool, ReplicaError> {
        if self.scan_pending || !self.grow_ahead {
            return Ok(false);
        }
        let Some(growth) = &self.growth else {
            if self.rows_used >= self.table.header().row_capacity / 4 * GROW_AHEAD_QUARTERS {
                self.start_growth()?;
            }
            return Ok(false);
        };
        if growth.thread.as_ref().is_some_and(|t| !t.is_finished()) {
            return Ok(false);
        }
        let since_last_poll = growth.last_poll.map_or(REPLAY_BUDGET_MIN, |t| t.elapsed());
        self.collect_copy()?;
        if !self.replay(Some(since_last_poll.clamp(REPLAY_BUDGET_MIN, REPLAY_BUDGET_MAX).min(replay_max)))? {
            self.growth.as_mut().expect("a growth is running").last_poll = Some(std::time::Instant::now());
            return Ok(false);
        }
        self.swap_growth()?;
        Ok(true)
    }
}

/// Copies `old`'s live rows into `fresh`. With `cancel` (a background
/// growth), the writer may be changing `old` meanwhile: rows are copied
/// under their seqlock, a row that stays busy is left to the replay of
/// touched keys, and the copy stops early once `cancel` is set; without it,
/// nothing else writes `old` and every live row is copied.
///
/// In the background, the copied rows are also written back to disk as
/// they are completed (see [`RowWriteback`]).
pub(super) fn copy_rows(
    old: &Replica,
    fresh: &mut ReplicaWriter,
    cancel: Option<&AtomicBool>,
) -> Result<(), ReplicaError> {
    /// Slots between two looks at `cancel` and at the rows to write back.
    const CHECK_SLOTS: u64 = 1 << 16;
    let mut payload = vec![0u32; old.layout().row_words()];
    let mut writeback = RowWriteback::new(fresh);
    for slot in 0..old.header().slot_count {
        if slot % CHECK_SLOTS == 0 && cancel.is_some() {
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Ok(());
            }
            writeback.advance(fresh)?;
        }
        let (k, r, tag) = old.slot(slot);
        if tag.load(Ordering::Acquire) != TAG_USED {
            continue;
        }
        let key = k.load(Ordering::Relaxed);
        match old.verify_row(r.load(Ordering::Relaxed), &mut payload) {
            Some((row_key, _)) if row_key == key => fresh.put_words(key, &payload)?,
            _ => assert!(cancel.is_some(), "a row nobody writes is never busy"),
        }
    }
    Ok(())
}

/// Writes a growth's copied rows back to disk while the copy runs, a
/// chunk at a time behind the copy's cursor, so that the copy never holds
/// more than two chunks of dirty rows. Left to the kernel, a copy of
/// gigabytes is all dirty at once, past the kernel's dirty limits, and the
/// kernel then throttles every thread that dirties a page: the refresher's
/// next write to the current file stalls for hundreds of milliseconds.
/// (The slots, written all over their region, stay dirty until the copy's
/// checkpoint: they are a small part of the file.)
struct RowWriteback {
    /// File offset up to which the rows were handed to the disk.
    started_to: u64,
    /// File offset up to which the disk has taken them.
    done_to: u64,
}

impl RowWriteback {
    /// Bytes of rows written back at a time.
    const CHUNK_BYTES: u64 = 64 << 20;

    fn new(fresh: &ReplicaWriter) -> RowWriteback {
        let rows_offset = fresh.table.layout().rows_offset as u64;
        RowWriteback { started_to: rows_offset, done_to: rows_offset }
    }

    /// Starts the writeback of the next chunk once the copy has completed
    /// it, after waiting for the chunk before (so it is already written,
    /// and the wait is short).
    fn advance(&mut self, fresh: &ReplicaWriter) -> Result<(), ReplicaError> {
        let layout = fresh.table.layout();
        let copied_to = (layout.rows_offset + fresh.rows_used as usize * layout.row_stride) as u64;
        if copied_to < self.started_to + Self::CHUNK_BYTES {
            return Ok(());
        }
        let fd = fresh._lock.as_raw_fd();
        let io = |source| ReplicaError::Io { path: fresh.path.display().to_string(), source };
        let (done_to, started_to) = (self.started_to, copied_to);
        // SAFETY: sync_file_range on a descriptor this writer owns only
        // writes the file's own page cache back; no memory is touched.
        let wait = unsafe {
            libc::sync_file_range(
                fd,
                self.done_to as i64,
                (done_to - self.done_to) as i64,
                libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER,
            )
        };
        if wait != 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        // SAFETY: as above.
        let start = unsafe {
            libc::sync_file_range(fd, done_to as i64, (started_to - done_to) as i64, libc::SYNC_FILE_RANGE_WRITE)
        };
        if start != 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        (self.done_to, self.started_to) = (done_to, started_to);
        Ok(())
    }
}
