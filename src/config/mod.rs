//! Server configuration: one TOML file holds every limit; CLI flags override it.
//!
//! Every field has a default, so an empty file (or none) is a valid config.
//! Unknown keys are an error, so a typo never silently falls back to a default.
//! `reference` describes every key; docs/CONFIGURATION.md is rendered from it.

pub mod reference;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use crate::request::Limits;
use crate::score::cpu::KernelChoice;
use crate::score::BackendKind;
pub use crate::shard::{NotReadyPolicy, ReactorConfig};

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address every shard binds with SO_REUSEPORT.
    pub listen: String,
    /// Number of shards, placed on cores 0..shards. 0 means one per online core.
    pub shards: usize,
    /// Explicit cores, one shard each; overrides `shards` when not empty.
    pub cores: Vec<usize>,
    /// Where replica and model files live (and where `--demo` writes).
    pub data_dir: PathBuf,
    /// Feature replica of group `user`; default `<data_dir>/user.qrep`.
    pub user_features: Option<PathBuf>,
    /// Feature replica of group `item`; default `<data_dir>/item.qrep`.
    pub item_features: Option<PathBuf>,
    /// Feature groups (`[[groups]]`, at most 16): the entities requests
    /// name, each one replica (docs/FEATURES.md). Absent: the groups `user`
    /// and `item`, from `user_features` and `item_features`.
    pub groups: Vec<crate::features::groups::GroupConfig>,
    /// The request-scope group whose key keeps a request's canary choice
    /// sticky (a key is on the canary for all its requests or none).
    pub canary_group: String,
    /// Model file; default `<data_dir>/model.qm`. Ignored when `models_dir`
    /// is set.
    pub model: Option<PathBuf>,
    /// A model registry: `<models_dir>/<name>/<version>/model.qm`. The latest
    /// version of each name is served; others load through the admin endpoint.
    pub models_dir: Option<PathBuf>,
    /// Model for requests that name none; default: the only or first name.
    pub default_model: Option<String>,
    /// Poll `models_dir` this often and load new versions; 0 turns it off.
    pub watch_models_ms: u64,
    pub backend: BackendKind,
    /// The INT8 kernel every CPU INT8 backend runs: `auto` (the fastest
    /// this CPU runs) or one named; one the CPU lacks fails start-up.
    pub kernel: KernelChoice,
    /// The onnxruntime shared library (`onnxruntime/capi/libonnxruntime.so.*`
    /// from the PyPI wheel, or a system install) for versions served through
    /// onnxruntime; default `ORT_DYLIB_PATH`, else the loader's search path.
    /// Read by a binary built with the `onnxruntime` feature.
    pub onnxruntime_lib: Option<PathBuf>,
    /// Score on the shard that read the request, or hand batches to a
    /// dedicated inference thread.
    pub inference: InferenceMode,
    pub stage: StageLimits,
    /// Per-client rate limits.
    pub admission: crate::request::admission::AdmissionConfig,
    /// Load shedding by priority when a shard is over capacity.
    pub shed: crate::request::shed::ShedConfig,
    /// The degradation ladder: fallback model, static defaults, breaker.
    pub ladder: crate::request::ladder::LadderConfig,
    /// The per-shard score cache, the ladder's second rung.
    pub cache: crate::request::cache::CacheConfig,
    /// Score and input drift of calibrated models against their calibration.
    pub drift: crate::drift::DriftConfig,
    /// Refresh the feature replicas from Redis (docs/FEATURES.md); without
    /// it the replica files are served as they are.
    pub feed: Option<crate::features::feed::FeedConfig>,
    /// Serve a Feast repository's feature views as feature groups, copied
    /// from its Redis online store at start-up (docs/FEATURES.md, "Feast").
    pub feast: Option<crate::features::feast::FeastConfig>,
    /// Test hook: `POST /faults?stage_delay_us=N` on the admin endpoint
    /// slows the inference stage. Off unless set.
    pub faults_endpoint: bool,
    /// Admin HTTP endpoint (metrics, health, readiness, and the controls:
    /// drain, model loads, resync accepts); "off" disables it.
    pub admin_listen: String,
    /// A file holding the bearer token the admin endpoint's controls need
    /// (docs/OPERATING.md); required when `admin_listen` is not loopback.
    pub admin_token_file: Option<PathBuf>,
    /// The admin endpoint speaks plain HTTP: on an address that is not
    /// loopback its token crosses the network readable. Refused at start-up
    /// unless this says the network is trusted with it.
    pub admin_token_over_plaintext: bool,
    /// A read-only listener: metrics, health, readiness and stats, no
    /// controls, so it can face the network; "off" (the default) disables it.
    pub metrics_listen: String,
    /// While not ready (starting, or drained by an operator): refuse new
    /// connections, or accept them and answer `Overloaded`.
    pub not_ready: NotReadyPolicy,
    /// Benchmark floor: answer every verified request with an empty `Ok`,
    /// skipping lookup and model, to price the protocol and runtime alone.
    pub floor: bool,
    /// Lock the replica files in memory (mlock), so a lookup never waits on
    /// a page the kernel evicted. Needs RLIMIT_MEMLOCK (or CAP_IPC_LOCK) of
    /// at least the files' size; start-up fails, naming it, when too low.
    pub replica_lock: bool,
    /// Ask for huge pages on replica files of 32 MiB or more (see
    /// `replica::huge_pages`): fewer TLB misses where the kernel backs them,
    /// at the price of 2 MiB written back per folio an update touches. Off
    /// by default: under a steady stream of updates the writeback dominates.
    pub replica_huge_pages: bool,
    pub limits: Limits,
    pub reactor: ReactorConfig,
    /// TLS on the scoring port (docs/OPERATING.md); plain TCP without it.
    pub tls: Option<crate::tls::ServerTls>,
    /// The decision log: a sample of decisions written as Arrow IPC files
    /// (docs/OPERATING.md#decision-logs); off by default.
    pub log: crate::decision_log::LogConfig,
    /// The Open Inference Protocol (KServe v2) listeners, gRPC and HTTP,
    /// beside the FlatBuffers port (docs/PROTOCOL.md, "Open Inference
    /// Protocol"); off by default.
    pub oip: crate::oip::OipConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:7411".into(),
            shards: 0,
            cores: Vec::new(),
            data_dir: PathBuf::from("quiver-data"),
            user_features: None,
            item_features: None,
            groups: Vec::new(),
            canary_group: "user".into(),
            model: None,
            models_dir: None,
            default_model: None,
            watch_models_ms: 0,
            backend: BackendKind::Int8,
            kernel: KernelChoice::Auto,
            onnxruntime_lib: None,
            inference: InferenceMode::Inline,
            stage: StageLimits::default(),
            admission: crate::request::admission::AdmissionConfig::default(),
            shed: crate::request::shed::ShedConfig::default(),
            ladder: crate::request::ladder::LadderConfig::default(),
            cache: crate::request::cache::CacheConfig::default(),
            drift: crate::drift::DriftConfig::default(),
            feed: None,
            feast: None,
            faults_endpoint: false,
            admin_listen: "127.0.0.1:7412".into(),
            admin_token_file: None,
            admin_token_over_plaintext: false,
            metrics_listen: "off".into(),
            not_ready: NotReadyPolicy::Overloaded,
            floor: false,
            replica_lock: false,
            replica_huge_pages: false,
            limits: Limits::default(),
            reactor: ReactorConfig::default(),
            tls: None,
            log: crate::decision_log::LogConfig::default(),
            oip: crate::oip::OipConfig::default(),
        }
    }
}

