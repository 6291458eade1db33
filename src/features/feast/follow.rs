//! Keeping Feast's views fresh after the first sync. Feast writes plain
//! HSETs, with no change log to follow, so the follower, one thread off the
//! shards, learns of changes two ways:
//!
//! - **Keyspace notifications**: it subscribes to the hash, generic and
//!   expiry events of the project's keys (`notify-keyspace-events` with
//!   `K`, `h`, `g` and `x`: [`enable_notifications`] adds what the server
//!   lacks, keeping what it has, or fails naming the setting; again on
//!   every reconnection, as a restarted Redis forgets a CONFIG SET). Each event
//!   queues its key; a key queued again before it is read is read once
//!   (coalesced); past `queue_keys_max` an event is dropped, counted, and a
//!   reconciliation pass is started, as it finds what the drop missed.
//!   Queued keys are read with one pipeline of HGETALL per batch and
//!   written in place through each view's [`ReplicaWriter`], the same
//!   writer and row encoding the first sync's files are built with
//!   ([`super::rows`]).
//! - **Reconciliation**: notifications are lost while the connection is
//!   down (and never sent for a write made before the subscription), so a
//!   round every `reconcile_interval_ms` goes on with a SCAN of the project's
//!   keys from the cursor the last round stopped at, at most
//!   `reconcile_keys_max` keys, reads each key's `_ts:` fields (one pipeline
//!   of HMGET) and re-reads the entities whose time differs from the one
//!   their row holds (the replica row keeps its event time, so the only
//!   side table is of rows skipped as bad data, with their time, at most
//!   [`BAD_KEYS_MAX`] keys, so that they are not read again every pass).
//!   A round compares exactly at most `reconcile_keys_max` keys: the keys a
//!   SCAN returns past the round's share (COUNT is only a hint to Redis)
//!   wait for the next round.
//! - **The sweep**: SCAN cannot show a key deleted while no notification
//!   could tell (it returns only the keys there), so each round also walks
//!   at most `reconcile_keys_max` of the replica's own rows, view by view,
//!   asks Redis whether each row's view still has its `_ts:` field (one
//!   pipeline of HEXISTS) and re-reads the entities whose field is gone,
//!   which removes their rows (through the guard below).
//!
//! After a (re)connect the SCAN and the sweep start again from the start,
//! and rounds run back to back until both have made a whole pass.
//!
//! On a Redis Cluster ([`super::store`]) a node sends the notifications of
//! its own keys only, so the follower subscribes on every master, and the
//! SCAN walks the masters one after another; reads are routed key by key
//! (following `MOVED` and `ASK`). When the topology is read again (a
//! failover promoted a replica, slots moved) the session ends and the next
//! subscribes to the masters there are then, and reconciles, as after a
//! reconnection: the notifications a failed master took with it are
//! found again that way.
//!
//! Deletions (a key gone, a view's fields gone, bad data where a row was)
//! remove rows, but never past `shrink_max` of the most rows the view has
//! held: a burst of them (a FLUSHALL, an emptied database) is held,
//! counted, and the rows kept, as the first sync holds a copy.
//!
//! The bound on freshness: an event is applied within one loop of this
//! thread after it arrives (at most [`WAIT_IDLE_MS`] of waiting, plus a
//! batch's HGETALL); a change whose event was lost within one reconciliation
//! pass (`keys / reconcile_keys_max` rounds of `reconcile_interval_ms`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::copy::{glob_escape, unix_ms};
use super::repo::{FeastRepo, Plan};
use super::rows::{self, Claim, Entities, Hash, Split};
use super::store::Store;
use super::{FeastConfig, FeastError};
use crate::deadline::{Clock, MonotonicClock};
use crate::features::feed::redis_cluster::RedisSource;
use crate::features::feed::{RedisConfig, RedisConn, RedisError, Reply, ReplyLimits};
use crate::features::replica::{key_hash, Cursor, EntityKey, EntityKeyBuf, ReplicaWriter};

/// The event classes followed: keyspace events (`K`) of hashes (`h`:
/// HSET, HDEL), generic commands (`g`: DEL, EXPIRE, RENAME) and expiries
/// (`x`).
pub const NOTIFY_FLAGS: &str = "Kghx";

/// The longest the follower waits for an event when it has nothing else to
/// do: also how long a stop waits for it.
pub const WAIT_IDLE_MS: u64 = 50;

/// A notification is `[pmessage, pattern, channel, event]`: a few small
/// strings and the key.
const PUSHED_LIMITS: ReplyLimits = ReplyLimits { elements_max: 8, bytes_max: 64 << 10 };

/// How often rows written in place are made durable with a checkpoint.
const CHECKPOINT_MS: u64 = 1_000;

/// Reconnection backoff.
const BACKOFF_MS_MIN: u64 = 100;
const BACKOFF_MS_MAX: u64 = 5_000;

