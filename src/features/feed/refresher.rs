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
//! - Bad data (a key that is not `{group}:{u64}`, or in a string-keyed
//!   group `{group}:` and 1 to `bytes_max` bytes; a value of the wrong
//!   length, a non-string key, a malformed stream entry) is skipped, counted
//!   and logged with the key; the refresh goes on. A group whose key kind in
//!   Redis is not the replica's is refused (the session fails, as for a
//!   bucket count that disagrees): mixing them would misread every key.
//! - Buckets: a bucketed group (the contract's layout for Redis Cluster) is
//!   followed as one part per bucket, each with its own replica file,
//!   stream, position and state, so a gap or a new epoch in one bucket
//!   resyncs that bucket alone. On one node a single XREAD BLOCK reads every
//!   part's stream; on a cluster, where one command may only name keys of
//!   one slot, each round pipelines one XREAD per part to its master (and
//!   sleeps a little while every stream is quiet), following `MOVED` and
//!   `ASK`. A bucket's copy is taken from its master alone, and thrown away
//!   if its slot was migrating or changed hands meanwhile.
//! - Failures: reconnects with capped exponential backoff and jitter; after
//!   `breaker_failures` consecutive failures the breaker is open (exported)
//!   and the thread keeps probing at the capped interval. Shards never wait:
//!   they keep reading the replica, and staleness grows.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::contract::{EntityKey, Part};
use super::redis_cluster::{key_slot, ClusterConn, RedisSource};
use super::resp::{RedisConfig, RedisConn, Reply};
use super::settings::FeedConfig;
use super::status::{FeedStatus, GroupStatus};
use super::sync::{
    check_bucket_count, check_key_kind, delete, entity, full_sync, parse_id, position, shape, skip, stream_first_from,
    unsettled, Keyed, RefreshError, SyncTarget,
};
use crate::deadline::{Clock, MonotonicClock};
use crate::features::replica::{Cursor, GrowthPhase, Replica, ReplicaWriter, Storage};

/// How long one XREAD waits while a growth replays (see `session`).
const REPLAY_BLOCK_MS: u64 = 1;

/// The longest a cluster round sleeps when no stream had anything: the
/// most a change waits to be seen on a quiet cluster (streams there are
/// polled, not blocked on; see `session`). With many buckets it is longer,
/// a quarter of a millisecond per part (up to `block_ms`), so that an idle
/// server sends at most about 4,000 XREADs a second.
const CLUSTER_IDLE_MS_MAX: u64 = 16;
const CLUSTER_IDLE_PARTS_PER_MS: usize = 4;

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One part's writer (a plain group, or one bucket of a bucketed one) and
/// where its stream is read from; it reports through
/// `status.groups[status_at]`, with the other parts of its group.
struct Group {
    name: String,
    part: Part,
    status_at: usize,
    /// When this part was last known current, and last heard from Redis:
    /// its group's status carries the oldest of its parts'.
    caught_up_ns: u64,
    contact_ns: u64,
    held_rows: u64,
    verifying: bool,
    torn_rows: u64,
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

/// The connection the refresher follows Redis over.
enum Link {
    Node(RedisConn),
    Cluster(ClusterConn),
}

impl Link {
    /// The connection to the node serving `part` (a cluster: the master of
    /// its slot, as the topology says), and how to open more like it.
    fn node_for(&mut self, part: &Part, redis: &RedisConfig) -> Result<(&mut RedisConn, RedisConfig), RefreshError> {
        match self {
            Link::Node(conn) => Ok((conn, redis.clone())),
            Link::Cluster(cluster) => {
                let addr = cluster.master_addr(key_slot(part.keys.stream.as_bytes()))?;
                let config = RedisConfig { addr: addr.clone(), ..cluster.config().clone() };
                Ok((cluster.node(&addr)?, config))
            }
        }
    }