/// Why `[oip]` is refused beside `[tls]` (by `server::run`: flags set
/// either).
pub const OIP_WITH_TLS: &str = "[oip] with [tls]: the v2 front end reaches the shards over the plain scoring port; \
                                serve it from a server without [tls] for now";

/// Where the model runs.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum InferenceMode {
    /// On the shard, inside the request path: no hop, no batching across
    /// requests.
    Inline,
    /// On a dedicated thread fed by every shard through lock-free rings,
    /// batched by deadline.
    Thread,
}

/// Limits of the inference stage (`inference = "thread"`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StageLimits {
    pub batch_rows_max: usize,
    pub batch_wait_us_max: u64,
    /// How long the idle stage thread spins before it parks.
    pub spin_us: u64,
    /// Requests each shard may have in the stage at once.
    pub jobs_per_shard_max: usize,
    /// Core for the inference thread; default: the first online core no
    /// shard uses, or none (unpinned) when the shards use them all.
    pub core: Option<usize>,
}

impl Default for StageLimits {
    fn default() -> Self {
        StageLimits { batch_rows_max: 512, batch_wait_us_max: 50, spin_us: 100, jobs_per_shard_max: 256, core: None }
    }
}

/// Most rows of one stage batch: the stage allocates this many rows of the
/// widest model input (at most `model::WIDTH_MAX` floats) at start-up, 1 GiB
/// at the bound.
pub const STAGE_BATCH_ROWS_MAX: usize = 16_384;
/// Most jobs in flight per shard: the slots and both rings of each shard.
pub const STAGE_JOBS_PER_SHARD_MAX: usize = 1 << 16;

