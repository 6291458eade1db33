//! The refresher: one thread, off the shards, that keeps every feature
//! group's replica equal to Redis.
//!
//! Protocol (see the data contract in `contract.rs`): each group has a
//! stream whose entry ids are `{seq}-0` with `seq` dense from an INCR
//! counter, and an epoch string set once when the stream is first written.
//! The replica records `(epoch, seq)` of the last change it holds.
//!
//! - Incremental: `XREAD BLOCK` from `{seq}-0` on all groups' streams at
//!   once; each entry must carry exactly `seq + 1`. Entries are applied to the
//!   replica in order; a checkpoint (rows flushed, then the cursor) follows at
//!   most every `checkpoint_interval_ms`. After a disconnect the next session
//!   resumes from the cursor; replaying an entry twice is harmless because
//!   every entry carries a whole value.
//! - Full resync when the cursor cannot be continued: a different epoch (the
//!   data was replaced), a counter below the cursor (the data went back), or
//!   a gap (the stream was trimmed past the cursor, or deleted). It notes the
//!   counter first, copies every `{group}:*` key with SCAN + MGET into a fresh
//!   file (over `sync_connections` connections: this thread's one SCANs, and
//!   the copy's fetcher threads MGET on their own while this thread inserts),
//!   checkpoints it at the noted counter and swaps it in; the stream
//!   entries written meanwhile are then replayed by the incremental loop, so
//!   nothing written during the copy is lost.
//! - A resync is taken only from a settled source, and never silently
//!   shrinks the replica. A copy during which the epoch changed, the counter
//!   went back, or the stream lost the entry the replay needs is thrown away
//!   and made again after a back-off; so is one during which the counter
//!   moved, unless the copy before it had the same number of rows (within
//!   `resync_rows_drift_max`): a source that is busy but keeps its size is
//!   being written, one that grows between copies is being reloaded. The
//!   group keeps its last-known-good rows meanwhile. A settled copy that would drop
//!   more than `resync_shrink_max` of the rows (Redis restarted empty, a
//!   FLUSHALL) is held: not swapped in, reported, responses flagged stale,
//!   until the source comes back or an operator accepts it.
//! - Bad data (a key that is not `{group}:{u64}`, a value of the wrong
//!   length, a non-string key, a malformed stream entry) is skipped, counted
//!   and logged with the key; the refresh goes on.
//! - Failures: reconnects with capped exponential backoff and jitter; after
//!   `breaker_failures` consecutive failures the breaker is open (exported)
//!   and the thread keeps probing at the capped interval. Shards never wait:
//!   they keep reading the replica, and staleness grows.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::config::FeedConfig;
use super::contract;
use super::resp::{RedisConfig, RedisConn, Reply};
use super::status::{FeedStatus, GroupStatus};
use super::sync::{
    entity, full_sync, parse_id, position, shape, skip, stream_first_from, unsettled, RefreshError, SyncTarget,
};
use crate::deadline::{Clock, MonotonicClock};
use crate::replica::{Cursor, GrowthPhase, Replica, ReplicaWriter, Storage};

/// How long one XREAD waits while a growth replays (see `session`).
const REPLAY_BLOCK_MS: u64 = 1;

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One group's writer and where its stream is read from; `groups[i]`
/// reports through `status.groups[i]`.
struct Group {
    name: String,
    writer: ReplicaWriter,
    storage: Storage,
    /// Last stream id consumed (applied or skipped); XREAD continues after it.
    read_id: (u64, u64),
    unflushed: bool,
    last_checkpoint_ns: u64,
    state: State,
    /// An operator accepted a held resync that had no copy to swap in: the
    /// next settled copy is taken whatever its size.
    accept_unguarded: bool,
}

/// Where a group stands with Redis.
enum State {
    /// Following the stream.
    Following,
    /// A copy found the source moving; another starts at `at_ns`.
    Settling { at_ns: u64, attempt: u32, last_rows: u64 },
    /// A settled copy would have shrunk the replica past the bound. The copy
    /// (absent while a new one is made or after a failed one) waits here,
    /// with the position Redis had when it began, for the source to move or
    /// an operator to accept it; the replica serves its last-known-good rows.
    Held { copy: Option<ReplicaWriter>, position: (u64, u64) },
}

/// Why the incremental loop must stop for one group.
enum Needs {
    Nothing,
    /// An entry whose sequence number skips past the cursor's successor.
    Gap {
        cursor_seq: u64,
        entry_seq: u64,
    },
}

