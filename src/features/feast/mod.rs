//! Feast: serve the feature views of a Feast repository straight from the
//! Redis online store `feast materialize` fills (issue 35), so a team that
//! keeps its features in Feast needs no second pipeline into Quiver.
//!
//! - [`protos`]: Feast's own protobuf messages, generated from its `.proto`
//!   files at build time, and [`group_guard`], the walk every outside byte
//!   passes before they decode it (protobuf 3.4.0's unbounded recursion);
//! - [`repo`]: `feature_store.yaml` and the registry, and the plan that
//!   makes each served feature view a feature group (what is refused, why);
//! - [`redis_layout`]: Feast's Redis keys, hash fields and values, read
//!   exactly, and the rule that makes each value an f32;
//! - [`rows`]: one entity's hash as a row per view, with its event time,
//!   the one rule both the copy and the follower write rows by;
//! - [`copy`]: the first sync: every entity of the project's views copied
//!   from Redis into fresh replica files, swapped in only when the copy does
//!   not shrink a populated replica past the bound;
//! - [`follow`]: after it, keyspace notifications and a periodic
//!   reconciliation keep the rows fresh in place;
//! - [`store`]: the online store both reach, one node or a Redis Cluster.

pub mod copy;
pub mod follow;
pub mod group_guard;
pub mod protos;
pub mod redis_layout;
pub mod repo;
pub mod rows;
pub mod store;

pub use copy::{first_sync, SyncOptions, SyncReport, ViewReport};
pub use follow::{FeastStatus, Follower};
pub use repo::{FeastRepo, Plan, Refusal, ServedView};
pub use store::Store;