impl StageLimits {
    pub fn validate(&self) -> Result<(), String> {
        in_range("stage.batch_rows_max", self.batch_rows_max, 1, STAGE_BATCH_ROWS_MAX)?;
        in_range("stage.jobs_per_shard_max", self.jobs_per_shard_max, 1, STAGE_JOBS_PER_SHARD_MAX)
    }
}

/// `Err("KEY = V is outside LO..=HI")` unless `lo <= value <= hi`: the
/// check for sizes a start-up allocation is made of, where an unchecked one
/// would abort the process on a capacity overflow instead of naming the key.
/// (The sections defined elsewhere spell it out: nothing but the server
/// depends on this module.)
fn in_range(key: &str, value: usize, lo: usize, hi: usize) -> Result<(), String> {
    if (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(format!("{key} = {value} is outside {lo}..={hi}"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Range(#[from] crate::request::LimitError),
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
        Config::parse(&text, &p)
    }

    pub fn parse(text: &str, path_for_errors: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text)
            .map_err(|source| ConfigError::Parse { path: path_for_errors.into(), source: Box::new(source) })?;
        config.limits.validate()?;
        config.admission.validate().map_err(ConfigError::Invalid)?;
        config.admission.client_limits().map_err(ConfigError::Invalid)?;
        if let Some(d) = &config.admission.default {
            if !(d.rate_per_s > 0.0 && d.burst >= 1.0) {
                return Err(ConfigError::Invalid("admission.default: rate_per_s must be > 0 and burst >= 1".into()));
            }
        }
        config.shed.validate().map_err(ConfigError::Invalid)?;
        config.drift.validate().map_err(ConfigError::Invalid)?;
        config.stage.validate().map_err(ConfigError::Invalid)?;
        config.ladder.validate().map_err(ConfigError::Invalid)?;
        config.cache.validate().map_err(ConfigError::Invalid)?;
        config.log.validate().map_err(ConfigError::Invalid)?;
        config.oip.validate().map_err(ConfigError::Invalid)?;
        if let Some(feed) = &config.feed {
            feed.validate().map_err(ConfigError::Invalid)?;
        }
        if let Some(feast) = &config.feast {
            feast.validate().map_err(ConfigError::Invalid)?;
        }
        config.groups().map_err(ConfigError::Invalid)?;
        if let Some(tls) = &config.tls {
            tls.validate().map_err(ConfigError::Invalid)?;
        }
        let client_certificates = config.tls.as_ref().is_some_and(|t| t.client_ca_file.is_some());
        if let Some((id, _)) = config.admission.clients.iter().find(|(_, c)| !c.tls_names.is_empty()) {
            if !client_certificates {
                return Err(ConfigError::Invalid(format!(
                    "admission.clients.{id}.tls_names needs [tls] client_ca_file: without client certificates no \
                     connection presents a name"
                )));
            }
        }
        Ok(config)
    }

    pub fn user_features_path(&self) -> PathBuf {
        self.user_features.clone().unwrap_or_else(|| self.data_dir.join("user.qrep"))
    }

    pub fn item_features_path(&self) -> PathBuf {
        self.item_features.clone().unwrap_or_else(|| self.data_dir.join("item.qrep"))
    }

    /// The feature groups served, resolved: `[[groups]]`, or `user` and
    /// `item` when it is empty.
    pub fn groups(&self) -> Result<Vec<crate::features::groups::Group>, String> {
        let feed = self.feed.clone().unwrap_or_default();
        let legacy = crate::features::groups::legacy(
            (self.user_features_path(), feed.user_dim, feed.user_storage),
            (self.item_features_path(), feed.item_dim, feed.item_storage),
        );
        crate::features::groups::resolve_all(&self.groups, &self.data_dir, legacy)
    }

    /// [`Config::groups`] with `extra` entries after `[[groups]]`' (the
    /// views `[feast]` serves): with any, only the groups named are served.
    pub fn groups_with(
        &self,
        extra: &[crate::features::groups::GroupConfig],
    ) -> Result<Vec<crate::features::groups::Group>, String> {
        if extra.is_empty() {
            return self.groups();
        }
        let all: Vec<_> = self.groups.iter().chain(extra).cloned().collect();
        let feed = self.feed.clone().unwrap_or_default();
        let legacy = crate::features::groups::legacy(
            (self.user_features_path(), feed.user_dim, feed.user_storage),
            (self.item_features_path(), feed.item_dim, feed.item_storage),
        );
        crate::features::groups::resolve_all(&all, &self.data_dir, legacy)
    }

    /// Checks `canary_group` against the served groups: a request-scope
    /// group, or `user` (then `user_id` when no such group is served).
    pub fn check_canary_group(&self, groups: &[crate::features::groups::Group]) -> Result<(), String> {
        let name = &self.canary_group;
        match groups.iter().find(|g| &g.name == name) {
            Some(g) if g.scope == crate::features::groups::Scope::Candidate => {
                Err(format!("canary_group = \"{name}\" is a candidate-scope group; a canary is chosen per request"))
            }
            Some(_) => Ok(()),
            None if name == "user" => Ok(()),
            None => Err(format!("canary_group = \"{name}\" is not a configured group")),
        }
    }

    /// Checks `log.key_group` against the served groups: a request-scope
    /// group, or `user` (then `user_id` when no such group is served).
    pub fn check_log_key_group(&self, groups: &[crate::features::groups::Group]) -> Result<(), String> {
        let Some(name) = &self.log.key_group else { return Ok(()) };
        crate::decision_log::check_key_group("log.key_group", name, groups.iter().map(|g| (g.name.as_str(), g.scope)))
    }

    pub fn model_path(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(|| self.data_dir.join("model.qm"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_defaults() {
        assert_eq!(Config::parse("", "c.toml").unwrap(), Config::default());
    }

    #[test]
    fn the_kernel_key_takes_the_command_line_names() {
        for (name, want) in [
            ("auto", KernelChoice::Auto),
            ("amx", KernelChoice::Amx),
            ("avx512-vnni", KernelChoice::Avx512Vnni),
            ("avx2", KernelChoice::Avx2),
            ("portable", KernelChoice::Portable),
        ] {
            assert_eq!(Config::parse(&format!("kernel = \"{name}\"\n"), "c.toml").unwrap().kernel, want);
            assert_eq!(<KernelChoice as clap::ValueEnum>::from_str(name, false), Ok(want));
        }
        assert!(Config::parse("kernel = \"avx512\"\n", "c.toml").is_err());
    }

    #[test]
    fn values_and_typos() {
        let c = Config::parse(
            "listen = \"0.0.0.0:9\"\ncores = [1]\nbackend = \"f32\"\n[limits]\ncandidates_max = 64\n",
            "c.toml",
        )
        .unwrap();
        assert_eq!(c.listen, "0.0.0.0:9");
        assert_eq!(c.cores, vec![1]);
        assert_eq!(c.backend, BackendKind::F32);
        assert_eq!(c.limits.candidates_max, 64);
        assert_eq!(c.limits.frame_bytes_max, 64 * 1024);

        let err = Config::parse("[limits]\ncandidate_max = 64\n", "c.toml").unwrap_err();
        assert!(err.to_string().contains("candidate_max"), "{err}");
        let err = Config::parse("[admission.clients.x]\nrate_per_s = 1.0\nburst = 1.0\n", "c.toml").unwrap_err();
        assert_eq!(err.to_string(), "admission.clients.x: not a client id (u32)");
        let err = Config::parse("[admission.clients.3]\nrate_per_s = 0.0\nburst = 1.0\n", "c.toml").unwrap_err();
        assert!(err.to_string().contains("rate_per_s must be > 0"), "{err}");
        let err = Config::parse("[shed]\nlow_watermark = 0.9\n", "c.toml").unwrap_err();
        assert!(err.to_string().contains("low_watermark < high_watermark"), "{err}");
        let c = Config::parse("[shed]\nenabled = true\nanswer = \"default\"\n", "c.toml").unwrap();
        assert_eq!((c.shed.enabled, c.shed.answer), (true, crate::request::shed::ShedAnswer::Default));
        let c = Config::parse("[drift]\nwindow_s = 5\npsi_alert = 0.1\n", "c.toml").unwrap();
        assert_eq!((c.drift.window_s, c.drift.psi_alert, c.drift.context_features_max), (5, 0.1, 8));
        let err = Config::parse("[drift]\nwindow_s = 0\n", "c.toml").unwrap_err();
        assert!(err.to_string().contains("drift.window_s = 0 is outside 1..=3600"), "{err}");
        let err = Config::parse("[limits]\ncandidates_max = 0\n", "c.toml").unwrap_err();
        assert_eq!(err.to_string(), "limits.candidates_max = 0 is outside 1..=8192");
        let err = Config::parse("[limits]\nframes_per_round_max = 0\n", "c.toml").unwrap_err();
        assert_eq!(err.to_string(), "limits.frames_per_round_max = 0 is outside 1..=65536");
    }

    /// Sizes a start-up allocation is made of are refused outside their
    /// range, naming the key, where they used to reach the allocator (a
    /// capacity overflow abort at `usize::MAX`) or be clamped unsaid.
    #[test]
    fn sizes_allocated_at_start_up_are_range_checked() {
        let refused = |text: &str| Config::parse(text, "c.toml").unwrap_err().to_string();
        let huge = i64::MAX;
        for (text, want) in [
            (
                format!("[ladder.breaker]\nwindow = {huge}\n"),
                format!("ladder.breaker.window = {huge} is outside 1..=65536"),
            ),
            ("[ladder.breaker]\nwindow = 0\n".into(), "ladder.breaker.window = 0 is outside 1..=65536".into()),
            (
                "[ladder.breaker]\nwindow = 10\nmin_outcomes = 11\n".into(),
                "ladder.breaker.min_outcomes = 11 is outside 0..=10".into(),
            ),
            (format!("[cache]\nentries_max = {huge}\n"), format!("cache.entries_max = {huge} is outside 0..=16777216")),
            (
                format!("[stage]\nbatch_rows_max = {huge}\n"),
                format!("stage.batch_rows_max = {huge} is outside 1..=16384"),
            ),
            ("[stage]\nbatch_rows_max = 0\n".into(), "stage.batch_rows_max = 0 is outside 1..=16384".into()),
            (
                format!("[stage]\njobs_per_shard_max = {huge}\n"),
                format!("stage.jobs_per_shard_max = {huge} is outside 1..=65536"),
            ),
            (
                format!("[admission]\nclients_max = {huge}\n"),
                format!("admission.clients_max = {huge} is outside 0..=1048576"),
            ),
            ("[feed]\nbatch_entries_max = 0\n".into(), "feed.batch_entries_max = 0 is outside 1..=100000".into()),
            (
                format!("[feed]\nsync_batch_keys_max = {huge}\n"),
                format!("feed.sync_batch_keys_max = {huge} is outside 1..=100000"),
            ),
        ] {
            assert_eq!(refused(&text), want, "{text}");
        }
        let edges = "[ladder.breaker]\nwindow = 65536\nmin_outcomes = 65536\n[cache]\nentries_max = 0\n[stage]\n\
                     batch_rows_max = 16384\njobs_per_shard_max = 65536\n[admission]\nclients_max = 1048576\n";
        let c = Config::parse(edges, "c.toml").unwrap();
        assert_eq!((c.ladder.breaker.window, c.cache.entries_max, c.stage.batch_rows_max), (65536, 0, 16384));
    }

    #[test]
    fn the_resync_guard_is_set_per_group_and_checked() {
        let c = Config::parse("[feed]\nresync_shrink_max_by_group = { item = 0.9 }\n", "c.toml").unwrap();
        let feed = c.feed.unwrap();
        assert_eq!((feed.resync_shrink_max("item"), feed.resync_shrink_max("user")), (0.9, 0.5));
        let err = Config::parse("[feed]\nresync_shrink_max = 1.5\n", "c.toml").unwrap_err();
        assert_eq!(err.to_string(), "feed.resync_shrink_max = 1.5: must be a fraction from 0 to 1");
        let err = Config::parse("[feed]\nresync_shrink_max_by_group = { user = -1.0 }\n", "c.toml").unwrap_err();
        assert!(err.to_string().contains("resync_shrink_max_by_group.user"), "{err}");
        let err = Config::parse("[feed]\nresync_attempts_max = 0\n", "c.toml").unwrap_err();
        assert!(err.to_string().contains("resync_attempts_max"), "{err}");
        let err = Config::parse("[feed]\nblock_ms = 0\n", "c.toml").unwrap_err();
        assert_eq!(err.to_string(), "feed.block_ms must be at least 1");
    }

    #[test]
    fn the_log_key_group_is_a_request_scope_group() {
        let groups =
            "[[groups]]\nname = \"card\"\nscope = \"request\"\n\n[[groups]]\nname = \"ad\"\nscope = \"candidate\"\n";
        let check = |key: &str| {
            let c = Config::parse(&format!("{groups}[log]\nkey_group = \"{key}\"\n"), "c.toml").unwrap();
            c.check_log_key_group(&c.groups().unwrap())
        };
        assert_eq!(check("card"), Ok(()));
        assert_eq!(
            check("ad").unwrap_err(),
            "log.key_group = \"ad\" is a candidate-scope group; a decision is sampled per request"
        );
        assert_eq!(check("device").unwrap_err(), "log.key_group = \"device\" is not a configured group");
        // Without groups, `user` is `user_id`.
        let c = Config::parse("[log]\nkey_group = \"user\"\n", "c.toml").unwrap();
        assert_eq!(c.check_log_key_group(&c.groups().unwrap()), Ok(()));
    }

    #[test]
    fn sync_connections_are_bounded() {
        let c = Config::parse("[feed]\nsync_connections = 16\n", "c.toml").unwrap();
        assert_eq!(c.feed.unwrap().sync_connections, 16);
        assert_eq!(crate::features::feed::FeedConfig::default().sync_connections, 4);
        for bad in [0, 17] {
            let err = Config::parse(&format!("[feed]\nsync_connections = {bad}\n"), "c.toml").unwrap_err();
            assert_eq!(err.to_string(), format!("feed.sync_connections = {bad}: must be 1 to 16"));
        }
    }

    /// `backend = "cuda"` exists only in builds with the feature; elsewhere
    /// it is refused at start-up, like any unknown value.
    #[test]
    fn the_cuda_backend_is_accepted_only_with_the_feature() {
        let parsed = Config::parse("backend = \"cuda\"\n", "c.toml");
        #[cfg(feature = "cuda")]
        assert_eq!(parsed.unwrap().backend, BackendKind::Cuda);
        #[cfg(not(feature = "cuda"))]
        assert!(parsed.unwrap_err().to_string().contains("cuda"));
    }
}