/// Keys whose rows were skipped as bad data remembered, so that the
/// reconciliation reads them again only when their time moves: some 100
/// bytes each, a few MB at the bound. Past it such a key is read again each
/// pass (and counted again).
const BAD_KEYS_MAX: usize = 65_536;

/// Lines logged per view for skipped bad data and held deletions; the rest
/// are counted.
const LOGS_PER_VIEW_MAX: u64 = 8;

/// One served view's counters, read by `/metrics`.
#[derive(Debug, Default)]
pub struct ViewStatus {
    pub name: String,
    /// The first sync's copy: rows copied, null or absent values among them,
    /// and whether it was held (the file kept). Zero when none ran.
    pub rows_copied: AtomicU64,
    pub values_missing: AtomicU64,
    pub held: AtomicBool,
    /// Start-up found the file written for these definitions and resumed
    /// from it, without a copy.
    pub resumed: AtomicBool,
    /// Rows in the view's replica now.
    pub live_rows: AtomicU64,
    /// Entities skipped as bad data, by the copy and the follower.
    pub skipped_total: AtomicU64,
    /// Rows written and removed in place by the follower.
    pub applied_total: AtomicU64,
    pub deleted_total: AtomicU64,
    /// Removals held back: they would have dropped the view past
    /// `shrink_max` of the most rows it held.
    pub deletes_held_total: AtomicU64,
}

/// What `[feast]` reports to `/metrics`.
#[derive(Debug, Default)]
pub struct FeastStatus {
    pub views: Vec<ViewStatus>,
    /// The follower runs (`feast.follow`), and is connected now.
    pub following: AtomicBool,
    pub connected: AtomicBool,
    pub connect_failures_total: AtomicU64,
    /// Keyspace events received; dropped (the queue was full).
    pub events_total: AtomicU64,
    pub events_dropped_total: AtomicU64,
    /// Keys queued for a read now.
    pub queue_keys: AtomicU64,
    /// The longest a key read in the last batch waited in the queue, in
    /// microseconds: the follower's own share of the lag from a write.
    pub queue_wait_us: AtomicU64,
    /// Keys the reconciliation compared, and re-read because their `_ts:`
    /// moved; whole passes over the project's keys.
    pub reconciled_keys_total: AtomicU64,
    pub reconcile_rereads_total: AtomicU64,
    pub reconcile_passes_total: AtomicU64,
    /// Reconciliation rounds run, and the most keys one of them compared
    /// (at most `reconcile_keys_max`).
    pub reconcile_rounds_total: AtomicU64,
    pub reconcile_round_keys_max: AtomicU64,
    /// Replica rows the sweep checked against Redis, the entities it
    /// re-read because their view's `_ts:` field was gone, and its whole
    /// passes over every view's rows.
    pub swept_rows_total: AtomicU64,
    pub sweep_rereads_total: AtomicU64,
    pub sweep_passes_total: AtomicU64,
    /// Times a Redis Cluster's topology was read again (a failover, a
    /// resharding) and the follower subscribed to its masters anew.
    pub topology_changes_total: AtomicU64,
}

impl FeastStatus {
    pub fn new(plan: &Plan) -> FeastStatus {
        FeastStatus {
            views: plan.views.iter().map(|v| ViewStatus { name: v.name.clone(), ..ViewStatus::default() }).collect(),
            ..FeastStatus::default()
        }
    }

