//! What the refresher thread tells everyone else: per-group position, counts
//! and staleness, and the state of the connection to Redis.
//!
//! These are the feed's only cross-thread types: plain atomics written by the
//! refresher, read by the admin thread (metrics, readiness) and by shards
//! (one relaxed load per group per request, to flag stale responses).
//! Times are nanoseconds on the process's monotonic clock
//! ([`crate::deadline::MonotonicClock`]), so shards compare them with the
//! same clock their deadlines use.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Whether responses are flagged or readiness fails once features are stale.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StalePolicy {
    /// Keep serving; responses carry `stale = true`.
    #[default]
    Flag,
    /// Keep serving, flagged, and fail `/readyz` so a balancer moves traffic.
    NotReady,
}

/// One feature group's refresh state.
#[derive(Debug)]
pub struct GroupStatus {
    pub name: String,
    /// Stream sequence number of the last applied change.
    pub applied_seq: AtomicU64,
    /// Unix milliseconds at which that change was written to Redis.
    pub change_unix_ms: AtomicU64,
    /// When the refresher last knew it held everything Redis had.
    pub caught_up_ns: AtomicU64,
    /// When the refresher last heard from Redis at all.
    pub contact_ns: AtomicU64,
    pub applied_total: AtomicU64,
    /// Entries and keys skipped as bad data (wrong length, type, format).
    pub skipped_total: AtomicU64,
    pub resyncs_total: AtomicU64,
    /// Rows found mid-write at open (a killed writer) and dropped until replayed.
    pub torn_rows_repaired: AtomicU64,
    /// Set from start-up until the background scan of the file opened at
    /// start-up has checked every slot and row; reads check each row's CRC
    /// meanwhile, and the stream is followed only after it.
    pub verifying: AtomicBool,
    pub live_rows: AtomicU64,
    /// Rows copied so far by a running full sync (for progress), and how
    /// many the last full sync wrote.
    pub sync_rows: AtomicU64,
    /// Set while a full resync is held because it would have dropped more
    /// than `resync_shrink_max` of the rows: the last-known-good rows keep
    /// serving and responses are flagged stale.
    pub resync_held: AtomicBool,
    /// Rows in the held copy (what Redis had), while held.
    pub held_rows: AtomicU64,
    /// Copies thrown away and begun again because the source moved under
    /// them (a reload in progress).
    pub resync_restarts_total: AtomicU64,
    /// Set by the admin endpoint (`POST /replica/{group}/accept`); the
    /// refresher clears it when it acts on it.
    pub accept_requested: AtomicBool,
    /// Accepts the refresher has acted on.
    pub accepts_total: AtomicU64,
    /// Reads of a string key that found another key under its hash (a
    /// miss), carried across the files swapped in (resyncs, growth).
    pub key_collisions: AtomicU64,
    /// String keys written over another key under the same hash, by the
    /// group's writers (carried across resyncs).
    pub key_displacements: AtomicU64,
}

impl GroupStatus {
    pub fn new(name: &str, now_ns: u64) -> GroupStatus {
        GroupStatus {
            name: name.into(),
            applied_seq: AtomicU64::new(0),
            change_unix_ms: AtomicU64::new(0),
            caught_up_ns: AtomicU64::new(now_ns),
            contact_ns: AtomicU64::new(0),
            applied_total: AtomicU64::new(0),
            skipped_total: AtomicU64::new(0),
            resyncs_total: AtomicU64::new(0),
            torn_rows_repaired: AtomicU64::new(0),
            verifying: AtomicBool::new(false),
            live_rows: AtomicU64::new(0),
            sync_rows: AtomicU64::new(0),
            resync_held: AtomicBool::new(false),
            held_rows: AtomicU64::new(0),
            resync_restarts_total: AtomicU64::new(0),
            accept_requested: AtomicBool::new(false),
            accepts_total: AtomicU64::new(0),
            key_collisions: AtomicU64::new(0),
            key_displacements: AtomicU64::new(0),
        }
    }

    /// How long since the group was last known to be current.
    pub fn staleness_ns(&self, now_ns: u64) -> u64 {
        now_ns.saturating_sub(self.caught_up_ns.load(Ordering::Relaxed))
    }

    pub(super) fn bump(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// The feed as a whole.
#[derive(Debug)]
pub struct FeedStatus {
    pub groups: Vec<GroupStatus>,
    pub connected: AtomicBool,
    /// Open after `breaker_failures` consecutive failed attempts; closes on
    /// the next successful session. Nothing on the request path looks at it.
    pub breaker_open: AtomicBool,
    pub connect_failures_total: AtomicU64,
    /// Sessions ended by the replica's files, not Redis (a full disk while
    /// creating or growing a file, a read-only file system).
    pub disk_errors_total: AtomicU64,
    /// Checkpoints that failed to reach the disk.
    pub checkpoint_failures_total: AtomicU64,
    pub staleness_max_ns: u64,
    pub policy: StalePolicy,
}

impl FeedStatus {
    pub fn new(groups: &[&str], staleness_max_ms: u64, policy: StalePolicy, now_ns: u64) -> FeedStatus {
        FeedStatus {
            groups: groups.iter().map(|g| GroupStatus::new(g, now_ns)).collect(),
            connected: AtomicBool::new(false),
            breaker_open: AtomicBool::new(false),
            connect_failures_total: AtomicU64::new(0),
            disk_errors_total: AtomicU64::new(0),
            checkpoint_failures_total: AtomicU64::new(0),
            staleness_max_ns: staleness_max_ms.saturating_mul(1_000_000),
            policy,
        }
    }

    pub fn group(&self, name: &str) -> Option<&GroupStatus> {
        self.groups.iter().find(|g| g.name == name)
    }

    /// Whether any group has gone longer than the bound without being
    /// current, or is serving its last-known-good rows with a resync held.
    #[inline]
    pub fn is_stale(&self, now_ns: u64) -> bool {
        self.groups
            .iter()
            .any(|g| g.resync_held.load(Ordering::Relaxed) || g.staleness_ns(now_ns) > self.staleness_max_ns)
    }

    /// Whether staleness should fail the readiness check now.
    pub fn blocks_readiness(&self, now_ns: u64) -> bool {
        self.policy == StalePolicy::NotReady && self.is_stale(now_ns)
    }
}