/// The refresher thread's state.
pub struct Refresher {
    config: FeedConfig,
    redis: RedisConfig,
    groups: Vec<Group>,
    status: Arc<FeedStatus>,
    clock: MonotonicClock,
    /// Checkpoints go to the flusher thread: their msync takes milliseconds,
    /// and the refresher must keep applying changes meanwhile.
    flusher: Option<Flusher>,
}

/// The channel to the flusher thread, and the thread.
type Flusher = (std::sync::mpsc::SyncSender<(Arc<Replica>, Cursor)>, JoinHandle<()>);

/// Writes checkpoints handed over by the refresher until the channel closes.
fn spawn_flusher(groups: usize) -> std::io::Result<Flusher> {
    // One pending checkpoint per group: a newer one waits for the next interval.
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Arc<Replica>, Cursor)>(groups.max(1));
    let thread = std::thread::Builder::new().name("quiver-flush".into()).spawn(move || {
        for (table, cursor) in rx {
            if let Err(e) = table.write_checkpoint(cursor) {
                tracing::error!(path = table.path(), "checkpoint failed: {e}");
            }
        }
    })?;
    Ok((tx, thread))
}

impl Refresher {
    /// `writers` are opened (or freshly created) replicas, one per group, in
    /// the order of `status.groups`.
    pub fn new(
        config: FeedConfig,
        writers: Vec<ReplicaWriter>,
        status: Arc<FeedStatus>,
    ) -> Result<Refresher, RefreshError> {
        let redis = RedisConfig::from_url(&config.redis).map_err(|e| RefreshError::Url(e.to_string()))?;
        let clock = MonotonicClock::new();
        let groups = writers
            .into_iter()
            .enumerate()
            .map(|(i, mut writer)| {
                // Growth copies in the background while the stream is applied.
                writer.set_grow_ahead(true);
                let s = &status.groups[i];
                let name = s.name.clone();
                let cursor = writer.cursor();
                s.applied_seq.store(cursor.seq, Ordering::Relaxed);
                s.change_unix_ms.store(cursor.change_unix_ms, Ordering::Relaxed);
                s.live_rows.store(writer.live_rows(), Ordering::Relaxed);
                s.verifying.store(writer.scan_pending(), Ordering::Relaxed);
                Group {
                    storage: config.storage(&name),
                    name,
                    writer,
                    read_id: (cursor.seq, 0),
                    unflushed: false,
                    last_checkpoint_ns: 0,
                    state: State::Following,
                    accept_unguarded: false,
                }
            })
            .collect();
        Ok(Refresher { config, redis, groups, status, clock, flusher: None })
    }

    fn connect(&self) -> Result<RedisConn, RefreshError> {
        let mut conn = RedisConn::connect(&self.redis)?;
        conn.set_read_timeout_ms(self.config.block_ms + self.redis.io_timeout_ms)?;
        Ok(conn)
    }

    /// Brings the named groups up to date before serving starts: used when a
    /// group had no usable replica file. Bounded by `initial_sync_timeout_ms`.
    pub fn initial_sync(&mut self, names: &[String]) -> Result<(), RefreshError> {
        let started = self.clock.now_ns();
        let bound_ns = self.config.initial_sync_timeout_ms * 1_000_000;
        let mut backoff = Backoff::new(self.config.backoff_ms_min, self.config.backoff_ms_max);
        for i in 0..self.groups.len() {
            if !names.contains(&self.groups[i].name) {
                continue;
            }
            loop {
                let attempt =
                    self.connect().and_then(|mut conn| self.sync_until_settled(&mut conn, i, started + bound_ns));
                match attempt {
                    Ok(()) => break,
                    Err(e) if self.clock.now_ns() - started > bound_ns => {
                        return Err(RefreshError::InitialSync {
                            group: self.groups[i].name.clone(),
                            why: e.to_string(),
                        })
                    }
                    Err(e) => {
                        tracing::warn!(group = %self.groups[i].name, "initial sync: {e}; retrying");
                        std::thread::sleep(backoff.next());
                    }
                }
            }
        }
        Ok(())
    }