    /// Whether `part`'s slot is settled on one master (always, on one node).
    fn stable(&mut self, part: &Part) -> Result<bool, RefreshError> {
        match self {
            Link::Node(_) => Ok(true),
            Link::Cluster(cluster) => Ok(cluster.slot_stable(key_slot(part.keys.stream.as_bytes()))?),
        }
    }
}

impl Keyed for Link {
    fn run_keyed(&mut self, cmds: &[(Vec<u8>, Vec<Vec<u8>>)]) -> Result<Vec<Reply>, RefreshError> {
        match self {
            Link::Node(conn) => conn.run_keyed(cmds),
            Link::Cluster(cluster) => cluster.run_keyed(cmds),
        }
    }
}

/// The refresher thread's state.
pub struct Refresher {
    config: FeedConfig,
    source: RedisSource,
    redis: RedisConfig,
    groups: Vec<Group>,
    /// Which part each stream key belongs to.
    by_stream: HashMap<Vec<u8>, usize>,
    status: Arc<FeedStatus>,
    clock: MonotonicClock,
    /// Checkpoints go to the flusher thread: their msync takes milliseconds,
    /// and the refresher must keep applying changes meanwhile.
    flusher: Option<Flusher>,
}

/// The channel to the flusher thread, and the thread.
type Flusher = (std::sync::mpsc::SyncSender<(Arc<Replica>, Cursor)>, JoinHandle<()>);

/// Writes checkpoints handed over by the refresher until the channel closes,
/// counting failures in `status`.
fn spawn_flusher(groups: usize, status: Arc<FeedStatus>) -> std::io::Result<Flusher> {
    // One pending checkpoint per group: a newer one waits for the next interval.
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Arc<Replica>, Cursor)>(groups.max(1));
    let thread = std::thread::Builder::new().name("quiver-flush".into()).spawn(move || {
        for (table, cursor) in rx {
            if let Err(e) = table.write_checkpoint(cursor) {
                GroupStatus::bump(&status.checkpoint_failures_total, 1);
                tracing::error!(path = table.path(), "checkpoint failed: {e}");
            }
        }
    })?;
    Ok((tx, thread))
}

/// One part to follow: its keys, the index of its group in the status, its
/// opened (or freshly created) replica, and the storage its copies are made
/// with (a file stored otherwise is copied again).
pub struct Follow {
    pub part: Part,
    pub status_at: usize,
    pub writer: ReplicaWriter,
    pub storage: Storage,
}

impl Refresher {
    pub fn new(config: FeedConfig, follows: Vec<Follow>, status: Arc<FeedStatus>) -> Result<Refresher, RefreshError> {
        let source = RedisSource::from_url(&config.redis).map_err(|e| RefreshError::Url(e.to_string()))?;
        let redis = source.config().clone();
        let clock = MonotonicClock::new();
        let now = clock.now_ns();
        let groups: Vec<Group> = follows
            .into_iter()
            .map(|Follow { part, status_at, mut writer, storage }| {
                // Growth copies in the background while the stream is applied.
                writer.set_grow_ahead(true);
                let cursor = writer.cursor();
                let name = status.groups[status_at].name.clone();
                Group {
                    storage,
                    name,
                    part,
                    status_at,
                    caught_up_ns: now,
                    contact_ns: 0,
                    held_rows: 0,
                    verifying: writer.scan_pending(),
                    torn_rows: 0,
                    writer,
                    read_id: (cursor.seq, 0),
                    unflushed: false,
                    last_checkpoint_ns: 0,
                    state: State::Following,
                    accept_unguarded: false,
                }
            })
            .collect();
        let by_stream = groups.iter().enumerate().map(|(i, g)| (g.part.keys.stream.as_bytes().to_vec(), i)).collect();
        let r = Refresher { config, source, redis, groups, by_stream, status, clock, flusher: None };
        r.publish_status();
        Ok(r)
    }

    /// Writes every group's status from its parts: counts and positions
    /// summed, a group stale or held when any of its parts is.
    fn publish_status(&self) {
        for (at, s) in self.status.groups.iter().enumerate() {
            let parts = || self.groups.iter().filter(move |g| g.status_at == at);
            s.applied_seq.store(parts().map(|g| g.writer.cursor().seq).sum(), Ordering::Relaxed);
            s.change_unix_ms
                .store(parts().map(|g| g.writer.cursor().change_unix_ms).max().unwrap_or(0), Ordering::Relaxed);
            s.live_rows.store(parts().map(|g| g.writer.live_rows()).sum(), Ordering::Relaxed);
            s.caught_up_ns.store(parts().map(|g| g.caught_up_ns).min().unwrap_or(0), Ordering::Relaxed);
            s.contact_ns.store(parts().map(|g| g.contact_ns).min().unwrap_or(0), Ordering::Relaxed);
            s.verifying.store(parts().any(|g| g.verifying), Ordering::Relaxed);
            s.torn_rows_repaired.store(parts().map(|g| g.torn_rows).sum(), Ordering::Relaxed);
            s.resync_held.store(parts().any(|g| matches!(g.state, State::Held { .. })), Ordering::Relaxed);
            s.held_rows.store(parts().map(|g| g.held_rows).sum(), Ordering::Relaxed);
            s.key_collisions.store(parts().map(|g| g.writer.table().key_collisions()).sum(), Ordering::Relaxed);
            s.key_displacements.store(parts().map(|g| g.writer.key_displacements()).sum(), Ordering::Relaxed);
        }
    }

    fn connect(&self) -> Result<Link, RefreshError> {
        match &self.source {
            RedisSource::Node(redis) => {
                let mut conn = RedisConn::connect(redis)?;
                conn.set_read_timeout_ms(self.config.block_ms + redis.io_timeout_ms)?;
                Ok(Link::Node(conn))
            }
            RedisSource::Cluster { config, seeds } => Ok(Link::Cluster(ClusterConn::connect(config, seeds)?)),
        }
    }