/// What reading a Feast repository or its Redis can fail with, each a line
/// fit for stderr.
#[derive(Debug, thiserror::Error)]
pub enum FeastError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("feast repository: {0}")]
    Repo(String),
    #[error("redis: {0}")]
    Redis(#[from] crate::features::feed::RedisError),
    /// The cluster's topology or routing (a node's own failure is `Redis`).
    #[error("{0}")]
    Cluster(crate::features::feed::redis_cluster::ClusterError),
    #[error("redis replied to {command} with an unexpected shape: {what}")]
    Reply { command: &'static str, what: String },
    #[error(transparent)]
    Replica(#[from] crate::features::replica::ReplicaError),
    /// The server will not send the keyspace events following needs.
    #[error("[feast]: Redis keyspace notifications: {0}")]
    Notifications(String),
    /// Another process (a server following Redis) writes the file in
    /// place: a copy renamed over it would be lost to that writer.
    #[error("view '{view}': {path} is being written by another process (a server whose [feast] follower keeps it fresh): a copy would be swapped in under it, so nothing was copied. That server already follows Feast's writes; to copy anyway, stop it first")]
    Busy { view: String, path: String },
    /// The copy would drop most of a populated replica (Redis emptied or
    /// flushed, the wrong project or database): the file is kept.
    #[error("view '{view}': the copy holds {copied} rows, {path} holds {served}; more than {shrink_max_percent}% fewer, so the file is kept (held). Run again with --accept-shrink if Redis really lost them")]
    Held { view: String, path: String, copied: u64, served: u64, shrink_max_percent: u32 },
}

impl From<crate::features::feed::redis_cluster::ClusterError> for FeastError {
    fn from(e: crate::features::feed::redis_cluster::ClusterError) -> FeastError {
        match e {
            crate::features::feed::redis_cluster::ClusterError::Redis(e) => FeastError::Redis(e),
            e => FeastError::Cluster(e),
        }
    }
}

/// `[feast]`: serve a Feast repository's feature views (docs/FEATURES.md,
/// "Feast").
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FeastConfig {
    /// The Feast repository: the directory of its `feature_store.yaml`.
    pub repo: std::path::PathBuf,
    /// Feature services or feature views to serve; empty: every feature
    /// service of the project.
    #[serde(default)]
    pub serve: Vec<String>,
    /// Served views whose groups are candidate-scope (one key per
    /// candidate); the others are request-scope.
    #[serde(default)]
    pub candidate: Vec<String>,
    /// The online store as a `redis://` URL (`redis+cluster://host:port,...`
    /// for a Redis Cluster); absent: `feature_store.yaml`'s
    /// `connection_string` and `redis_type`.
    #[serde(default)]
    pub redis: Option<String>,
    /// Keys per SCAN and per pipeline of HGETALL in the first sync and the
    /// follower.
    #[serde(default = "batch_keys_default")]
    pub batch_keys: usize,
    /// The largest fraction of a populated file's rows the first sync may
    /// drop and still replace it; past it the file is kept (held).
    #[serde(default = "shrink_max_default")]
    pub shrink_max: f64,
    /// Follow Feast's writes after the first sync (keyspace notifications
    /// and reconciliation); off: serve the start-up copy as it is.
    #[serde(default = "yes")]
    pub follow: bool,
    /// Quiver may add the flags it needs to the server's
    /// `notify-keyspace-events` with CONFIG SET; off: the operator has set
    /// them (a managed Redis without CONFIG).
    #[serde(default = "yes")]
    pub notify_config: bool,
    /// Keys waiting to be read after their keyspace events; past it an event
    /// is dropped, counted, and a reconciliation pass finds its change.
    #[serde(default = "queue_keys_max_default")]
    pub queue_keys_max: usize,
    /// How often a reconciliation round runs, in milliseconds.
    #[serde(default = "reconcile_interval_ms_default")]
    pub reconcile_interval_ms: u64,
    /// Keys one reconciliation round compares at most.
    #[serde(default = "reconcile_keys_max_default")]
    pub reconcile_keys_max: usize,
}

fn yes() -> bool {
    true
}

fn queue_keys_max_default() -> usize {
    100_000
}

fn reconcile_interval_ms_default() -> u64 {
    10_000
}

fn reconcile_keys_max_default() -> usize {
    10_000
}

/// The most keys the follower's queue may be given: 64 bytes a key and
/// twice for the set, some 200 MB at the bound.
pub const QUEUE_KEYS_MAX: usize = 1 << 20;

fn batch_keys_default() -> usize {
    1000
}

fn shrink_max_default() -> f64 {
    0.5
}

impl FeastConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=copy::BATCH_KEYS_MAX).contains(&self.batch_keys) {
            return Err(format!("feast.batch_keys = {} is outside 1..={}", self.batch_keys, copy::BATCH_KEYS_MAX));
        }
        if !(0.0..=1.0).contains(&self.shrink_max) {
            return Err(format!("feast.shrink_max = {} is outside 0..=1", self.shrink_max));
        }
        if !(1..=QUEUE_KEYS_MAX).contains(&self.queue_keys_max) {
            return Err(format!("feast.queue_keys_max = {} is outside 1..={QUEUE_KEYS_MAX}", self.queue_keys_max));
        }
        if !(10..=86_400_000).contains(&self.reconcile_interval_ms) {
            return Err(format!(
                "feast.reconcile_interval_ms = {} is outside 10..=86400000",
                self.reconcile_interval_ms
            ));
        }
        if !(1..=10_000_000).contains(&self.reconcile_keys_max) {
            return Err(format!("feast.reconcile_keys_max = {} is outside 1..=10000000", self.reconcile_keys_max));
        }
        Ok(())
    }

    /// Reads the repository and the plan for what `serve` names, refusing
    /// it whole when anything named is refused, and the `[[groups]]` entry
    /// of each served view: its name, scope, key type and width, its file
    /// `<data_dir>/<view>.qrep`.
    pub fn groups(&self) -> Result<(FeastRepo, Plan, Vec<crate::features::groups::GroupConfig>), FeastError> {
        use crate::features::groups::{GroupConfig, KeyType, Scope};
        let repo = FeastRepo::open(&self.repo)?;
        let plan = repo.plan(&self.serve)?;
        if let Some(r) = plan.refused.first() {
            return Err(FeastError::Repo(format!(
                "{}: {} (`quiver feast inspect --repo {}` lists what is refused)",
                r.what,
                r.why,
                self.repo.display()
            )));
        }
        if let Some(c) = self.candidate.iter().find(|c| !plan.views.iter().any(|v| &v.name == *c)) {
            return Err(FeastError::Repo(format!("feast.candidate names '{c}', which is no served feature view")));
        }
        let groups = plan
            .views
            .iter()
            .map(|v| {
                let (key, key_bytes_max) = match v.key {
                    redis_layout::JoinKeyType::String { bytes_max } => (KeyType::String, bytes_max),
                    _ => (KeyType::U64, crate::features::replica::KEY_BYTES_MAX),
                };
                GroupConfig {
                    name: v.name.clone(),
                    scope: if self.candidate.contains(&v.name) { Scope::Candidate } else { Scope::Request },
                    key,
                    key_bytes_max,
                    width: Some(v.features.len() as u32),
                    storage: None,
                    default: Vec::new(),
                    path: None,
                    absent: None,
                    parent: None,
                }
            })
            .collect();
        Ok((repo, plan, groups))
    }
}
