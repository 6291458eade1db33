//! The `[feed]` section of the config: where Redis is, how the refresher
//! follows it, and the bounds of the resync guard.

use std::collections::BTreeMap;

use super::contract::{Layout, CLUSTER_BUCKETS_DEFAULT};
use super::redis_cluster::RedisSource;
use super::status::StalePolicy;
use super::sync::SYNC_CONNECTIONS_MAX;
use crate::features::replica::Storage;

/// Most stream entries one XREAD asks for (`batch_entries_max`).
pub const BATCH_ENTRIES_MAX: usize = 100_000;
/// Most keys one full-sync MGET asks for (`sync_batch_keys_max`).
pub const SYNC_BATCH_KEYS_MAX: usize = 100_000;

/// The `[feed]` section: where Redis is and how the refresher behaves.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeedConfig {
    /// `redis://[user:password@]host:port[/db]`, or
    /// `redis+cluster://host:port[,host:port…]` for a Redis Cluster.
    pub redis: String,
    /// Follow the bucketed layout with this many buckets (each group's
    /// replica is then one file per bucket, `user.b0003.qrep`); absent: the
    /// plain layout on one node, [`CLUSTER_BUCKETS_DEFAULT`] on a cluster.
    pub buckets: Option<u16>,
    /// How long one XREAD waits for new entries.
    pub block_ms: u64,
    /// Stream entries read per round trip.
    pub batch_entries_max: usize,
    /// Keys per MGET during a full sync.
    pub sync_batch_keys_max: usize,
    /// Connections a full sync reads over, the refresher's own included
    /// (1 to `sync::SYNC_CONNECTIONS_MAX`); with more than one, the others
    /// MGET in parallel while the refresher's connection SCANs.
    pub sync_connections: usize,
    /// Most time between durable checkpoints while changes arrive.
    pub checkpoint_interval_ms: u64,
    /// How often an idle refresher re-checks epoch, counter and stream.
    pub check_interval_ms: u64,
    pub backoff_ms_min: u64,
    pub backoff_ms_max: u64,
    /// Consecutive failed attempts that open the breaker.
    pub breaker_failures: u32,
    /// Staleness (time since a group was last known current) past which
    /// responses are flagged or readiness fails.
    pub staleness_max_ms: u64,
    pub stale_policy: StalePolicy,
    /// How long start-up may spend on a first full sync when no usable
    /// replica file exists.
    pub initial_sync_timeout_ms: u64,
    pub user_storage: Storage,
    pub item_storage: Storage,
    /// Dimensions for groups that have no replica file yet; default: the
    /// default model's input sizes.
    pub user_dim: Option<u32>,
    pub item_dim: Option<u32>,
    /// A full resync whose copy would drop more than this fraction of the
    /// group's rows is held, not swapped in; 1.0 turns the guard off.
    pub resync_shrink_max: f64,
    /// Per-group overrides of `resync_shrink_max`, e.g. `{ item = 0.9 }`.
    pub resync_shrink_max_by_group: BTreeMap<String, f64>,
    /// A copy during which the counter moved is used only when the copy
    /// before it had the same number of rows within this fraction (a busy
    /// source); otherwise the source is taken to be reloading and copied again.
    pub resync_rows_drift_max: f64,
    /// Copies one resync makes before it takes the last one although the
    /// source kept moving (the stream replay still brings it up to date).
    pub resync_attempts_max: u32,
}

impl Default for FeedConfig {
    fn default() -> FeedConfig {
        FeedConfig {
            redis: "redis://127.0.0.1:6379".into(),
            buckets: None,
            block_ms: 100,
            batch_entries_max: 1000,
            sync_batch_keys_max: 1000,
            sync_connections: 4,
            checkpoint_interval_ms: 200,
            check_interval_ms: 1000,
            backoff_ms_min: 20,
            backoff_ms_max: 2000,
            breaker_failures: 3,
            staleness_max_ms: 5000,
            stale_policy: StalePolicy::Flag,
            initial_sync_timeout_ms: 60_000,
            user_storage: Storage::F32,
            item_storage: Storage::F32,
            user_dim: None,
            item_dim: None,
            resync_shrink_max: 0.5,
            resync_shrink_max_by_group: BTreeMap::new(),
            resync_rows_drift_max: 0.01,
            resync_attempts_max: 20,
        }
    }
}

impl FeedConfig {
    /// The fraction of `group`'s rows a resync may drop before it is held.
    pub fn resync_shrink_max(&self, group: &str) -> f64 {
        self.resync_shrink_max_by_group.get(group).copied().unwrap_or(self.resync_shrink_max)
    }

    /// How the groups are laid out in Redis, from `redis` and `buckets`.
    pub fn layout(&self) -> Result<Layout, String> {
        let cluster = matches!(RedisSource::from_url(&self.redis), Ok(RedisSource::Cluster { .. }));
        match (self.buckets, cluster) {
            (None, false) => Ok(Layout::Plain),
            (None, true) => Ok(Layout::Bucketed { buckets: CLUSTER_BUCKETS_DEFAULT }),
            (Some(b), _) => Layout::bucketed(b).map_err(|e| format!("feed.buckets = {b}: {e}")),
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        self.layout()?;
        let fraction = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("feed.{name} = {v}: must be a fraction from 0 to 1"))
            }
        };
        fraction("resync_shrink_max", self.resync_shrink_max)?;
        for (group, &v) in &self.resync_shrink_max_by_group {
            fraction(&format!("resync_shrink_max_by_group.{group}"), v)?;
        }
        fraction("resync_rows_drift_max", self.resync_rows_drift_max)?;
        if !(1..=SYNC_CONNECTIONS_MAX).contains(&self.sync_connections) {
            return Err(format!(
                "feed.sync_connections = {}: must be 1 to {SYNC_CONNECTIONS_MAX}",
                self.sync_connections
            ));
        }
        // Each is a count asked of Redis per command, and the reply's size
        // (and the RESP reader's bound on it) follows from it.
        for (key, value, max) in [
            ("batch_entries_max", self.batch_entries_max, BATCH_ENTRIES_MAX),
            ("sync_batch_keys_max", self.sync_batch_keys_max, SYNC_BATCH_KEYS_MAX),
        ] {
            if !(1..=max).contains(&value) {
                return Err(format!("feed.{key} = {value} is outside 1..={max}"));
            }
        }
        if self.block_ms == 0 {
            // XREAD BLOCK 0 waits for ever: the refresher would only see its
            // read time out, and never an idle round.
            return Err("feed.block_ms must be at least 1".into());
        }
        if self.resync_attempts_max == 0 {
            return Err("feed.resync_attempts_max must be at least 1".into());
        }
        Ok(())
    }

    pub fn storage(&self, group: &str) -> Storage {
        if group == "user" {
            self.user_storage
        } else {
            self.item_storage
        }
    }
}