    /// Brings the parts `follows` names (indices into the list given to
    /// [`Refresher::new`]) up to date before serving starts: used when a
    /// part had no usable replica file. Bounded by `initial_sync_timeout_ms`.
    pub fn initial_sync(&mut self, follows: &[usize]) -> Result<(), RefreshError> {
        let started = self.clock.now_ns();
        let bound_ns = self.config.initial_sync_timeout_ms * 1_000_000;
        let mut backoff = Backoff::new(self.config.backoff_ms_min, self.config.backoff_ms_max);
        let done = self.copy_per_master(follows).unwrap_or_else(|e| {
            tracing::warn!("first copy per master: {e}; copying part by part");
            Vec::new()
        });
        for &i in follows.iter().filter(|i| !done.contains(i)) {
            loop {
                let attempt =
                    self.connect().and_then(|mut conn| self.sync_until_settled(&mut conn, i, started + bound_ns));
                match attempt {
                    Ok(()) => break,
                    // Configuration, not a passing state of Redis: waiting will not change it.
                    Err(e @ RefreshError::KeyKind { .. }) => return Err(e),
                    Err(e) if self.clock.now_ns() - started > bound_ns => {
                        return Err(RefreshError::InitialSync { group: self.groups[i].part.name(), why: e.to_string() })
                    }
                    Err(e) => {
                        tracing::warn!(group = %self.groups[i].part.name(), "initial sync: {e}; retrying");
                        std::thread::sleep(backoff.next());
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies the parts `follows` names once each, every master's parts on
    /// a thread of their own (one node: one thread), and takes the copies
    /// that show a settled source; returns the parts taken (swapped in or
    /// held). The others are left to [`Refresher::sync_until_settled`].
    fn copy_per_master(&mut self, follows: &[usize]) -> Result<Vec<usize>, RefreshError> {
        let mut conn = self.connect()?;
        let mut plan: Vec<(String, RedisConfig, Vec<usize>)> = Vec::new();
        for &i in follows {
            let part = self.groups[i].part.clone();
            if !conn.stable(&part)? {
                continue;
            }
            let (node, config) = conn.node_for(&part, &self.redis)?;
            let master = node.addr().to_string();
            match plan.iter_mut().find(|(m, _, _)| *m == master) {
                Some((_, _, parts)) => parts.push(i),
                None => plan.push((master, config, vec![i])),
            }
        }
        let started = self.clock.now_ns();
        let this = &*self;
        let copies: Vec<(usize, String, Result<ReplicaWriter, RefreshError>)> = std::thread::scope(|scope| {
            let threads: Vec<_> = plan
                .iter()
                .enumerate()
                .map(|(n, (master, config, parts))| {
                    let work = move || {
                        let mut node = match RedisConn::connect(config) {
                            Ok(node) => node,
                            Err(e) => {
                                let failed = |i: usize| RefreshError::InitialSync {
                                    group: this.groups[i].part.name(),
                                    why: e.to_string(),
                                };
                                return parts.iter().map(|&i| (i, master.clone(), Err(failed(i)))).collect();
                            }
                        };
                        parts.iter().map(|&i| (i, master.clone(), this.copy(i, &mut node, config))).collect::<Vec<_>>()
                    };
                    std::thread::Builder::new().name(format!("quiver-copy-{n}")).spawn_scoped(scope, work)
                })
                .collect();
            threads
                .into_iter()
                .flat_map(|t| match t {
                    Ok(t) => t.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                    Err(e) => {
                        tracing::warn!("cannot start a copy thread: {e}");
                        Vec::new()
                    }
                })
                .collect()
        });
        let mut taken = Vec::new();
        for (i, master, copy) in copies {
            match copy {
                Ok(fresh) => {
                    self.take_copy(&mut conn, i, fresh, &master, started)?;
                    if !matches!(self.groups[i].state, State::Settling { .. }) {
                        taken.push(i);
                    }
                }
                Err(e) => tracing::warn!(group = %self.groups[i].part.name(), "first copy: {e}; copying again"),
            }
        }
        Ok(taken)
    }

    /// Resyncs group `i`, and again after each back-off while the source is
    /// moving, until a copy is taken or `deadline_ns` passes.
    fn sync_until_settled(&mut self, conn: &mut Link, i: usize, deadline_ns: u64) -> Result<(), RefreshError> {
        loop {
            self.resync(conn, i)?;
            let State::Settling { at_ns, .. } = self.groups[i].state else {
                return Ok(());
            };
            if at_ns > deadline_ns {
                return Err(RefreshError::InitialSync {
                    group: self.groups[i].part.name(),
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
        match spawn_flusher(self.groups.len(), self.status.clone()) {
            Ok(f) => self.flusher = Some(f),
            Err(e) => tracing::warn!("no flusher thread ({e}): checkpoints run on the refresher"),
        }
        let mut backoff = Backoff::new(self.config.backoff_ms_min, self.config.backoff_ms_max);
        let mut failures = 0u32;
        while !stop.load(Ordering::Relaxed) {
            // Failures are forgiven once a session has checked every part:
            // on a cluster, connecting to the seeds proves little while the
            // master of some bucket is down.
            let (addr, status) = (self.redis.addr.clone(), self.status.clone());
            let mut ready = || {
                if failures > 0 {
                    tracing::info!(addr = %addr, "redis reachable again");
                }
                failures = 0;
                backoff.reset();
                status.breaker_open.store(false, Ordering::Relaxed);
            };
            let result = self.connect().and_then(|mut conn| {
                self.status.connected.store(true, Ordering::Relaxed);
                self.session(&mut conn, stop, &mut ready)
            });
            self.status.connected.store(false, Ordering::Relaxed);
            match &result {
                Err(e) if e.is_redirect() => {
                    // A resharding moved a slot: not a failure. The next
                    // session reads the topology again; the pause keeps a
                    // slot that bounces between nodes from spinning here.
                    tracing::info!("{e}: reading the cluster's topology again");
                    std::thread::sleep(Duration::from_millis(10));
                    self.checkpoint_all(true);
                    continue;
                }
                _ => {}
            }
            let disk = result.as_ref().err().filter(|e| e.is_disk());
            if let Some(e) = disk {
                // Not Redis: the shards keep serving what the replica holds,
                // and the session is tried again after the backoff.
                GroupStatus::bump(&self.status.disk_errors_total, 1);
                tracing::error!("replica disk: {e}; serving the replica as it is, retrying");
                self.back_off(backoff.next(), stop);
            } else if let Err(e) = result {
                failures += 1;
                GroupStatus::bump(&self.status.connect_failures_total, 1);
                if failures == 1 {
                    tracing::warn!(addr = %self.redis.addr, "redis: {e}; serving from the replica, reconnecting");
                }
                if failures == self.config.breaker_failures {
                    self.status.breaker_open.store(true, Ordering::Relaxed);
                    tracing::warn!(addr = %self.redis.addr, failures, "redis breaker open: probing at the capped interval");
                }
                self.back_off(backoff.next(), stop);
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
        for g in &mut self.groups {
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
                    g.torn_rows = report.torn_rows;
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
            g.verifying = false;
        }
        self.publish_status();
    }

    /// Waits `pause` before the next session, taking resync accepts
    /// meanwhile, unless `stop` is set.
    fn back_off(&mut self, pause: Duration, stop: &AtomicBool) {
        let until = self.clock.now_ns() + pause.as_nanos() as u64;
        while !stop.load(Ordering::Relaxed) && self.clock.now_ns() < until {
            self.take_accepts();
            std::thread::sleep(Duration::from_millis(10).min(pause));
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
                        GroupStatus::bump(&self.status.checkpoint_failures_total, 1);
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

    /// One connected session: check every group's position (then calls
    /// `ready`), then follow the streams until an error or `stop`.
    fn session(&mut self, conn: &mut Link, stop: &AtomicBool, ready: &mut dyn FnMut()) -> Result<(), RefreshError> {
        for i in 0..self.groups.len() {
            self.check(conn, i)?;
        }
        ready();
        let mut last_check_ns = self.clock.now_ns();
        let check_ns = self.config.check_interval_ms * 1_000_000;
        let mut idle_ms = 0;
        while !stop.load(Ordering::Relaxed) {
            self.take_accepts();
            self.due_resyncs(conn)?;
            // Only groups following their stream read it; the others are
            // behind, serving what they have, until their copy is taken.
            let following: Vec<usize> =
                (0..self.groups.len()).filter(|&i| matches!(self.groups[i].state, State::Following)).collect();
            let mut behind: Vec<bool> = self.groups.iter().map(|g| !matches!(g.state, State::Following)).collect();
            // A growth's replay moves on a bounded slice per round: while
            // one runs, a round does not wait long for the stream, so a
            // quiet stream does not stretch the replay over minutes.
            let replaying =
                self.groups.iter().any(|g| matches!(g.writer.growth_phase(), Some(GrowthPhase::Replaying { .. })));
            let block_ms = if replaying { REPLAY_BLOCK_MS.min(self.config.block_ms) } else { self.config.block_ms };
            if following.is_empty() {
                std::thread::sleep(Duration::from_millis(block_ms));
                if let Link::Node(node) = conn {
                    node.command(&[b"PING"])?;
                }
            } else {
                let read = self.read_streams(conn, &following, block_ms)?;
                // A quiet cluster is polled: the pause grows while nothing comes.
                idle_ms = match (&*conn, read.iter().all(|(_, e)| e.is_empty())) {
                    (Link::Cluster(_), true) => {
                        let most = CLUSTER_IDLE_MS_MAX.max((following.len() / CLUSTER_IDLE_PARTS_PER_MS) as u64);
                        (idle_ms * 2).clamp(1, most.min(block_ms))
                    }
                    _ => 0,
                };
                for (i, entries) in read {
                    behind[i] = entries.len() >= self.config.batch_entries_max;
                    if let Needs::Gap { cursor_seq, entry_seq } = self.apply(i, entries)? {
                        self.gap(conn, i, cursor_seq, entry_seq)?;
                        behind[i] = true;
                    }
                }
                if idle_ms > 0 {
                    std::thread::sleep(Duration::from_millis(idle_ms));
                }
            }
            for g in &mut self.groups {
                // A grown file swapped in names an older position until checkpointed.
                g.unflushed |= g.writer.poll_growth()?;
            }
            let now = self.clock.now_ns();
            for (g, behind) in self.groups.iter_mut().zip(behind) {
                g.contact_ns = now;
                if !behind {
                    g.caught_up_ns = now;
                }
            }
            self.publish_status();
            self.checkpoint_all(false);
            if self.clock.now_ns() - last_check_ns >= check_ns {
                // A topology that changed without a redirection reaching us
                // yet (a failover elsewhere, a slot added) is read on a timer.
                if let Link::Cluster(cluster) = conn {
                    cluster.refresh()?;
                }
                for i in 0..self.groups.len() {
                    self.check(conn, i)?;
                }
                last_check_ns = self.clock.now_ns();
            }
        }
        Ok(())
    }

    /// The entries the streams of `following` hold after each one's read
    /// position, as (part, entries) pairs. One node: one XREAD over every
    /// stream, blocking up to `block_ms`. A cluster: one XREAD per stream
    /// (a command there names keys of one slot only), pipelined per master,
    /// without blocking.
    fn read_streams(
        &self,
        conn: &mut Link,
        following: &[usize],
        block_ms: u64,
    ) -> Result<Vec<(usize, Vec<Reply>)>, RefreshError> {
        let count = self.config.batch_entries_max.max(1).to_string().into_bytes();
        let from = |i: usize| {
            let id = self.groups[i].read_id;
            format!("{}-{}", id.0, id.1).into_bytes()
        };
        let stream = |i: usize| self.groups[i].part.keys.stream.as_bytes().to_vec();
        let replies = match conn {
            Link::Node(node) => {
                let mut args: Vec<Vec<u8>> = vec![
                    b"XREAD".to_vec(),
                    b"COUNT".to_vec(),
                    count,
                    b"BLOCK".to_vec(),
                    block_ms.to_string().into_bytes(),
                    b"STREAMS".to_vec(),
                ];
                args.extend(following.iter().map(|&i| stream(i)));
                args.extend(following.iter().map(|&i| from(i)));
                let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
                vec![node.command(&refs)?]
            }
            Link::Cluster(cluster) => {
                let cmds: Vec<(Vec<u8>, Vec<Vec<u8>>)> = following
                    .iter()
                    .map(|&i| {
                        let cmd = vec![
                            b"XREAD".to_vec(),
                            b"COUNT".to_vec(),
                            count.clone(),
                            b"STREAMS".to_vec(),
                            stream(i),
                            from(i),
                        ];
                        (stream(i), cmd)
                    })
                    .collect();
                cluster.pipeline(&cmds)?
            }
        };
        let mut asked = vec![false; self.groups.len()];
        for &i in following {
            asked[i] = true;
        }
        let mut read = Vec::new();
        for reply in replies {
            let streams = match reply {
                Reply::Array(streams) => streams,
                Reply::Nil => continue,
                Reply::Error(message) => {
                    return Err(
                        crate::features::feed::RedisError::Server { addr: self.redis.addr.clone(), message }.into()
                    )
                }
                other => return Err(shape("XREAD", format!("{other:?}"))),
            };
            for stream in streams {
                let mut parts = stream.into_array().ok_or_else(|| shape("XREAD", "stream is not an array"))?;
                let entries = parts.pop().and_then(Reply::into_array).ok_or_else(|| shape("XREAD", "no entries"))?;
                let name = parts.pop().and_then(Reply::into_bytes).ok_or_else(|| shape("XREAD", "no stream name"))?;
                let Some(&i) = self.by_stream.get(name.as_slice()).filter(|&&i| asked[i]) else {
                    return Err(shape("XREAD", "a stream that was not asked for"));
                };
                read.push((i, entries));
            }
        }
        Ok(read)
    }

    /// Why group `i`'s replica cannot continue from its own cursor with what
    /// Redis holds now, if it cannot.
    fn cannot_continue(&self, conn: &mut Link, i: usize) -> Result<Option<String>, RefreshError> {
        let g = &self.groups[i];
        let cursor = g.writer.cursor();
        let (epoch, seq) = position(conn, &g.part)?;
        Ok(if g.writer.table().storage() != g.storage {
            Some(format!("stored as {:?}, configured as {:?}", g.writer.table().storage(), g.storage))
        } else if epoch != cursor.epoch {
            Some(format!("epoch {epoch} in redis, {} in the replica", cursor.epoch))
        } else if seq < cursor.seq {
            Some(format!("redis counter {seq} is behind the replica's {}", cursor.seq))
        } else if seq > cursor.seq {
            // The next entry must still be in the stream.
            match stream_first_from(conn, &g.part, cursor.seq + 1)? {
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
    fn check(&mut self, conn: &mut Link, i: usize) -> Result<(), RefreshError> {
        check_bucket_count(conn, &self.groups[i].part)?;
        check_key_kind(conn, &self.groups[i].part)?;
        match self.groups[i].state {
            // Its back-off timer brings it back (`due_resyncs`).
            State::Settling { .. } => Ok(()),
            State::Held { position: held_at, .. } => {
                if self.cannot_continue(conn, i)?.is_none() {
                    self.release(i);
                    return Ok(());
                }
                let now_at = position(conn, &self.groups[i].part)?;
                if now_at != held_at {
                    tracing::info!(
                        group = %self.groups[i].part.name(), epoch = now_at.0, seq = now_at.1,
                        "redis changed while a resync was held: copying again"
                    );
                    self.resync(conn, i)?;
                }
                Ok(())
            }
            State::Following => {
                if let Some(why) = self.cannot_continue(conn, i)? {
                    tracing::warn!(group = %self.groups[i].part.name(), "{why}: full resync");
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
        g.held_rows = 0;
        tracing::warn!(
            group = %g.part.name(), rows = g.writer.live_rows(),
            "redis is back at the replica's position: held resync released, following the stream"
        );
    }

    /// Starts the copies whose back-off has passed.
    fn due_resyncs(&mut self, conn: &mut Link) -> Result<(), RefreshError> {
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
        for at in 0..self.status.groups.len() {
            if !self.status.groups[at].accept_requested.swap(false, Ordering::AcqRel) {
                continue;
            }
            let held: Vec<usize> = (0..self.groups.len())
                .filter(|&i| self.groups[i].status_at == at && matches!(self.groups[i].state, State::Held { .. }))
                .collect();
            if held.is_empty() {
                tracing::info!(group = %self.status.groups[at].name, "accept asked for with no resync held: nothing to do");
            }
            for i in held {
                self.accept(i);
            }
            GroupStatus::bump(&self.status.groups[at].accepts_total, 1);
        }
        self.publish_status();
    }

    /// An operator accepted part `i`'s held resync: its copy is swapped in,
    /// or, without one, its next copy is taken whatever its size.
    fn accept(&mut self, i: usize) {
        let started = self.clock.now_ns();
        let g = &mut self.groups[i];
        let copy_unguarded = match std::mem::replace(&mut g.state, State::Following) {
            State::Held { copy: Some(copy), .. } => {
                let (before, after) = (g.writer.live_rows(), copy.live_rows());
                tracing::warn!(group = %g.part.name(), rows = after, replaced_rows = before, "held resync accepted by an operator");
                match self.swap_in(i, copy, started) {
                    Ok(()) => false,
                    Err(e) => {
                        let name = self.groups[i].part.name();
                        tracing::error!(group = %name, "accepted resync failed to swap in: {e}; copying again");
                        true
                    }
                }
            }
            State::Held { copy: None, .. } => {
                tracing::warn!(
                    group = %g.part.name(),
                    "held resync accepted by an operator: the next copy from redis is taken whatever its size"
                );
                true
            }
            other => {
                g.state = other;
                false
            }
        };
        if copy_unguarded {
            self.groups[i].accept_unguarded = true;
            self.groups[i].state = State::Settling { at_ns: 0, attempt: 0, last_rows: 0 };
        }
    }

    /// An entry skipped past the cursor: either the stream lost entries the
    /// replica needs (resync), or the entry was not written by the contract's
    /// script, since its number is beyond the counter (skip it).
    fn gap(&mut self, conn: &mut Link, i: usize, cursor_seq: u64, entry_seq: u64) -> Result<(), RefreshError> {
        let (_, counter) = position(conn, &self.groups[i].part)?;
        let g = &mut self.groups[i];
        if entry_seq > counter {
            g.read_id = (entry_seq, 0);
            let why =
                format!("stream entry {entry_seq}-0 is beyond the counter {counter}: not written by the contract");
            skip(Some(&self.status.groups[g.status_at]), &g.part, &why);
            return Ok(());
        }
        tracing::warn!(group = %g.part.name(), cursor_seq, entry_seq, "gap in the stream: full resync");
        self.resync(conn, i)
    }

    /// Copies Redis for group `i` and swaps the copy in, unless the source
    /// moved under it (the group settles and copies again later) or the copy
    /// would shrink the replica past `resync_shrink_max` (the copy is held).
    fn resync(&mut self, conn: &mut Link, i: usize) -> Result<(), RefreshError> {
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
        let part = self.groups[i].part.clone();
        let name = part.name();
        // On a cluster the copy reads the bucket's master alone: a slot
        // being migrated has some of its keys on the other node.
        if !conn.stable(&part)? {
            let pause_ms = self.copy_pause_ms(attempt);
            tracing::info!(group = %name, "its slot is being migrated: copying in {pause_ms} ms");
            if !matches!(self.groups[i].state, State::Held { .. }) {
                let at_ns = self.clock.now_ns() + pause_ms * 1_000_000;
                self.groups[i].state = State::Settling { at_ns, attempt, last_rows: last_rows.unwrap_or(0) };
            }
            return Ok(());
        }
        let (fresh, master) = {
            let (node, node_config) = conn.node_for(&part, &self.redis)?;
            let master = node.addr().to_string();
            (self.copy(i, node, &node_config)?, master)
        };
        self.take_copy(conn, i, fresh, &master, started)
    }

    /// A full copy of part `i` from `node` (its master), opened with `node_config`.
    fn copy(&self, i: usize, node: &mut RedisConn, node_config: &RedisConfig) -> Result<ReplicaWriter, RefreshError> {
        let g = &self.groups[i];
        let default = g.writer.table().default_vector();
        let target = SyncTarget {
            part: &g.part,
            path: g.writer.path(),
            dim: g.writer.table().dim(),
            storage: g.storage,
            default: &default,
            batch_keys_max: self.config.sync_batch_keys_max,
            connections: self.config.sync_connections,
        };
        full_sync(node, node_config, &target, Some(&self.status.groups[g.status_at]), &mut |_| {})
    }

    /// Swaps in `fresh`, a copy of part `i` taken from `master` since
    /// `started`, unless the source moved under it (the part settles and
    /// copies again later) or it would shrink the replica past
    /// `resync_shrink_max` (the copy is held).
    fn take_copy(
        &mut self,
        conn: &mut Link,
        i: usize,
        fresh: ReplicaWriter,
        master: &str,
        started: u64,
    ) -> Result<(), RefreshError> {
        let (attempt, last_rows) = match self.groups[i].state {
            State::Settling { attempt, last_rows, .. } => (attempt, (attempt > 0).then_some(last_rows)),
            _ => (0, None),
        };
        let part = self.groups[i].part.clone();
        let name = part.name();
        let s = &self.status.groups[self.groups[i].status_at];
        let noted = (fresh.cursor().epoch, fresh.cursor().seq);
        let copied = fresh.live_rows();
        let moved = !conn.stable(&part)? || conn.node_for(&part, &self.redis)?.0.addr() != master;
        let why = if moved {
            Some("its slot moved or was migrating during the copy".to_string())
        } else {
            unsettled(conn, &part, noted, copied, last_rows, self.config.resync_rows_drift_max)?
        };
        if let Some(why) = why {
            if attempt + 1 < self.config.resync_attempts_max || moved {
                fresh.discard();
                GroupStatus::bump(&s.resync_restarts_total, 1);
                let pause_ms = self.copy_pause_ms(attempt);
                tracing::warn!(group = %name, attempt = attempt + 1, "{why}: redis is being written, reloaded or resharded; copying again in {pause_ms} ms");
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
        let shrink_max = self.config.resync_shrink_max(&part.group);
        let dropped = current.saturating_sub(copied);
        let unguarded = std::mem::take(&mut self.groups[i].accept_unguarded);
        if !unguarded && dropped as f64 > shrink_max * current as f64 {
            tracing::warn!(
                group = %name, rows = current, copy_rows = copied, epoch = noted.0, seq = noted.1,
                "a full resync would drop {dropped} of {current} rows (more than resync_shrink_max {shrink_max}): held; \
                 serving the last-known-good rows, flagged stale, until redis recovers or POST /replica/{}/accept",
                part.group
            );
            self.groups[i].held_rows = copied;
            self.groups[i].state = State::Held { copy: Some(fresh), position: noted };
            self.publish_status();
            return Ok(());
        }
        self.swap_in(i, fresh, started)
    }

    /// How long a resync waits before its next copy after `attempt` copies.
    fn copy_pause_ms(&self, attempt: u32) -> u64 {
        (self.config.backoff_ms_min.max(1) << attempt.min(16)).min(self.config.backoff_ms_max.max(1))
    }

    /// Makes `fresh` group `i`'s replica; the group follows its stream from
    /// the copy's position.
    fn swap_in(&mut self, i: usize, fresh: ReplicaWriter, started_ns: u64) -> Result<(), RefreshError> {
        let g = &mut self.groups[i];
        g.writer.replace(fresh)?;
        g.state = State::Following;
        let cursor = g.writer.cursor();
        g.read_id = (cursor.seq, 0);
        g.unflushed = false;
        g.last_checkpoint_ns = self.clock.now_ns();
        g.held_rows = 0;
        GroupStatus::bump(&self.status.groups[g.status_at].resyncs_total, 1);
        tracing::info!(
            group = %g.part.name(), rows = g.writer.live_rows(), seq = cursor.seq,
            ms = (self.clock.now_ns() - started_ns) / 1_000_000, "full sync done"
        );
        self.publish_status();
        Ok(())
    }

    /// Applies stream entries to group `i` in order.
    fn apply(&mut self, i: usize, entries: Vec<Reply>) -> Result<Needs, RefreshError> {
        let g = &mut self.groups[i];
        let s = &self.status.groups[g.status_at];
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
                skip(Some(s), &g.part, &format!("stream entry {}-{} has no contract sequence number", id.0, id.1));
                continue;
            }
            if id.0 != cursor.seq + 1 {
                return Ok(Needs::Gap { cursor_seq: cursor.seq, entry_seq: id.0 });
            }
            g.read_id = id;
            cursor.seq = id.0;
            match change(&g.part, &fields, g.writer.table().dim()) {
                Ok((key, Some((v, parent)), t)) => {
                    g.writer.upsert_linked(key, &v, parent)?;
                    cursor.change_unix_ms = t;
                }
                Ok((key, None, t)) => {
                    delete(&mut g.writer, key);
                    cursor.change_unix_ms = t;
                }
                Err(why) => skip(Some(s), &g.part, &format!("stream entry {}: {why}", cursor.seq)),
            }
            g.writer.set_cursor(cursor);
            g.unflushed = true;
            GroupStatus::bump(&s.applied_total, 1);
        }
        Ok(Needs::Nothing)
    }
}

/// A put a stream entry records: the vector, and the parent key it names.
pub type Put<'f> = (Vec<f32>, Option<EntityKey<'f>>);

/// Decodes a stream entry's fields: `k <key> v <bytes> t <ms>` for a put,
/// `k <key> d 1 t <ms>` for a delete.
/// One stream entry's fields as the refresher applies them: the entity's
/// key (of the part's key kind), its vector and parent key ([`Put`]; `None` for a delete) and the
/// change's time; or why the entry is skipped (a key of the other kind, or
/// a string key past the group's limit, among others). Public for
/// `tests/fuzz.rs`, which feeds it what a Redis could send.
pub fn change<'f>(
    part: &Part,
    fields: &'f [Reply],
    dim: usize,
) -> Result<(EntityKey<'f>, Option<Put<'f>>, u64), String> {
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
        (Some(bytes), false) => entity(part, key, bytes, dim).map(|(id, v, parent)| (id, Some((v, parent)), t)),
        (None, true) => part
            .parse_key(key)
            .map(|parsed| (parsed, None, t))
            .ok_or_else(|| format!("key {} is not {}", String::from_utf8_lossy(key), part.key_form())),
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
        let v = crate::features::feed::contract::encode_vector(&[1.0, 2.0]);
        let put = [bulk(b"k"), bulk(b"user:7"), bulk(b"v"), Reply::Bulk(v.clone()), bulk(b"t"), bulk(b"123")];
        let user = Part::plain("user");
        assert_eq!(change(&user, &put, 2), Ok((EntityKey::Id(7), Some((vec![1.0, 2.0], None)), 123)));
        let del = [bulk(b"k"), bulk(b"user:8"), bulk(b"d"), bulk(b"1"), bulk(b"t"), bulk(b"5")];
        assert_eq!(change(&user, &del, 2), Ok((EntityKey::Id(8), None, 5)));
        // The same entries in a string-keyed group: the key's bytes, within the group's limit.
        let device = Part::plain("user").with_key_kind(crate::features::replica::KeyKind::Str { bytes_max: 4 });
        assert_eq!(change(&device, &put, 2), Ok((EntityKey::Str(b"7"), Some((vec![1.0, 2.0], None)), 123)));
        assert_eq!(change(&device, &del, 2), Ok((EntityKey::Str(b"8"), None, 5)));
        let long = [bulk(b"k"), bulk(b"user:12345"), bulk(b"d"), bulk(b"1")];
        assert!(change(&device, &long, 2).unwrap_err().contains("user:<1 to 4 bytes>"));
        assert!(change(&user, &put, 3).unwrap_err().contains("user:7"));
        let foreign = [bulk(b"k"), bulk(b"item:7"), bulk(b"v"), Reply::Bulk(v)];
        assert!(change(&user, &foreign, 2).unwrap_err().contains("item:7"));
        assert!(change(&user, &[bulk(b"x"), bulk(b"y")], 2).unwrap_err().contains("no key"));
        assert!(change(&user, &[bulk(b"k")], 2).is_err());
        assert_eq!(parse_id(b"17-0"), Some((17, 0)));
        assert_eq!(parse_id(b"17"), None);
    }
}