    /// Resyncs group `i`, and again after each back-off while the source is
    /// moving, until a copy is taken or `deadline_ns` passes.
    fn sync_until_settled(&mut self, conn: &mut RedisConn, i: usize, deadline_ns: u64) -> Result<(), RefreshError> {
        loop {
            self.resync(conn, i)?;
            let State::Settling { at_ns, .. } = self.groups[i].state else {
                return Ok(());
            };
            if at_ns > deadline_ns {
                return Err(RefreshError::InitialSync {
                    group: self.groups[i].name.clone(),
                    why: "the source kept changing under every copy".into(),
                });
            }
            // Read the clock once per turn: it may pass `at_ns` between two reads.
            loop {
                let left_ns = at_ns.saturating_sub(self.clock.now_ns());
                if left_ns == 0 {
                    break;
                }
                std::thread::sleep(Duration::from_nanos(left_ns));
            }
        }
    }

    /// Runs the refresher on its own thread until `stop` is set.
    pub fn spawn(mut self, stop: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new().name("quiver-feed".into()).spawn(move || self.run(&stop))
    }

    fn run(&mut self, stop: &AtomicBool) {
        self.finish_opens();
        match spawn_flusher(self.groups.len()) {
            Ok(f) => self.flusher = Some(f),
            Err(e) => tracing::warn!("no flusher thread ({e}): checkpoints run on the refresher"),
        }
        let mut backoff = Backoff::new(self.config.backoff_ms_min, self.config.backoff_ms_max);
        let mut failures = 0u32;
        while !stop.load(Ordering::Relaxed) {
            let result = self.connect().and_then(|mut conn| {
                self.status.connected.store(true, Ordering::Relaxed);
                if failures > 0 {
                    tracing::info!(addr = %self.redis.addr, "redis reachable again");
                }
                failures = 0;
                backoff.reset();
                self.status.breaker_open.store(false, Ordering::Relaxed);
                self.session(&mut conn, stop)
            });
            self.status.connected.store(false, Ordering::Relaxed);
            if let Err(e) = result {
                failures += 1;
                GroupStatus::bump(&self.status.connect_failures_total, 1);
                if failures == 1 {
                    tracing::warn!(addr = %self.redis.addr, "redis: {e}; serving from the replica, reconnecting");
                }
                if failures == self.config.breaker_failures {
                    self.status.breaker_open.store(true, Ordering::Relaxed);
                    tracing::warn!(addr = %self.redis.addr, failures, "redis breaker open: probing at the capped interval");
                }
                let pause = backoff.next();
                let until = self.clock.now_ns() + pause.as_nanos() as u64;
                while !stop.load(Ordering::Relaxed) && self.clock.now_ns() < until {
                    self.take_accepts();
                    std::thread::sleep(Duration::from_millis(10).min(pause));
                }
            }
            self.checkpoint_all(true);
        }
        if let Some((tx, thread)) = self.flusher.take() {
            drop(tx);
            let _ = thread.join();
        }
        self.checkpoint_all(true);
    }

    /// Scans the files opened at start-up without their rows checked, while
    /// shards serve them (checking each row they read). A file that passes
    /// is repaired (rows left mid-write are dropped until the stream replays
    /// them) and followed from its checkpoint; a damaged one is set aside and
    /// copied again from Redis, serving only the rows that pass their CRC
    /// until then. It runs before the first connection: a scan is bounded by
    /// the file's size, and the stream can only be applied after it.
    fn finish_opens(&mut self) {
        for (g, s) in self.groups.iter_mut().zip(&self.status.groups) {
            if !g.writer.scan_pending() {
                continue;
            }
            let started_ns = self.clock.now_ns();
            match g.writer.finish_open() {
                Ok(report) => {
                    if report.torn_rows > 0 {
                        tracing::warn!(
                            group = %g.name, rows = report.torn_rows,
                            "rows were mid-write when the last writer stopped: dropped until the stream replays them"
                        );
                    }
                    s.torn_rows_repaired.store(report.torn_rows, Ordering::Relaxed);
                    s.live_rows.store(report.live_rows, Ordering::Relaxed);
                    tracing::info!(
                        group = %g.name, rows = report.live_rows, seq = report.cursor.seq,
                        ms = (self.clock.now_ns() - started_ns) / 1_000_000,
                        "replica verified: catching up from its checkpoint"
                    );
                }
                Err(e) => {
                    let mut aside = g.writer.path().as_os_str().to_owned();
                    aside.push(".damaged");
                    let moved = std::fs::rename(g.writer.path(), &aside);
                    tracing::error!(
                        group = %g.name, path = %g.writer.path().display(), moved_aside = moved.is_ok(),
                        corrupt_reads = g.writer.table().corrupt_reads(),
                        "replica is damaged ({e}): serving the rows that pass their checksum until a full resync \
                         from redis replaces it"
                    );
                    g.state = State::Settling { at_ns: 0, attempt: 0, last_rows: 0 };
                }
            }
            s.verifying.store(false, Ordering::Relaxed);
        }
    }