    fn bump(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}

/// The flags of `NOTIFY_FLAGS` that `current` (a `notify-keyspace-events`
/// value) lacks; `A` stands for every event class.
pub fn missing_flags(current: &str) -> String {
    // `A` is every class (`g$lshzxetdmn`), not the keyspace (`K`) itself.
    let covered = |f: char| current.contains(f) || (f != 'K' && current.contains('A'));
    NOTIFY_FLAGS.chars().filter(|&f| !covered(f)).collect()
}

/// Makes sure the server sends the keyspace events the follower needs:
/// reads `notify-keyspace-events` and, when flags are missing and
/// `may_config`, sets it to what it was plus them. An error names the
/// setting and what to do: when the server refuses CONFIG (a managed Redis)
/// and the flags are not known to be set, or `may_config` is off and they
/// are missing. With CONFIG GET refused and `may_config` off, the operator's
/// word is taken. Returns the value in force.
pub fn enable_notifications(conn: &mut RedisConn, may_config: bool) -> Result<String, FeastError> {
    let refused = |e: &RedisError| matches!(e, RedisError::Server { .. });
    let current = match conn.command(&[b"CONFIG", b"GET", b"notify-keyspace-events"]) {
        Ok(reply) => {
            let mut parts = reply.into_array().unwrap_or_default().into_iter();
            let value = parts.nth(1).and_then(Reply::into_bytes).unwrap_or_default();
            Some(String::from_utf8_lossy(&value).into_owned())
        }
        Err(e) if refused(&e) => {
            if !may_config {
                tracing::warn!(
                    "feast: CONFIG GET refused ({e}); taking feast.notify_config = false's word that \
                     notify-keyspace-events includes '{NOTIFY_FLAGS}'"
                );
                return Ok(String::new());
            }
            None
        }
        Err(e) => return Err(e.into()),
    };
    let missing = current.as_deref().map_or(NOTIFY_FLAGS.to_string(), missing_flags);
    if missing.is_empty() {
        return Ok(current.unwrap_or_default());
    }
    let shown = current.as_deref().map_or("unknown (CONFIG GET refused)".to_string(), |c| format!("'{c}'"));
    let advice = format!(
        "set notify-keyspace-events to include '{NOTIFY_FLAGS}' on the Redis server (redis.conf, or the managed \
         service's parameter group), then set feast.notify_config = false; or set feast.follow = false to serve the \
         start-up copy only"
    );
    if !may_config {
        return Err(FeastError::Notifications(format!(
            "notify-keyspace-events is {shown}, which lacks '{missing}', and feast.notify_config = false: {advice}"
        )));
    }
    let merged = format!("{}{missing}", current.unwrap_or_default());
    match conn.command(&[b"CONFIG", b"SET", b"notify-keyspace-events", merged.as_bytes()]) {
        Ok(_) => {
            tracing::info!(notify_keyspace_events = %merged, "feast: keyspace notifications enabled");
            Ok(merged)
        }
        Err(e) if refused(&e) => Err(FeastError::Notifications(format!(
            "notify-keyspace-events is {shown}, which lacks '{missing}', and CONFIG SET notify-keyspace-events was \
             refused ({e}): {advice}"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// Keys waiting to be read, each once, in the order first queued.
struct Queue {
    order: VecDeque<(Vec<u8>, u64)>,
    queued: HashSet<Vec<u8>>,
    keys_max: usize,
}

impl Queue {
    /// Queues `key` (at `now_ns`); false when the queue is full.
    fn push(&mut self, key: &[u8], now_ns: u64) -> bool {
        if self.queued.contains(key) {
            return true;
        }
        if self.order.len() >= self.keys_max {
            return false;
        }
        self.queued.insert(key.to_vec());
        self.order.push_back((key.to_vec(), now_ns));
        true
    }

    fn take(&mut self, n: usize) -> Vec<(Vec<u8>, u64)> {
        let n = n.min(self.order.len());
        let taken: Vec<(Vec<u8>, u64)> = self.order.drain(..n).collect();
        for (k, _) in &taken {
            self.queued.remove(k);
        }
        taken
    }
}

/// One served view's writer, and what guards its removals.
struct ViewFollow {
    writer: ReplicaWriter,
    /// The file keeps each row's event time (files written before it did
    /// have no links, and are written without).
    timed: bool,
    /// The most rows the view has held: removals stop at `shrink_max` of it.
    rows_high: u64,
    unflushed: bool,
    logs: u64,
    /// Scratch for reading a row's event time.
    row: Vec<f32>,
    link: Vec<u32>,
}

/// The follower, ready to run ([`Follower::spawn`]).
pub struct Follower {
    source: RedisSource,
    /// The keyspace channel pattern of the project's keys, the channel's
    /// prefix before a key, and the SCAN pattern.
    channels: Vec<u8>,
    channel_prefix: Vec<u8>,
    scan_pattern: Vec<u8>,
    entities: Entities,
    views: Vec<ViewFollow>,
    status: Arc<FeastStatus>,
    queue: Queue,
    batch_keys: usize,
    shrink_max: f64,
    notify_config: bool,
    reconcile_interval_ms: u64,
    reconcile_keys_max: usize,
    digest: u64,
    /// The masters the reconciliation's SCAN walks (one node: itself), the
    /// one it is on, and its cursor there.
    scan_nodes: Vec<String>,
    scan_node: usize,
    scan_cursor: Vec<u8>,
    /// Keys the last SCAN returned past its round's share, compared first
    /// in the next round.
    scan_carry: Vec<Vec<u8>>,
    /// The SCAN's cursor came back to 0: the pass ends with its carry.
    scan_ended: bool,
    /// The view and index slot the sweep goes on from.
    sweep_view: usize,
    sweep_slot: u64,
    /// Each view's entity (an index into `entities.entities`).
    entity_of_view: Vec<usize>,
    /// Reconciliation rounds run back to back until a pass of the SCAN and
    /// one of the sweep have ended since it was set.
    catch_up: bool,
    scan_pass_done: bool,
    sweep_pass_done: bool,
    next_round_ns: u64,
    split_rows: Vec<Vec<f32>>,
    split_out: Vec<Split>,
    /// Rows skipped as bad data, per key: each view's event time then
    /// (at most [`BAD_KEYS_MAX`] keys).
    bad: HashMap<Vec<u8>, Vec<(usize, u64)>>,
    clock: MonotonicClock,
}

impl Follower {
    /// A follower of `plan`'s views through `writers` (in the plan's order,
    /// opened on the files the first sync wrote or start-up resumed).
    pub fn new(
        config: &FeastConfig,
        source: RedisSource,
        repo: &FeastRepo,
        plan: &Plan,
        writers: Vec<ReplicaWriter>,
        status: Arc<FeastStatus>,
    ) -> Follower {
        let project = glob_escape(&repo.project);
        let channel_prefix = format!("__keyspace@{}__:", source.config().db).into_bytes();
        let mut channels = channel_prefix.clone();
        channels.extend_from_slice(format!("*{project}").as_bytes());
        let views = writers
            .into_iter()
            .map(|mut writer| {
                writer.set_grow_ahead(true);
                ViewFollow {
                    timed: writer.table().header().link == Some(rows::ROW_TIME_LINK),
                    rows_high: writer.live_rows(),
                    row: vec![0.0; writer.table().dim()],
                    link: vec![0; writer.table().header().link.map_or(0, |k| k.link_words())],
                    writer,
                    unflushed: false,
                    logs: 0,
                }
            })
            .collect();
        let entities = Entities::new(repo, plan);
        let entity_of_view = (0..plan.views.len())
            .map(|v| entities.entities.iter().position(|e| e.views.contains(&v)).unwrap_or(0))
            .collect();
        Follower {
            source,
            channels,
            channel_prefix,
            scan_pattern: format!("*{project}").into_bytes(),
            entities,
            views,
            status,
            queue: Queue { order: VecDeque::new(), queued: HashSet::new(), keys_max: config.queue_keys_max },
            batch_keys: config.batch_keys,
            shrink_max: config.shrink_max,
            notify_config: config.notify_config,
            reconcile_interval_ms: config.reconcile_interval_ms,
            reconcile_keys_max: config.reconcile_keys_max,
            digest: rows::plan_digest(repo, plan),
            scan_nodes: Vec::new(),
            scan_node: 0,
            scan_cursor: b"0".to_vec(),
            scan_carry: Vec::new(),
            scan_ended: false,
            sweep_view: 0,
            sweep_slot: 0,
            entity_of_view,
            catch_up: true,
            scan_pass_done: false,
            sweep_pass_done: false,
            next_round_ns: 0,
            split_rows: plan.views.iter().map(|v| vec![f32::NAN; v.features.len()]).collect(),
            split_out: vec![Split::Absent; plan.views.len()],
            bad: HashMap::new(),
            clock: MonotonicClock::new(),
        }
    }

    pub fn spawn(mut self, stop: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
        self.status.following.store(true, Relaxed);
        self.publish();
        std::thread::Builder::new().name("quiver-feast".into()).spawn(move || self.run(&stop))
    }

    fn run(&mut self, stop: &AtomicBool) {
        let mut backoff_ms = BACKOFF_MS_MIN;
        let mut failures = 0u32;
        while !stop.load(Relaxed) {
            let result = self.session(stop, &mut || {
                if failures > 0 {
                    tracing::info!("feast: redis reachable again: reconciling at once");
                }
                failures = 0;
                backoff_ms = BACKOFF_MS_MIN;
            });
            self.status.connected.store(false, Relaxed);
            self.checkpoint_all();
            if let Err(e) = result {
                failures += 1;
                FeastStatus::bump(&self.status.connect_failures_total, 1);
                if failures == 1 {
                    tracing::warn!("feast: following redis: {e}; serving the replica as it is, reconnecting");
                }
                let until = self.clock.now_ns() + backoff_ms * 1_000_000;
                while !stop.load(Relaxed) && self.clock.now_ns() < until {
                    std::thread::sleep(Duration::from_millis(10));
                }
                backoff_ms = (backoff_ms * 2).min(BACKOFF_MS_MAX);
            }
        }
        self.checkpoint_all();
    }

    /// One connected session: subscribe (on a cluster, to every master:
    /// notifications are node-local), then a reconciliation pass at once
    /// (what was written while no subscription listened), and events,
    /// batches and rounds until an error, `stop`, or (`Ok`) a cluster
    /// topology read again (a failover, a resharding): the next session
    /// subscribes to the masters there are then.
    fn session(&mut self, stop: &AtomicBool, connected: &mut dyn FnMut()) -> Result<(), FeastError> {
        let mut cmd = Store::connect(&self.source)?;
        let masters = cmd.masters();
        if masters.is_empty() {
            return Err(FeastError::Reply { command: "CLUSTER SLOTS", what: "no master".into() });
        }
        // A Redis restarted since has lost a CONFIG SET: set again.
        if self.notify_config {
            for m in &masters {
                enable_notifications(cmd.node(m)?, true)?;
            }
        }
        let mut subs = Vec::with_capacity(masters.len());
        for m in &masters {
            let mut sub = RedisConn::connect(&RedisConfig { addr: m.clone(), ..self.source.config().clone() })?;
            sub.command(&[b"PSUBSCRIBE", &self.channels])?;
            subs.push(sub);
        }
        let topology_reads = cmd.topology_reads();
        self.status.connected.store(true, Relaxed);
        connected();
        // Whatever changed while no notification reached us: both walks
        // again from the start.
        self.scan_nodes = masters;
        self.scan_node = 0;
        self.scan_cursor = b"0".to_vec();
        self.scan_carry.clear();
        self.scan_ended = false;
        self.sweep_view = 0;
        self.sweep_slot = 0;
        self.start_catch_up();
        self.next_round_ns = 0;
        let mut last_checkpoint_ns = self.clock.now_ns();
        let mut wait_ms = vec![0; subs.len()];
        while !stop.load(Relaxed) {
            // Wait for the first event only when there is nothing else to
            // do, the wait shared between the masters' subscriptions.
            let idle_ms = (WAIT_IDLE_MS / subs.len() as u64).max(1);
            let first_wait = if self.queue.order.is_empty() && !self.catch_up { idle_ms } else { 1 };
            for (sub, waiting_ms) in subs.iter_mut().zip(wait_ms.iter_mut()) {
                let mut events = 0;
                while events < self.batch_keys {
                    let want = if events == 0 { first_wait } else { 1 };
                    if want != *waiting_ms {
                        sub.set_read_timeout_ms(want)?;
                        *waiting_ms = want;
                    }
                    match sub.next_pushed(PUSHED_LIMITS)? {
                        Some(message) => self.on_message(message),
                        None => break,
                    }
                    events += 1;
                }
            }
            let batch = self.queue.take(self.batch_keys);
            if !batch.is_empty() {
                let now = self.clock.now_ns();
                let waited_us = batch.iter().map(|(_, at)| now.saturating_sub(*at) / 1_000).max().unwrap_or(0);
                self.status.queue_wait_us.store(waited_us, Relaxed);
                let keys: Vec<Vec<u8>> = batch.into_iter().map(|(k, _)| k).collect();
                self.apply_keys(&mut cmd, &keys)?;
            }
            if self.catch_up || self.clock.now_ns() >= self.next_round_ns {
                self.reconcile_round(&mut cmd)?;
                self.next_round_ns = self.clock.now_ns() + self.reconcile_interval_ms * 1_000_000;
            }
            for v in &mut self.views {
                v.unflushed |= v.writer.poll_growth()?;
                v.writer.reap_retired();
            }
            if self.clock.now_ns() - last_checkpoint_ns >= CHECKPOINT_MS * 1_000_000 {
                self.checkpoint_all();
                last_checkpoint_ns = self.clock.now_ns();
            }
            self.publish();
            if cmd.topology_reads() != topology_reads {
                tracing::info!("feast: the cluster's topology changed: subscribing to its masters again");
                FeastStatus::bump(&self.status.topology_changes_total, 1);
                return Ok(());
            }
        }
        Ok(())
    }

    /// Queues the key a keyspace event names.
    fn on_message(&mut self, message: Reply) {
        let parts = message.into_array().unwrap_or_default();
        let [kind, _, channel, _] = parts.as_slice() else { return };
        if kind.as_bytes() != Some(&b"pmessage"[..]) {
            return;
        }
        let Some(key) = channel.as_bytes().and_then(|c| c.strip_prefix(self.channel_prefix.as_slice())) else {
            return;
        };
        FeastStatus::bump(&self.status.events_total, 1);
        if !self.queue.push(key, self.clock.now_ns()) {
            FeastStatus::bump(&self.status.events_dropped_total, 1);
            // The reconciliation finds the change this event was for.
            if !self.catch_up {
                self.start_catch_up();
            }
        }
        self.status.queue_keys.store(self.queue.order.len() as u64, Relaxed);
    }

    /// Reads `keys` (one pipeline of HGETALL) and writes each entity's rows
    /// in place, or removes the rows Redis no longer holds.
    fn apply_keys(&mut self, cmd: &mut Store, keys: &[Vec<u8>]) -> Result<(), FeastError> {
        let mut read: Vec<(&[u8], usize, EntityKeyBuf)> = Vec::with_capacity(keys.len());
        for key in keys {
            match self.entities.classify(key) {
                Claim::Of(e, k) => read.push((key, e, k)),
                Claim::Bad(e, why) => {
                    let why = format!("not a key of entity '{}': {why}", self.entities.entities[e].codec.join_key);
                    for v in self.entities.entities[e].views.clone() {
                        self.skip(v, key, &why);
                    }
                }
                Claim::Other => {}
            }
        }
        let names: Vec<&[u8]> = read.iter().map(|(k, _, _)| *k).collect();
        let hashes = rows::read_hashes(cmd, &names)?;
        for ((key, e, parsed), hash) in read.into_iter().zip(hashes) {
            let views = self.entities.entities[e].views.clone();
            match hash {
                Hash::Bad(why) => {
                    for &v in &views {
                        self.skip(v, key, &why);
                        self.remove(v, key, parsed.as_key());
                    }
                }
                Hash::Pairs(pairs) => {
                    self.entities.split(e, &pairs, &mut self.split_rows, &mut self.split_out);
                    for &v in &views {
                        match self.split_out[v].clone() {
                            Split::Absent => self.remove(v, key, parsed.as_key()),
                            Split::Bad { why, ts_unix_s } => {
                                self.skip(v, key, &why);
                                self.remove(v, key, parsed.as_key());
                                self.note_bad(key, v, ts_unix_s);
                            }
                            Split::Row { ts_unix_s } => {
                                let f = &mut self.views[v];
                                let time = if f.timed { rows::row_time_link(ts_unix_s) } else { None };
                                f.writer.upsert_linked(parsed.as_key(), &self.split_rows[v], time)?;
                                if let Some(views) = self.bad.get_mut(key) {
                                    views.retain(|(b, _)| *b != v);
                                    if views.is_empty() {
                                        self.bad.remove(key);
                                    }
                                }
                                f.rows_high = f.rows_high.max(f.writer.live_rows());
                                self.changed(v);
                                FeastStatus::bump(&self.status.views[v].applied_total, 1);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Notes a change of view `v`'s rows: the file's position moves on.
    fn changed(&mut self, v: usize) {
        let f = &mut self.views[v];
        let cursor = f.writer.cursor();
        f.writer.set_cursor(Cursor { epoch: self.digest, seq: cursor.seq + 1, change_unix_ms: unix_ms() });
        f.unflushed = true;
    }

    /// Removes `key`'s row of view `v`, unless that would drop the view
    /// past `shrink_max` of the most rows it held (then it is held).
    fn remove(&mut self, v: usize, redis_key: &[u8], key: EntityKey<'_>) {
        let f = &mut self.views[v];
        let present = match key {
            EntityKey::Id(id) => f.writer.contains(id),
            EntityKey::Str(bytes) => f.writer.contains_str(bytes),
        };
        if !present {
            return;
        }
        let floor = ((1.0 - self.shrink_max) * f.rows_high as f64).ceil() as u64;
        if f.writer.live_rows().saturating_sub(1) < floor {
            FeastStatus::bump(&self.status.views[v].deletes_held_total, 1);
            f.logs += 1;
            if f.logs <= LOGS_PER_VIEW_MAX {
                tracing::error!(
                    view = %self.status.views[v].name, key = %String::from_utf8_lossy(redis_key).escape_debug(),
                    rows = f.writer.live_rows(), rows_high = f.rows_high,
                    "feast: a removal would shrink the view past feast.shrink_max of the most rows it held: held, \
                     the row kept (a restart's sync, with `quiver feast sync --accept-shrink`, accepts it)"
                );
            }
            return;
        }
        let removed = match key {
            EntityKey::Id(id) => f.writer.delete(id),
            EntityKey::Str(bytes) => f.writer.delete_str(bytes),
        };
        if removed {
            FeastStatus::bump(&self.status.views[v].deleted_total, 1);
            self.changed(v);
        }
    }

    /// Notes that view `v`'s row of `key` was skipped as bad data at event
    /// time `ts_unix_s`, so the reconciliation does not take the missing
    /// row for a missed write and read it again every pass.
    fn note_bad(&mut self, key: &[u8], v: usize, ts_unix_s: i64) {
        let ts = u64::try_from(ts_unix_s).unwrap_or(0);
        if let Some(views) = self.bad.get_mut(key) {
            views.retain(|(b, _)| *b != v);
            views.push((v, ts));
        } else if self.bad.len() < BAD_KEYS_MAX {
            self.bad.insert(key.to_vec(), vec![(v, ts)]);
        }
    }

    fn skip(&mut self, v: usize, key: &[u8], why: &str) {
        FeastStatus::bump(&self.status.views[v].skipped_total, 1);
        let f = &mut self.views[v];
        f.logs += 1;
        if f.logs <= LOGS_PER_VIEW_MAX {
            tracing::warn!(
                view = %self.status.views[v].name, key = %String::from_utf8_lossy(key).escape_debug(),
                "skipped bad feast data: {why}"
            );
        }
    }

    /// Rounds run back to back from now until a pass of the SCAN and one
    /// of the sweep have ended.
    fn start_catch_up(&mut self) {
        self.catch_up = true;
        self.scan_pass_done = false;
        self.sweep_pass_done = false;
    }

    /// One reconciliation round: at most `reconcile_keys_max` keys of
    /// Redis compared (the carry first, then SCAN on from the carried
    /// cursor), re-reading the entities whose `_ts:` field differs from
    /// their row's time; then the sweep of at most as many replica rows.
    fn reconcile_round(&mut self, cmd: &mut Store) -> Result<(), FeastError> {
        FeastStatus::bump(&self.status.reconcile_rounds_total, 1);
        let max = self.reconcile_keys_max;
        let mut compared = 0usize;
        // A SCAN may return no key (a sparse keyspace): the calls are bounded too.
        let mut scans_left = 2 * max.div_ceil(self.batch_keys) + 2;
        while compared < max {
            if self.scan_carry.is_empty() {
                if self.scan_ended {
                    self.scan_ended = false;
                    self.scan_pass_done = true;
                    FeastStatus::bump(&self.status.reconcile_passes_total, 1);
                    break;
                }
                if scans_left == 0 {
                    break;
                }
                scans_left -= 1;
                let count_s = self.batch_keys.min(max - compared).to_string().into_bytes();
                let node = self.scan_nodes.get(self.scan_node).cloned().unwrap_or_default();
                let scan = cmd.node(&node)?.command(&[
                    b"SCAN",
                    &self.scan_cursor,
                    b"MATCH",
                    &self.scan_pattern,
                    b"COUNT",
                    &count_s,
                ])?;
                let shape = |what: &str| FeastError::Reply { command: "SCAN", what: what.into() };
                let mut parts = scan.into_array().ok_or_else(|| shape("not an array"))?.into_iter();
                let (Some(next), Some(keys), None) = (parts.next(), parts.next(), parts.next()) else {
                    return Err(shape("not [cursor, keys]"));
                };
                self.scan_cursor = next.into_bytes().ok_or_else(|| shape("the cursor is not a string"))?;
                self.scan_carry =
                    keys.into_array().unwrap_or_default().into_iter().filter_map(Reply::into_bytes).collect();
                if self.scan_cursor == b"0" {
                    // This master's keys are walked: the next one's, or the pass ends.
                    self.scan_node += 1;
                    if self.scan_node >= self.scan_nodes.len() {
                        self.scan_node = 0;
                        self.scan_ended = true;
                    }
                }
                continue;
            }
            let take = self.scan_carry.len().min(max - compared).min(self.batch_keys);
            let keys: Vec<Vec<u8>> = self.scan_carry.drain(..take).collect();
            compared += take;
            FeastStatus::bump(&self.status.reconciled_keys_total, take as u64);
            let moved = self.moved(cmd, &keys)?;
            if !moved.is_empty() {
                FeastStatus::bump(&self.status.reconcile_rereads_total, moved.len() as u64);
                self.apply_keys(cmd, &moved)?;
            }
        }
        self.status.reconcile_round_keys_max.fetch_max(compared as u64, Relaxed);
        self.sweep(cmd)?;
        if self.catch_up && self.scan_pass_done && self.sweep_pass_done {
            tracing::info!("feast: reconciliation pass done: the replica is caught up with redis");
            self.catch_up = false;
        }
        Ok(())
    }

    /// The sweep's share of a round: at most `reconcile_keys_max` replica
    /// rows (and four times as many index slots, at least half of which
    /// are empty), view after view, each row's key asked whether its view's
    /// `_ts:` field is still in Redis; the entities whose field is gone are
    /// re-read, which removes their rows. Views start-up held are not
    /// swept.
    fn sweep(&mut self, cmd: &mut Store) -> Result<(), FeastError> {
        if self.views.is_empty() {
            self.sweep_pass_done = true;
            return Ok(());
        }
        let max = self.reconcile_keys_max as u64;
        let (mut checked, mut slots_left) = (0u64, 4 * max);
        let mut keys = Vec::new();
        while checked < max && slots_left > 0 {
            let v = self.sweep_view;
            let walk = (self.batch_keys as u64).min(max - checked).min(slots_left);
            keys.clear();
            // A view start-up held (Redis came back emptied) is kept as it
            // is until an operator accepts the loss.
            let next = if self.status.views[v].held.load(Relaxed) {
                0
            } else {
                self.views[v].writer.table().keys_in_slots(self.sweep_slot, walk, &mut keys)
            };
            slots_left -= walk;
            self.sweep_slot = next;
            if next == 0 {
                self.sweep_view = (v + 1) % self.views.len();
                if self.sweep_view == 0 {
                    self.sweep_pass_done = true;
                    FeastStatus::bump(&self.status.sweep_passes_total, 1);
                }
            }
            if keys.is_empty() {
                continue;
            }
            checked += keys.len() as u64;
            FeastStatus::bump(&self.status.swept_rows_total, keys.len() as u64);
            let codec = &self.entities.entities[self.entity_of_view[v]].codec;
            // Every row's key was parsed from a Redis key: each has one.
            let redis_keys: Vec<Vec<u8>> = keys.iter().filter_map(|k| codec.redis_key(k).ok()).collect();
            let ts_field = self.entities.ts_field(v).to_vec();
            let commands: Vec<(Vec<u8>, Vec<Vec<u8>>)> = redis_keys
                .iter()
                .map(|k| (k.clone(), vec![b"HEXISTS".to_vec(), k.clone(), ts_field.clone()]))
                .collect();
            let replies = cmd.pipeline(&commands)?;
            let gone: Vec<Vec<u8>> = redis_keys
                .into_iter()
                .zip(replies)
                .filter(|(_, r)| matches!(r, Reply::Int(0)))
                .map(|(k, _)| k)
                .collect();
            if !gone.is_empty() {
                FeastStatus::bump(&self.status.sweep_rereads_total, gone.len() as u64);
                self.apply_keys(cmd, &gone)?;
            }
        }
        Ok(())
    }

    /// The keys among `keys` whose `_ts:` field of some view differs from
    /// the time that view's row holds (a row Redis has and the replica has
    /// not, too).
    fn moved(&mut self, cmd: &mut Store, keys: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, FeastError> {
        let claimed: Vec<(&Vec<u8>, usize, EntityKeyBuf)> = keys
            .iter()
            .filter_map(|k| match self.entities.classify(k) {
                Claim::Of(e, parsed) => Some((k, e, parsed)),
                _ => None,
            })
            .collect();
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        let commands: Vec<(Vec<u8>, Vec<Vec<u8>>)> = claimed
            .iter()
            .map(|(k, e, _)| {
                let mut c = vec![b"HMGET".to_vec(), (*k).clone()];
                c.extend(self.entities.entities[*e].views.iter().map(|&v| self.entities.ts_field(v).to_vec()));
                ((*k).clone(), c)
            })
            .collect();
        let replies = cmd.pipeline(&commands)?;
        let bad = &self.bad;
        let mut moved = Vec::new();
        for ((key, e, parsed), reply) in claimed.into_iter().zip(replies) {
            let stamps = reply.into_array().unwrap_or_default();
            let views = &self.entities.entities[e].views;
            let differs = views.iter().zip(&stamps).any(|(&v, stamp)| {
                let Some(Ok(redis_ts)) = stamp.as_bytes().map(super::redis_layout::ts_unix_s) else {
                    return false;
                };
                let f = &mut self.views[v];
                let table = f.writer.table();
                let (filed, bytes): (u64, &[u8]) = match parsed.as_key() {
                    EntityKey::Id(id) => (id, &[]),
                    EntityKey::Str(b) => (key_hash(b), b),
                };
                let found = table.read_linked_into(filed, bytes, &mut f.row, &mut f.link);
                let row_ts = match found {
                    true => rows::row_time_s(&f.link),
                    // Skipped as bad data at this time: not a missed write.
                    false => bad.get(key.as_slice()).and_then(|b| b.iter().find(|(bv, _)| *bv == v)).map_or(0, |b| b.1),
                };
                row_ts != u64::try_from(redis_ts).unwrap_or(0)
            });
            if differs {
                moved.push(key.clone());
            }
        }
        Ok(moved)
    }

    /// Checkpoints the views with rows written since the last one.
    fn checkpoint_all(&mut self) {
        for (v, f) in self.views.iter_mut().enumerate() {
            if !f.unflushed {
                continue;
            }
            match f.writer.checkpoint(f.writer.cursor()) {
                Ok(()) => f.unflushed = false,
                Err(e) => tracing::error!(view = %self.status.views[v].name, "feast: checkpoint failed: {e}"),
            }
        }
    }

    fn publish(&self) {
        for (f, s) in self.views.iter().zip(&self.status.views) {
            s.live_rows.store(f.writer.live_rows(), Relaxed);
        }
        self.status.queue_keys.store(self.queue.order.len() as u64, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_already_set_are_kept_and_only_the_missing_added() {
        assert_eq!(missing_flags(""), "Kghx");
        assert_eq!(missing_flags("KEA"), "");
        assert_eq!(missing_flags("Ex"), "Kgh");
        assert_eq!(missing_flags("KA"), "");
        assert_eq!(missing_flags("Kh"), "gx");
        assert_eq!(missing_flags("EA"), "K");
    }

    #[test]
    fn the_queue_coalesces_keys_and_drops_past_its_bound() {
        let mut q = Queue { order: VecDeque::new(), queued: HashSet::new(), keys_max: 2 };
        assert!(q.push(b"a", 1) && q.push(b"a", 2) && q.push(b"b", 3));
        assert!(!q.push(b"c", 4));
        assert!(q.push(b"b", 5));
        let taken = q.take(10);
        assert_eq!(taken, vec![(b"a".to_vec(), 1), (b"b".to_vec(), 3)]);
        assert!(q.push(b"c", 6));
    }
}