    /// Checkpoints groups with unflushed changes: every interval through the
    /// flusher thread, or here and now when `now` (disconnect, shutdown).
    fn checkpoint_all(&mut self, now: bool) {
        let now_ns = self.clock.now_ns();
        let interval = self.config.checkpoint_interval_ms * 1_000_000;
        for g in &mut self.groups {
            if !g.unflushed || (!now && now_ns - g.last_checkpoint_ns < interval) {
                continue;
            }
            let cursor = g.writer.cursor();
            let handed = match (&self.flusher, now) {
                (Some((tx, _)), false) => tx.try_send((g.writer.table().clone(), cursor)).is_ok(),
                _ => match g.writer.checkpoint(cursor) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::error!(group = %g.name, "checkpoint failed: {e}");
                        false
                    }
                },
            };
            if handed {
                g.unflushed = false;
                g.last_checkpoint_ns = now_ns;
            }
        }
    }

    /// One connected session: check every group's position, then follow the
    /// streams until an error or `stop`.
    fn session(&mut self, conn: &mut RedisConn, stop: &AtomicBool) -> Result<(), RefreshError> {
        for i in 0..self.groups.len() {
            self.check(conn, i)?;
        }
        let mut last_check_ns = self.clock.now_ns();
        let check_ns = self.config.check_interval_ms * 1_000_000;
        while !stop.load(Ordering::Relaxed) {
            self.take_accepts();
            self.due_resyncs(conn)?;
            // Only groups following their stream read it; the others are
            // behind, serving what they have, until their copy is taken.
            let following: Vec<usize> =
                (0..self.groups.len()).filter(|&i| matches!(self.groups[i].state, State::Following)).collect();
            let mut behind: Vec<bool> = (0..self.groups.len()).map(|i| !following.contains(&i)).collect();
            // A growth's replay moves on a bounded slice per round: while
            // one runs, a round does not wait long for the stream, so a
            // quiet stream does not stretch the replay over minutes.
            let replaying =
                self.groups.iter().any(|g| matches!(g.writer.growth_phase(), Some(GrowthPhase::Replaying { .. })));
            let block_ms = if replaying { REPLAY_BLOCK_MS.min(self.config.block_ms) } else { self.config.block_ms };
            if following.is_empty() {
                std::thread::sleep(Duration::from_millis(block_ms));
                conn.command(&[b"PING"])?;
            } else {
                let mut args: Vec<Vec<u8>> = vec![
                    b"XREAD".to_vec(),
                    b"COUNT".to_vec(),
                    self.config.batch_entries_max.max(1).to_string().into_bytes(),
                    b"BLOCK".to_vec(),
                    block_ms.to_string().into_bytes(),
                    b"STREAMS".to_vec(),
                ];
                args.extend(following.iter().map(|&i| contract::stream_key(&self.groups[i].name).into_bytes()));
                args.extend(following.iter().map(|&i| {
                    let id = self.groups[i].read_id;
                    format!("{}-{}", id.0, id.1).into_bytes()
                }));
                let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
                let reply = conn.command(&refs)?;
                if let Reply::Array(streams) = reply {
                    for stream in streams {
                        let mut parts = stream.into_array().ok_or_else(|| shape("XREAD", "stream is not an array"))?;
                        let entries =
                            parts.pop().and_then(Reply::into_array).ok_or_else(|| shape("XREAD", "no entries"))?;
                        let name =
                            parts.pop().and_then(Reply::into_bytes).ok_or_else(|| shape("XREAD", "no stream name"))?;
                        let Some(&i) =
                            following.iter().find(|&&i| contract::stream_key(&self.groups[i].name).as_bytes() == name)
                        else {
                            return Err(shape("XREAD", "a stream that was not asked for"));
                        };
                        behind[i] = entries.len() >= self.config.batch_entries_max;
                        if let Needs::Gap { cursor_seq, entry_seq } = self.apply(i, entries)? {
                            self.gap(conn, i, cursor_seq, entry_seq)?;
                            behind[i] = true;
                        }
                    }
                }
            }
            for g in &mut self.groups {
                // A grown file swapped in names an older position until checkpointed.
                g.unflushed |= g.writer.poll_growth()?;
            }
            let now = self.clock.now_ns();
            for (s, behind) in self.status.groups.iter().zip(behind) {
                s.contact_ns.store(now, Ordering::Relaxed);
                if !behind {
                    s.caught_up_ns.store(now, Ordering::Relaxed);
                }
            }
            self.checkpoint_all(false);
            if self.clock.now_ns() - last_check_ns >= check_ns {
                for i in 0..self.groups.len() {
                    self.check(conn, i)?;
                }
                last_check_ns = self.clock.now_ns();
            }
        }
        Ok(())
    }

    /// Why group `i`'s replica cannot continue from its own cursor with what
    /// Redis holds now, if it cannot.
    fn cannot_continue(&self, conn: &mut RedisConn, i: usize) -> Result<Option<String>, RefreshError> {
        let g = &self.groups[i];
        let cursor = g.writer.cursor();
        let (epoch, seq) = position(conn, &g.name)?;
        Ok(if g.writer.table().storage() != g.storage {
            Some(format!("stored as {:?}, configured as {:?}", g.writer.table().storage(), g.storage))
        } else if epoch != cursor.epoch {
            Some(format!("epoch {epoch} in redis, {} in the replica", cursor.epoch))
        } else if seq < cursor.seq {
            Some(format!("redis counter {seq} is behind the replica's {}", cursor.seq))
        } else if seq > cursor.seq {
            // The next entry must still be in the stream.
            match stream_first_from(conn, &g.name, cursor.seq + 1)? {
                Some((s, 0)) if s == cursor.seq + 1 => None,
                Some((s, _)) => Some(format!("stream starts at {s}, the replica needs {}", cursor.seq + 1)),
                None => Some(format!("stream is missing entries after {}", cursor.seq)),
            }
        } else {
            None
        })
    }

    /// Compares the group's cursor with Redis and resyncs if it cannot be
    /// continued. A held group is released when Redis is back at the
    /// replica's position, and copied again when Redis moved since its copy.
    fn check(&mut self, conn: &mut RedisConn, i: usize) -> Result<(), RefreshError> {
        match self.groups[i].state {
            // Its back-off timer brings it back (`due_resyncs`).
            State::Settling { .. } => Ok(()),
            State::Held { position: held_at, .. } => {
                if self.cannot_continue(conn, i)?.is_none() {
                    self.release(i);
                    return Ok(());
                }
                let now_at = position(conn, &self.groups[i].name)?;
                if now_at != held_at {
                    tracing::info!(
                        group = %self.groups[i].name, epoch = now_at.0, seq = now_at.1,
                        "redis changed while a resync was held: copying again"
                    );
                    self.resync(conn, i)?;
                }
                Ok(())
            }
            State::Following => {
                if let Some(why) = self.cannot_continue(conn, i)? {
                    tracing::warn!(group = %self.groups[i].name, "{why}: full resync");
                    self.resync(conn, i)?;
                }
                Ok(())
            }
        }
    }

    /// Redis came back to where the replica is (restored from a backup, for
    /// one): the held copy is dropped and the group follows its stream again.
    fn release(&mut self, i: usize) {
        let g = &mut self.groups[i];
        if let State::Held { copy: Some(copy), .. } = std::mem::replace(&mut g.state, State::Following) {
            copy.discard();
        }
        let s = &self.status.groups[i];
        s.resync_held.store(false, Ordering::Relaxed);
        s.held_rows.store(0, Ordering::Relaxed);
        tracing::warn!(
            group = %g.name, rows = g.writer.live_rows(),
            "redis is back at the replica's position: held resync released, following the stream"
        );
    }

    /// Starts the copies whose back-off has passed.
    fn due_resyncs(&mut self, conn: &mut RedisConn) -> Result<(), RefreshError> {
        for i in 0..self.groups.len() {
            if let State::Settling { at_ns, .. } = self.groups[i].state {
                if self.clock.now_ns() >= at_ns {
                    self.resync(conn, i)?;
                }
            }
        }
        Ok(())
    }

    /// Acts on accepts the admin endpoint asked for: a held copy is swapped
    /// in; a hold without a copy takes its next copy whatever its size.
    fn take_accepts(&mut self) {
        for i in 0..self.groups.len() {
            if !self.status.groups[i].accept_requested.swap(false, Ordering::AcqRel) {
                continue;
            }
            let started = self.clock.now_ns();
            let g = &mut self.groups[i];
            // Whether the next copy is to be taken whatever its size, now.
            let copy_unguarded = match std::mem::replace(&mut g.state, State::Following) {
                State::Held { copy: Some(copy), .. } => {
                    let (before, after) = (g.writer.live_rows(), copy.live_rows());
                    tracing::warn!(group = %g.name, rows = after, replaced_rows = before, "held resync accepted by an operator");
                    match self.swap_in(i, copy, started) {
                        Ok(()) => false,
                        Err(e) => {
                            tracing::error!(group = %self.groups[i].name, "accepted resync failed to swap in: {e}; copying again");
                            true
                        }
                    }
                }
                State::Held { copy: None, .. } => {
                    tracing::warn!(
                        group = %g.name,
                        "held resync accepted by an operator: the next copy from redis is taken whatever its size"
                    );
                    true
                }
                other => {
                    tracing::info!(group = %g.name, "accept asked for with no resync held: nothing to do");
                    g.state = other;
                    false
                }
            };
            if copy_unguarded {
                self.groups[i].accept_unguarded = true;
                self.groups[i].state = State::Settling { at_ns: 0, attempt: 0, last_rows: 0 };
            }
            GroupStatus::bump(&self.status.groups[i].accepts_total, 1);
        }
    }

    /// An entry skipped past the cursor: either the stream lost entries the
    /// replica needs (resync), or the entry was not written by the contract's
    /// script, since its number is beyond the counter (skip it).
    fn gap(&mut self, conn: &mut RedisConn, i: usize, cursor_seq: u64, entry_seq: u64) -> Result<(), RefreshError> {
        let (_, counter) = position(conn, &self.groups[i].name)?;
        let g = &mut self.groups[i];
        if entry_seq > counter {
            g.read_id = (entry_seq, 0);
            let why =
                format!("stream entry {entry_seq}-0 is beyond the counter {counter}: not written by the contract");
            skip(Some(&self.status.groups[i]), &g.name, &why);
            return Ok(());
        }
        tracing::warn!(group = %g.name, cursor_seq, entry_seq, "gap in the stream: full resync");
        self.resync(conn, i)
    }

    /// Copies Redis for group `i` and swaps the copy in, unless the source
    /// moved under it (the group settles and copies again later) or the copy
    /// would shrink the replica past `resync_shrink_max` (the copy is held).
    fn resync(&mut self, conn: &mut RedisConn, i: usize) -> Result<(), RefreshError> {
        let (attempt, last_rows) = match self.groups[i].state {
            State::Settling { attempt, last_rows, .. } => (attempt, (attempt > 0).then_some(last_rows)),
            _ => (0, None),
        };
        // A held copy lives at the temporary path this copy writes: drop it
        // first. The group stays held (serving its rows) until this resolves.
        if let State::Held { copy, .. } = &mut self.groups[i].state {
            if let Some(c) = copy.take() {
                c.discard();
            }
        }
        let started = self.clock.now_ns();
        let fresh = {
            let g = &self.groups[i];
            let default = g.writer.table().default_vector();
            let target = SyncTarget {
                group: &g.name,
                path: g.writer.path(),
                dim: g.writer.table().dim(),
                storage: g.storage,
                default: &default,
                batch_keys_max: self.config.sync_batch_keys_max,
                connections: self.config.sync_connections,
            };
            full_sync(conn, &self.redis, &target, Some(&self.status.groups[i]), &mut |_| {})?
        };
        let noted = (fresh.cursor().epoch, fresh.cursor().seq);
        let copied = fresh.live_rows();
        let name = self.groups[i].name.clone();
        let s = &self.status.groups[i];
        if let Some(why) = unsettled(conn, &name, noted, copied, last_rows, self.config.resync_rows_drift_max)? {
            if attempt + 1 < self.config.resync_attempts_max {
                fresh.discard();
                GroupStatus::bump(&s.resync_restarts_total, 1);
                let pause_ms =
                    (self.config.backoff_ms_min.max(1) << attempt.min(16)).min(self.config.backoff_ms_max.max(1));
                tracing::warn!(group = %name, attempt = attempt + 1, "{why}: redis is being written or reloaded; copying again in {pause_ms} ms");
                if !matches!(self.groups[i].state, State::Held { .. }) {
                    self.groups[i].state = State::Settling {
                        at_ns: self.clock.now_ns() + pause_ms * 1_000_000,
                        attempt: attempt + 1,
                        last_rows: copied,
                    };
                } else {
                    // Held groups copy again when Redis moves (`check`); the
                    // back-off is the check interval.
                    self.groups[i].state = State::Held { copy: None, position: noted };
                }
                return Ok(());
            }
            tracing::warn!(group = %name, "{why}, after {} copies: taking the last one; the stream replay brings it up to date", attempt + 1);
        }
        let current = self.groups[i].writer.live_rows();
        let shrink_max = self.config.resync_shrink_max(&name);
        let dropped = current.saturating_sub(copied);
        let unguarded = std::mem::take(&mut self.groups[i].accept_unguarded);
        if !unguarded && dropped as f64 > shrink_max * current as f64 {
            tracing::warn!(
                group = %name, rows = current, copy_rows = copied, epoch = noted.0, seq = noted.1,
                "a full resync would drop {dropped} of {current} rows (more than resync_shrink_max {shrink_max}): held; \
                 serving the last-known-good rows, flagged stale, until redis recovers or POST /replica/{name}/accept"
            );
            s.resync_held.store(true, Ordering::Relaxed);
            s.held_rows.store(copied, Ordering::Relaxed);
            self.groups[i].state = State::Held { copy: Some(fresh), position: noted };
            return Ok(());
        }
        self.swap_in(i, fresh, started)
    }

    /// Makes `fresh` group `i`'s replica; the group follows its stream from
    /// the copy's position.
    fn swap_in(&mut self, i: usize, fresh: ReplicaWriter, started_ns: u64) -> Result<(), RefreshError> {
        let g = &mut self.groups[i];
        let s = &self.status.groups[i];
        g.writer.replace(fresh)?;
        g.state = State::Following;
        let cursor = g.writer.cursor();
        g.read_id = (cursor.seq, 0);
        g.unflushed = false;
        g.last_checkpoint_ns = self.clock.now_ns();
        s.applied_seq.store(cursor.seq, Ordering::Relaxed);
        s.live_rows.store(g.writer.live_rows(), Ordering::Relaxed);
        s.resync_held.store(false, Ordering::Relaxed);
        s.held_rows.store(0, Ordering::Relaxed);
        GroupStatus::bump(&s.resyncs_total, 1);
        tracing::info!(
            group = %g.name, rows = g.writer.live_rows(), seq = cursor.seq,
            ms = (self.clock.now_ns() - started_ns) / 1_000_000, "full sync done"
        );
        Ok(())
    }

    /// Applies stream entries to group `i` in order.
    fn apply(&mut self, i: usize, entries: Vec<Reply>) -> Result<Needs, RefreshError> {
        let g = &mut self.groups[i];
        let s = &self.status.groups[i];
        for entry in entries {
            let mut parts = entry.into_array().ok_or_else(|| shape("XREAD", "entry is not an array"))?.into_iter();
            let id = parts.next().and_then(Reply::into_bytes).and_then(|b| parse_id(&b));
            let fields = parts.next().and_then(Reply::into_array).unwrap_or_default();
            let Some(id) = id else {
                return Err(shape("XREAD", "entry without a valid id"));
            };
            let mut cursor = g.writer.cursor();
            if id.1 != 0 || id.0 <= cursor.seq {
                // Not written by the contract's script: its ids are `{seq}-0`.
                g.read_id = id;
                skip(Some(s), &g.name, &format!("stream entry {}-{} has no contract sequence number", id.0, id.1));
                continue;
            }
            if id.0 != cursor.seq + 1 {
                return Ok(Needs::Gap { cursor_seq: cursor.seq, entry_seq: id.0 });
            }
            g.read_id = id;
            cursor.seq = id.0;
            match change(&g.name, &fields, g.writer.table().dim()) {
                Ok((id, Some(v), t)) => {
                    g.writer.upsert(id, &v)?;
                    cursor.change_unix_ms = t;
                }
                Ok((id, None, t)) => {
                    g.writer.delete(id);
                    cursor.change_unix_ms = t;
                }
                Err(why) => skip(Some(s), &g.name, &format!("stream entry {}: {why}", cursor.seq)),
            }
            g.writer.set_cursor(cursor);
            g.unflushed = true;
            s.applied_seq.store(cursor.seq, Ordering::Relaxed);
            s.change_unix_ms.store(cursor.change_unix_ms, Ordering::Relaxed);
            GroupStatus::bump(&s.applied_total, 1);
        }
        s.live_rows.store(g.writer.live_rows(), Ordering::Relaxed);
        Ok(Needs::Nothing)
    }
}

/// Decodes a stream entry's fields: `k <key> v <bytes> t <ms>` for a put,
/// `k <key> d 1 t <ms>` for a delete.
fn change(group: &str, fields: &[Reply], dim: usize) -> Result<(u64, Option<Vec<f32>>, u64), String> {
    let mut key = None;
    let mut value = None;
    let mut deleted = false;
    let mut t = 0;
    for pair in fields.chunks(2) {
        let (Some(f), Some(v)) = (pair[0].as_bytes(), pair.get(1).and_then(Reply::as_bytes)) else {
            return Err("fields are not name/value strings".into());
        };
        match f {
            b"k" => key = Some(v),
            b"v" => value = Some(v),
            b"d" => deleted = true,
            b"t" => t = std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()).unwrap_or(0),
            _ => {}
        }
    }
    let key = key.ok_or("no key field 'k'")?;
    match (value, deleted) {
        (Some(bytes), false) => entity(group, key, bytes, dim).map(|(id, v)| (id, Some(v), t)),
        (None, true) => contract::parse_entity_key(group, key)
            .map(|id| (id, None, t))
            .ok_or_else(|| format!("key {} is not {group}:<u64>", String::from_utf8_lossy(key))),
        _ => Err(format!("key {}: neither a value 'v' nor a delete 'd'", String::from_utf8_lossy(key))),
    }
}

/// Capped exponential backoff with jitter, so that many servers losing the
/// same Redis do not reconnect in lockstep.
struct Backoff {
    min_ms: u64,
    max_ms: u64,
    next_ms: u64,
    rng: u64,
}

impl Backoff {
    fn new(min_ms: u64, max_ms: u64) -> Backoff {
        let seed = unix_ms() ^ u64::from(std::process::id()).rotate_left(32);
        Backoff { min_ms: min_ms.max(1), max_ms: max_ms.max(min_ms.max(1)), next_ms: min_ms.max(1), rng: seed | 1 }
    }

    fn reset(&mut self) {
        self.next_ms = self.min_ms;
    }

    /// A pause drawn uniformly from [next/2, next], then doubles next.
    fn next(&mut self) -> Duration {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let half = self.next_ms / 2;
        let ms = half + self.rng % (self.next_ms - half + 1);
        self.next_ms = (self.next_ms * 2).min(self.max_ms);
        Duration::from_millis(ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_jitter_and_resets() {
        let mut b = Backoff::new(20, 1000);
        let pauses: Vec<u64> = (0..12).map(|_| b.next().as_millis() as u64).collect();
        assert!((10..=20).contains(&pauses[0]), "{pauses:?}");
        assert!(pauses[11] >= 500 && pauses[11] <= 1000, "{pauses:?}");
        assert!(pauses.windows(2).any(|w| w[0] != w[1]));
        b.reset();
        assert!(b.next().as_millis() <= 20);
    }

    #[test]
    fn stream_entries_decode_or_say_why_not() {
        let bulk = |s: &[u8]| Reply::Bulk(s.to_vec());
        let v = contract::encode_vector(&[1.0, 2.0]);
        let put = [bulk(b"k"), bulk(b"user:7"), bulk(b"v"), Reply::Bulk(v.clone()), bulk(b"t"), bulk(b"123")];
        assert_eq!(change("user", &put, 2), Ok((7, Some(vec![1.0, 2.0]), 123)));
        let del = [bulk(b"k"), bulk(b"user:8"), bulk(b"d"), bulk(b"1"), bulk(b"t"), bulk(b"5")];
        assert_eq!(change("user", &del, 2), Ok((8, None, 5)));
        assert!(change("user", &put, 3).unwrap_err().contains("user:7"));
        let foreign = [bulk(b"k"), bulk(b"item:7"), bulk(b"v"), Reply::Bulk(v)];
        assert!(change("user", &foreign, 2).unwrap_err().contains("item:7"));
        assert!(change("user", &[bulk(b"x"), bulk(b"y")], 2).unwrap_err().contains("no key"));
        assert!(change("user", &[bulk(b"k")], 2).is_err());
        assert_eq!(parse_id(b"17-0"), Some((17, 0)));
        assert_eq!(parse_id(b"17"), None);
    }
}
