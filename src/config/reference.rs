//! The configuration reference: one description per key of the config file,
//! kept beside the types that accept them and rendered as
//! docs/CONFIGURATION.md.
//!
//! A hand-kept reference drifts from the code; this one cannot, in three
//! ways. Defaults are never written here: `render` parses a config through
//! [`Config::parse`] and serializes it back, so each default is the one the
//! types give. Every section names the type that reads it, and
//! [`fields`] reads the keys that type accepts from its derived
//! `Deserialize`, so tests/generated.rs fails when a field has no
//! description or a description no field. And every key carries an example
//! value that the same test parses through the real config (all of them at
//! once: [`every_key`]), with its choices and range checked against the
//! parser. tests/generated.rs also holds docs/CONFIGURATION.md equal to
//! [`render`].

use serde::de::{DeserializeOwned, Visitor};

use super::{Config, InferenceMode, StageLimits};
use crate::decision_log::{
    LogConfig, RING_BYTES_MAX, RING_BYTES_MIN, SEGMENT_AGE_S_MAX, SEGMENT_BYTES_MAX, SEGMENT_BYTES_MIN,
};
use crate::drift::DriftConfig;
use crate::features::feast::FeastConfig;
use crate::features::feed::status::StalePolicy;
use crate::features::feed::FeedConfig;
use crate::features::groups::{Absent, GroupConfig, KeyType, Scope};
use crate::features::replica::Storage;
use crate::features::replica::{DIM_MAX, KEY_BYTES_MAX};
use crate::oip::OipConfig;
use crate::request::admission::{AdmissionConfig, ClientEntry, ClientLimit, OnMismatch};
use crate::request::cache::CacheConfig;
use crate::request::ladder::{BreakerConfig, LadderConfig};
use crate::request::shed::{ShedAnswer, ShedConfig};
use crate::request::Limits;
use crate::score::BackendKind;
use crate::shard::{NotReadyPolicy, ReactorConfig};
use crate::tls::ServerTls;

/// One table of the config file.
pub struct Section {
    /// Its path as a config file writes it: `""` for the top level,
    /// `"ladder.breaker"`; `<id>` stands for a key the user picks
    /// (`admission.clients.<id>`).
    pub path: &'static str,
    /// What the table governs, and where the behaviour is explained.
    pub doc: &'static str,
    /// Absent unless written (`[feed]`, `[tls]`): the feature is off without it.
    pub optional: bool,
    /// The keys the type that reads this table accepts ([`fields`]).
    pub fields: fn() -> &'static [&'static str],
    pub keys: &'static [Key],
}

/// One key of a table.
#[derive(Clone, Copy)]
pub struct Key {
    pub name: &'static str,
    /// A value the key accepts, as TOML. The type column is read from it,
    /// and the tests set every key to its example at once.
    pub example: &'static str,
    pub doc: &'static str,
    /// The table is refused without it.
    pub required: bool,
    /// For a key that names one of a set: every name, those of optional
    /// cargo features included ([`FEATURE_CHOICES`]).
    pub choices: &'static [&'static str],
    /// The enum the choices are checked against ([`variants`]).
    pub variants: Option<fn() -> &'static [&'static str]>,
    /// The inclusive range the config accepts, checked at its edges.
    pub range: Option<(i64, i64)>,
}

/// Choices that exist only in a binary built with a cargo feature, with the
/// feature's name.
pub const FEATURE_CHOICES: &[(&str, &str)] = &[("cuda", "cuda"), ("onnxruntime", "onnxruntime")];

impl Key {
    const fn new(name: &'static str, example: &'static str, doc: &'static str) -> Key {
        Key { name, example, doc, required: false, choices: &[], variants: None, range: None }
    }

    const fn required(self) -> Key {
        Key { required: true, ..self }
    }

    const fn range(self, lo: i64, hi: i64) -> Key {
        Key { range: Some((lo, hi)), ..self }
    }

    const fn one_of(self, choices: &'static [&'static str], variants: fn() -> &'static [&'static str]) -> Key {
        Key { choices, variants: Some(variants), ..self }
    }
}

/// Every table, in the order the page lists them. A table nested in
/// another comes after it.
pub const SECTIONS: &[Section] = &[
    Section {
        path: "",
        doc: "Where the server listens, what it serves, and with which backend. `quiver serve` flags override \
              these keys (`quiver serve --help`).",
        optional: false,
        fields: fields::<Config>,
        keys: &[
            Key::new("listen", "\"0.0.0.0:7411\"", "Address every shard binds with SO_REUSEPORT."),
            Key::new("shards", "2", "Shards, placed on cores 0 up; 0: one per online core."),
            Key::new("cores", "[0, 1]", "Explicit cores, one shard each; overrides `shards` when not empty."),
            Key::new("data_dir", "\"/var/lib/quiver\"", "Where replica and model files live (and where `--demo` writes)."),
            Key::new("user_features", "\"/var/lib/quiver/user.qrep\"", "Replica of group `user`; absent: `<data_dir>/user.qrep`."),
            Key::new("item_features", "\"/var/lib/quiver/item.qrep\"", "Replica of group `item`; absent: `<data_dir>/item.qrep`."),
            Key::new(
                "canary_group",
                "\"card\"",
                "The request-scope group whose key keeps the canary sticky: a key's requests all go to the canary \
                 or none do. Without a `user` group (or its key), `user_id` is used.",
            ),
            Key::new(
                "model",
                "\"/var/lib/quiver/model.qm\"",
                "The one model served without a registry; absent: `<data_dir>/model.qm`. Ignored with `models_dir`.",
            ),
            Key::new(
                "models_dir",
                "\"/var/lib/quiver/models\"",
                "A model registry, `<models_dir>/<name>/<version>/model.qm`: the latest version of each name is \
                 served, others load through the admin endpoint.",
            ),
            Key::new("default_model", "\"auction-32\"", "Model for requests that name none; absent: the only or first name."),
            Key::new("watch_models_ms", "1000", "Poll `models_dir` this often and load new versions; 0: off."),
            Key::new(
                "backend",
                "\"f32\"",
                "What scores: `int8`, `f32` (the reference), `fp8`, `cuda` (a GPU, falling back to `int8`), \
                 `onnxruntime` (versions that keep their ONNX graph). `cuda` and `onnxruntime` exist in binaries \
                 built with those features.",
            )
            .one_of(&["int8", "f32", "fp8", "cuda", "onnxruntime"], variants::<BackendKind>),
            Key::new(
                "kernel",
                "\"avx512-vnni\"",
                "The INT8 kernel of the CPU INT8 backend: `auto` (the fastest this CPU runs, `Int8Kernel::best`), \
                 `amx`, `avx512-vnni`, `avx2` or `portable`. One the CPU lacks is a start-up error; the choice is \
                 logged and exported as `quiver_kernel_info`.",
            )
            .one_of(&["auto", "amx", "avx512-vnni", "avx2", "portable"], variants::<crate::score::cpu::KernelChoice>),
            Key::new(
                "onnxruntime_lib",
                "\"/opt/onnxruntime/capi/libonnxruntime.so.1.32.0\"",
                "The onnxruntime shared library for versions it serves; absent: `ORT_DYLIB_PATH`, else the loader's \
                 path.",
            ),
            Key::new(
                "inference",
                "\"thread\"",
                "Score on the shard that read the request (`inline`), or batch on one inference thread (`thread`).",
            )
            .one_of(&["inline", "thread"], variants::<InferenceMode>),
            Key::new(
                "faults_endpoint",
                "true",
                "Test hook: `POST /faults?stage_delay_us=N` on the admin endpoint slows the inference stage.",
            ),
            Key::new(
                "admin_listen",
                "\"0.0.0.0:7412\"",
                "Admin endpoint (metrics, health, readiness, controls); `\"off\"` disables it. Off loopback it needs \
                 `admin_token_file`.",
            ),
            Key::new(
                "admin_token_file",
                "\"/etc/quiver/admin.token\"",
                "File holding the bearer token the controls (every `POST`) need; absent: no token.",
            ),
            Key::new(
                "admin_token_over_plaintext",
                "true",
                "Allow a token-guarded `admin_listen` off loopback, where the token crosses the network in plain \
                 HTTP.",
            ),
            Key::new(
                "metrics_listen",
                "\"0.0.0.0:9412\"",
                "A read-only listener: metrics, health, readiness, stats and models, no controls; `\"off\"` disables \
                 it.",
            ),
            Key::new(
                "not_ready",
                "\"refuse\"",
                "While starting or drained: answer every request `Overloaded`, or refuse new connections.",
            )
            .one_of(&["overloaded", "refuse"], variants::<NotReadyPolicy>),
            Key::new(
                "floor",
                "true",
                "Benchmark floor: answer every verified request with an empty `Ok`, no lookup and no model.",
            ),
            Key::new(
                "replica_lock",
                "true",
                "mlock the replica files; needs RLIMIT_MEMLOCK of their size or CAP_IPC_LOCK, and is refused above \
                 MemAvailable.",
            ),
            Key::new(
                "replica_huge_pages",
                "true",
                "MADV_HUGEPAGE on replica files of 32 MiB or more: fewer TLB misses, but 2 MiB written back per \
                 folio an update touches.",
            ),
        ],
    },
    Section {
        path: "limits",
        doc: "What one frame, one request and one connection may hold, and a connection's time bounds. \
              [PROTOCOL.md](PROTOCOL.md) says what a client sees when one bites.",
        optional: false,
        fields: fields::<Limits>,
        keys: &[
            Key::new("frame_bytes_max", "32768", "Largest request frame, without its 4-byte length prefix.")
                .range(64, 16_777_216),
            Key::new("candidates_max", "128", "Most candidates (`item_ids`) in one request.").range(1, 8192),
            Key::new("context_len_max", "64", "Most context floats, and most context ids, in one request.")
                .range(0, 4096),
            Key::new(
                "connections_per_shard_max",
                "512",
                "Connections a shard serves, handed-over ones included; more are closed at once.",
            )
            .range(1, 1_048_576),
            Key::new(
                "connections_per_source_max",
                "64",
                "Connections one source (an IPv4 address or an IPv6 /64) holds over all shards; more are closed at \
                 once.",
            )
            .range(1, 1_048_576),
            Key::new("budget_us_default", "5000", "Budget of a request that sends `budget_us = 0`; at least 1."),
            Key::new("budget_us_max", "1000000", "Larger budgets are clamped to this; at least `budget_us_default`."),
            Key::new(
                "output_bytes_max",
                "65536",
                "Responses buffered per connection before the shard stops decoding and flushes.",
            )
            .range(4096, 1_073_741_824),
            Key::new(
                "frames_per_round_max",
                "16",
                "Frames a connection answers before it flushes and yields the shard to its other connections.",
            )
            .range(1, 65_536),
            Key::new("idle_timeout_ms", "30000", "A connection that sends nothing for this long is closed.")
                .range(1, 86_400_000),
            Key::new(
                "frame_timeout_ms",
                "1000",
                "A frame must be complete this long after its first byte, however its bytes trickle in; else the \
                 connection is closed.",
            )
            .range(1, 3_600_000),
            Key::new(
                "write_timeout_ms",
                "1000",
                "A round's responses must be taken whole within this; else the connection is closed.",
            )
            .range(1, 86_400_000),
            Key::new(
                "shutdown_grace_ms",
                "2000",
                "After SIGTERM, how long connections get to finish before the process exits anyway.",
            )
            .range(0, 600_000),
        ],
    },
    Section {
        path: "reactor",
        doc: "How each shard's glommio executor runs, and which cores the other threads take. The defaults are \
              tuned for latency on small VMs.",
        optional: false,
        fields: fields::<ReactorConfig>,
        keys: &[
            Key::new(
                "spin_before_park_us",
                "0",
                "Poll this long after the last event before parking the core (a parked vCPU takes tens of µs to \
                 wake); 0 parks at once.",
            ),
            Key::new(
                "preempt_timer_us",
                "50000",
                "Longest one task queue runs before I/O and the other queues are polled again.",
            ),
            Key::new(
                "stall_threshold_us",
                "1000",
                "A longer reactor turn is a stall: counted, timed and logged ([OPERATING.md](OPERATING.md#reactor-stalls)); \
                 0: off.",
            ),
            Key::new(
                "housekeeping_cores",
                "[3]",
                "Cores of the admin, collector, feed and watcher threads; absent: the cores no shard or stage uses \
                 (none: unpinned).",
            ),
            Key::new(
                "socket_wait_every_reads",
                "1",
                "Stamp one read in this many per connection with the kernel's receive time (`socket_wait`); 1: all, \
                 0: none.",
            ),
            Key::new(
                "balance_connections",
                "false",
                "A shard two connections over the least-loaded one hands a new connection to it.",
            ),
        ],
    },
    Section {
        path: "stage",
        doc: "The inference thread of `inference = \"thread\"` \
              ([OPERATING.md](OPERATING.md#inline-scoring-or-an-inference-thread)).",
        optional: false,
        fields: fields::<StageLimits>,
        keys: &[
            Key::new("batch_rows_max", "256", "Most rows in one batch; allocated at start-up at the widest input.")
                .range(1, super::STAGE_BATCH_ROWS_MAX as i64),
            Key::new(
                "batch_wait_us_max",
                "20",
                "Longest a job waits for company, and never past the earliest deadline in the batch.",
            ),
            Key::new("spin_us", "0", "How long the idle thread spins before it parks (never when it shares a shard's core)."),
            Key::new(
                "jobs_per_shard_max",
                "64",
                "Job slots per shard; with all in use a request gets `Overloaded` at once.",
            )
            .range(1, super::STAGE_JOBS_PER_SHARD_MAX as i64),
            Key::new(
                "core",
                "1",
                "Core of the inference thread; absent: the first online core no shard uses, or unpinned.",
            ),
        ],
    },
    Section {
        path: "groups",
        doc: "One feature group: an entity requests name and models read (card, device, ad), one replica file \
              ([FEATURES.md](FEATURES.md)). At most 16. Absent: the groups `user` (request scope) and `item` \
              (candidate scope), keyed by u64 from `user_id` and `item_ids`.",
        optional: true,
        fields: fields::<GroupConfig>,
        keys: &[
            Key::new("name", "\"card\"", "1 to 16 bytes of letters, digits, `_` and `-`; unique.").required(),
            Key::new(
                "scope",
                "\"candidate\"",
                "`request`: one key per request, its row broadcast to every candidate; `candidate`: one key per \
                 candidate. `user` must be request, `item` candidate.",
            )
            .one_of(&["request", "candidate"], variants::<Scope>),
            Key::new(
                "key",
                "\"string\"",
                "The keys' type. A string key is filed under its 64-bit hash and compared whole on every lookup, \
                 so a collision is a counted miss.",
            )
            .one_of(&["u64", "string"], variants::<KeyType>),
            Key::new("key_bytes_max", "40", "Longest string key, in bytes.").range(1, KEY_BYTES_MAX as i64),
            Key::new(
                "width",
                "4",
                "Floats per row: a new replica's width, and the width an existing one must have; absent: what \
                 the served model reads.",
            )
            .range(1, DIM_MAX as i64),
            Key::new(
                "storage",
                "\"f16\"",
                "How a new replica stores rows; absent: `f32` (`feed.user_storage`, `feed.item_storage` for \
                 `user`, `item`).",
            )
            .one_of(&["f32", "f16", "int8"], variants::<Storage>),
            Key::new(
                "default",
                "[0.5, 0.5, 0.5, 0.5]",
                "The row a missing key reads, in a replica this server creates (needs `width`); absent: zeros.",
            ),
            Key::new(
                "path",
                "\"/var/lib/quiver/card.qrep\"",
                "The replica file; absent: `<data_dir>/<name>.qrep` (`user_features`, `item_features` for `user`, \
                 `item`).",
            ),
            Key::new(
                "absent",
                "\"default\"",
                "A request without this group's key: `reject` (`BadRequest` naming the group) or `default` (the \
                 default row, counted missing); absent: `reject`, `default` for `user` and `item`.",
            )
            .one_of(&["reject", "default"], variants::<Absent>),
            Key::new(
                "parent",
                "\"campaign\"",
                "The group each row names a key of (an ad its campaign): the parent's rows are joined through \
                 those links on the shard, and a request never carries the parent's keys. Same scope; one child \
                 per parent; a chain follows at most 4 links; a missing or dangling link reads the parent's \
                 default row, counted missing. Writers append the parent key to each value \
                 ([FEATURES.md](FEATURES.md#parents-foreign-keys)).",
            ),
        ],
    },
    Section {
        path: "admission",
        doc: "Per-client rate limits on `client_id`, and how far a client's own word is trusted \
              ([OPERATING.md](OPERATING.md#rate-limits-per-client)). Without `[admission.default]` or a configured \
              client, nothing is limited.",
        optional: false,
        fields: fields::<AdmissionConfig>,
        keys: &[
            Key::new(
                "clients_max",
                "1024",
                "Source buckets per shard (more share one overflow bucket until idle ones are dropped), and the most \
                 clients configured.",
            )
            .range(0, 1_048_576),
            Key::new(
                "on_mismatch",
                "\"default\"",
                "A bound `client_id` from another source: `RateLimited` (`reject`), or admitted as an unknown id \
                 (`default`).",
            )
            .one_of(&["reject", "default"], variants::<OnMismatch>),
            Key::new(
                "unknown_priority_max",
                "3",
                "Highest priority a request naming no configured client is shed as.",
            ),
        ],
    },
    Section {
        path: "admission.default",
        doc: "The limit of ids that are not configured: one bucket per source address, held across shards. \
              Absent: they are not limited.",
        optional: true,
        fields: fields::<ClientLimit>,
        keys: &[
            Key::new("rate_per_s", "1000.0", "Requests per second, above 0.").required(),
            Key::new("burst", "100.0", "Requests beyond the rate a bucket holds, at least 1.").required(),
        ],
    },
    Section {
        path: "admission.clients.<id>",
        doc: "One configured client, by its `client_id` (a u32): its own rate, held for the client as a whole \
              across shards, and what it must connect from.",
        optional: true,
        fields: fields::<ClientEntry>,
        keys: &[
            Key::new("rate_per_s", "5000.0", "Requests per second, above 0.").required(),
            Key::new("burst", "500.0", "Requests beyond the rate the bucket holds, at least 1.").required(),
            Key::new(
                "from",
                "[\"10.1.0.0/16\"]",
                "Source networks (CIDR, or single addresses) this id may come from; empty: any.",
            ),
            Key::new("priority_max", "9", "Highest priority this client's requests are shed as."),
            Key::new(
                "tls_names",
                "[\"spiffe://ads/bidder\"]",
                "Names (DNS or URI SAN) one of which the client's certificate must present; needs `[tls] \
                 client_ca_file`. Empty: any connection.",
            ),
        ],
    },
    Section {
        path: "shed",
        doc: "Load shedding by priority when a shard is over capacity \
              ([OPERATING.md](OPERATING.md#load-shedding-by-priority)).",
        optional: false,
        fields: fields::<ShedConfig>,
        keys: &[
            Key::new(
                "enabled",
                "true",
                "Off unless set: with it on, priority 0 (the wire default) is shed first.",
            ),
            Key::new(
                "queue_delay_max_us",
                "500",
                "Wait in a connection's read buffer, behind the frames read with it, that counts as full load.",
            )
            .range(1, 10_000_000),
            Key::new(
                "high_watermark",
                "0.75",
                "Load (a fraction of `queue_delay_max_us`, or of the job slots) at or above which the shed level rises; \
                 at most 64.",
            ),
            Key::new(
                "low_watermark",
                "0.5",
                "Load at or below which the level falls; at least 0 and below `high_watermark`.",
            ),
            Key::new("release_ms", "100", "Time at low load for the shed level to fall by one band.").range(1, 600_000),
            Key::new(
                "answer",
                "\"default\"",
                "What a shed request gets: `Overloaded`, or (`default`) `Ok` with the static default scores, tier \
                 `Default`, reason `Overload`.",
            )
            .one_of(&["overloaded", "default"], variants::<ShedAnswer>),
        ],
    },
    Section {
        path: "ladder",
        doc: "The degradation ladder's lower rungs: the fallback model and the static defaults \
              ([OPERATING.md](OPERATING.md#the-degradation-ladder)).",
        optional: false,
        fields: fields::<LadderConfig>,
        keys: &[
            Key::new(
                "fallback_model",
                "\"/var/lib/quiver/fallback.qm\"",
                "A small model with the primary's inputs, run inline on the shard; absent: `<data_dir>/fallback.qm` \
                 when that exists.",
            ),
            Key::new("default_score", "0.5", "The static default score, the last rung."),
            Key::new("default_scores", "{ auction-32 = 0.125 }", "Static default score by model name."),
            Key::new(
                "reserve_us",
                "500",
                "Time kept back for the lower rungs and the write: the inference stage's turnaround must leave it, \
                 and a handed-off request still waiting at `deadline - reserve_us` is answered from below.",
            ),
        ],
    },
    Section {
        path: "ladder.breaker",
        doc: "The circuit breaker each shard keeps on the primary model: open, requests go straight to the \
              fallback.",
        optional: false,
        fields: fields::<BreakerConfig>,
        keys: &[
            Key::new(
                "window",
                "50",
                "Outcomes remembered (the sliding window), at least `min_outcomes`; allocated per shard, at most 65,536.",
            ),
            Key::new("failure_ratio", "0.25", "Failed or late outcomes in the window, as a fraction, that open it."),
            Key::new("min_outcomes", "10", "Outcomes the window must hold before it judges; at most `window`."),
            Key::new(
                "open_ms",
                "500",
                "How long it stays open the first time; each failed probe round doubles it.",
            ),
            Key::new("open_ms_max", "10000", "The most the open time doubles to."),
            Key::new("probes", "3", "Requests let through half-open; it closes only if they all succeed."),
        ],
    },
    Section {
        path: "cache",
        doc: "The per-shard score cache, the ladder's second rung ([OPERATING.md](OPERATING.md#the-score-cache)).",
        optional: false,
        fields: fields::<CacheConfig>,
        keys: &[
            Key::new(
                "entries_max",
                "4096",
                "Entries per shard, rounded up to a power of two (at least 4), allocated at start-up; 0 disables the \
                 cache.",
            )
            .range(0, crate::request::cache::ENTRIES_MAX as i64),
            Key::new("ttl_ms", "1000", "How long a cached score is served; at most 2^30 ms (about 12 days)."),
            Key::new(
                "before_primary",
                "true",
                "Answer from the cache before the primary when every candidate is cached (re-ranking workloads).",
            ),
        ],
    },
    Section {
        path: "drift",
        doc: "Score and input drift of calibrated models against their calibration set \
              ([OPERATING.md](OPERATING.md#drift)).",
        optional: false,
        fields: fields::<DriftConfig>,
        keys: &[
            Key::new("window_s", "300", "The sliding window the measures cover, in seconds.").range(1, 3600),
            Key::new("min_count", "500", "Rows the window must hold before a measure is reported."),
            Key::new("psi_alert", "0.25", "`quiver_score_drift_alert` is 1 while the PSI is at least this; above 0."),
            Key::new(
                "context_features_max",
                "4",
                "Per-request inputs followed per version: the first this many of the context's, then each \
                 request-scope feature group's (in the model's input order).",
            )
                .range(0, 256),
        ],
    },
    Section {
        path: "feed",
        doc: "Keep the replicas in sync with Redis ([FEATURES.md](FEATURES.md), [REPLICA.md](REPLICA.md)). \
              Absent: the replica files are served as they are. `quiver serve --redis URL` adds it with that URL.",
        optional: true,
        fields: fields::<FeedConfig>,
        keys: &[
            Key::new(
                "redis",
                "\"redis+cluster://10.0.0.1:7000,10.0.0.2:7000\"",
                "`redis://[user:password@]host:port[/db]`, `rediss://…[?ca=FILE]` (TLS), or \
                 `redis+cluster://host:port[,host:port…]`.",
            ),
            Key::new(
                "buckets",
                "16",
                "Follow the bucketed layout with this many buckets (one file per bucket, `user.b0003.qrep`); absent: \
                 the plain layout on one node, 16 on a cluster.",
            ),
            Key::new("block_ms", "50", "One XREAD's wait for new changes; at least 1."),
            Key::new("batch_entries_max", "500", "Stream entries one read asks for.").range(1, 100_000),
            Key::new("sync_batch_keys_max", "500", "Keys per MGET in a full sync.").range(1, 100_000),
            Key::new(
                "sync_connections",
                "8",
                "Connections a full sync reads over: the refresher's own SCANs, the others MGET in parallel.",
            )
            .range(1, crate::features::feed::sync::SYNC_CONNECTIONS_MAX as i64),
            Key::new("checkpoint_interval_ms", "100", "Most time between durable positions while changes arrive."),
            Key::new("check_interval_ms", "500", "How often an idle refresher re-checks epoch, counter and stream."),
            Key::new("backoff_ms_min", "10", "First reconnect backoff; it doubles, with jitter."),
            Key::new("backoff_ms_max", "1000", "Longest reconnect backoff."),
            Key::new("breaker_failures", "5", "Consecutive failed attempts that open the Redis breaker."),
            Key::new(
                "staleness_max_ms",
                "2000",
                "Past this since a group was last known current, responses carry `features_stale`.",
            ),
            Key::new(
                "stale_policy",
                "\"not_ready\"",
                "Past `staleness_max_ms`: flag responses (`flag`), or also fail `/readyz` (`not_ready`).",
            )
            .one_of(&["flag", "not_ready"], variants::<StalePolicy>),
            Key::new(
                "initial_sync_timeout_ms",
                "30000",
                "How long start-up may spend on a first full sync when no usable replica file exists.",
            ),
            Key::new("user_storage", "\"f16\"", "How group `user`'s vectors are stored ([REPLICA.md](REPLICA.md)).")
                .one_of(&["f32", "f16", "int8"], variants::<Storage>),
            Key::new("item_storage", "\"int8\"", "How group `item`'s vectors are stored.")
                .one_of(&["f32", "f16", "int8"], variants::<Storage>),
            Key::new("user_dim", "32", "Dimension of group `user` when it has no file yet; absent: the model's input size."),
            Key::new("item_dim", "32", "Dimension of group `item` when it has no file yet; absent: the model's input size."),
            Key::new(
                "resync_shrink_max",
                "0.25",
                "A full resync whose copy would drop more than this fraction of a group's rows is held, not swapped \
                 in; from 0 to 1, and 1.0 turns the guard off.",
            ),
            Key::new("resync_shrink_max_by_group", "{ item = 0.75 }", "Per-group overrides of `resync_shrink_max`."),
            Key::new(
                "resync_rows_drift_max",
                "0.125",
                "A copy the counter moved under is used when the copy before it had as many rows within this \
                 fraction; else the source is taken to be reloading and copied again.",
            ),
            Key::new(
                "resync_attempts_max",
                "10",
                "Copies one resync makes while the source keeps moving, before it takes the last; at least 1.",
            ),
        ],
    },
    Section {
        path: "feast",
        doc: "Serve a Feast repository's feature views as feature groups, copied from its Redis online store at \
              start-up and kept fresh after ([FEATURES.md](FEATURES.md#feast)). Each served view becomes a group of its name (key type \
              and width from Feast's definitions, file `<data_dir>/<view>.qrep`), after any `[[groups]]`. Absent: \
              no Feast. Not with `[feed]` yet.",
        optional: true,
        fields: fields::<FeastConfig>,
        keys: &[
            Key::new("repo", "\"/srv/feature_repo\"", "The Feast repository: the directory of its `feature_store.yaml`.")
                .required(),
            Key::new(
                "serve",
                "[\"scoring\"]",
                "Feature services or feature views to serve; empty: every feature service of the project.",
            ),
            Key::new("candidate", "[\"item_attrs\"]", "Served views whose groups are candidate-scope."),
            Key::new(
                "redis",
                "\"redis://10.0.0.5:6379/0\"",
                "The online store as a `redis://` URL (`redis+cluster://host:port,...` for a Redis Cluster); absent: \
                 `feature_store.yaml`'s `connection_string` and `redis_type`.",
            ),
            Key::new("batch_keys", "500", "Keys per SCAN and per pipeline of HGETALL in the first sync and the follower.")
                .range(1, crate::features::feast::copy::BATCH_KEYS_MAX as i64),
            Key::new(
                "shrink_max",
                "0.25",
                "A first sync whose copy would drop more than this fraction of a populated file's rows keeps the \
                 file (held), and the follower holds removals past it of the most rows a view held; from 0 to 1.",
            ),
            Key::new(
                "follow",
                "false",
                "Follow Feast's writes after start-up (keyspace notifications and reconciliation); off: serve the \
                 start-up copy as it is.",
            ),
            Key::new(
                "notify_config",
                "false",
                "Quiver may add the flags it needs (`Kghx`) to the server's `notify-keyspace-events` with CONFIG \
                 SET; off: the operator has set them (a managed Redis without CONFIG).",
            ),
            Key::new(
                "queue_keys_max",
                "250000",
                "Keys waiting to be read after their keyspace events; past it events are dropped, counted, and a \
                 reconciliation pass finds their changes.",
            )
            .range(1, crate::features::feast::QUEUE_KEYS_MAX as i64),
            Key::new("reconcile_interval_ms", "30000", "How often a reconciliation round runs.").range(10, 86_400_000),
            Key::new(
                "reconcile_keys_max",
                "50000",
                "Keys of Redis one reconciliation round compares at most, and replica rows its sweep checks at most.",
            )
                .range(1, 10_000_000),
        ],
    },
    Section {
        path: "tls",
        doc: "The scoring port speaks TLS only ([OPERATING.md](OPERATING.md#tls-on-the-scoring-port)). Absent: \
              plain TCP. `quiver serve --tls-cert FILE --tls-key FILE` adds it.",
        optional: true,
        fields: fields::<ServerTls>,
        keys: &[
            Key::new("cert_file", "\"/etc/quiver/server.crt\"", "PEM certificate chain, the server's own first.")
                .required(),
            Key::new("key_file", "\"/etc/quiver/server.key\"", "Its PEM private key (PKCS#8, PKCS#1 or SEC1).")
                .required(),
            Key::new(
                "client_ca_file",
                "\"/etc/quiver/clients-ca.crt\"",
                "Mutual TLS: clients need a certificate this CA signed; absent: any client may connect.",
            ),
            Key::new(
                "handshake_timeout_ms",
                "1000",
                "A connection that has not finished its handshake by then is closed.",
            )
            .range(1, crate::tls::HANDSHAKE_TIMEOUT_MS_MAX as i64),
            Key::new(
                "handshakes_per_s_max",
                "100",
                "New handshakes a shard starts per second after `handshake_burst`; over it, a connection is closed \
                 before its handshake. Open connections are never affected.",
            )
            .range(1, 1_000_000),
            Key::new("handshake_burst", "50", "Handshakes a shard starts at once before the rate applies.")
                .range(1, 1_000_000),
        ],
    },
    Section {
        path: "log",
        doc: "The decision log: a sample of decisions (keys, the input rows the kernel saw, scores, tier, \
              times) written off the request path as Arrow IPC segment files \
              ([OPERATING.md](OPERATING.md#decision-logs)). On when `dir` is set (at rate 0 too, so that \
              `POST /log` can change the sampling at run time: the rates, `key_group`, `always` and \
              `always_log_shadow_diff`).",
        optional: false,
        fields: fields::<LogConfig>,
        keys: &[
            Key::new(
                "dir",
                "\"/var/lib/quiver/decisions\"",
                "Where segments are written (created if absent); required when anything is logged. One server per \
                 directory: `.tmp` segments left there are deleted at start.",
            ),
            Key::new(
                "sample_rate",
                "0.1",
                "Share of decisions logged, 0 to 1, kept to a millionth; 0 logs none but those `always` names.",
            ),
            Key::new(
                "model_sample_rates",
                "{ ranker = 0.5 }",
                "A model's own share, 0 to 1, in place of `sample_rate`, by model name (at most 256); a name no model is \
                 served under is a warning at start-up, and its rate applies once one is.",
            ),
            Key::new(
                "client_sample_rates",
                "{ \"7\" = 1.0 }",
                "A client's own share, 0 to 1, by client id (quoted: TOML keys are strings), in place of the \
                 model's and `sample_rate` (at most 256).",
            ),
            Key::new(
                "key_group",
                "\"user\"",
                "A request-scope group whose key decides the sample, sticky: `xxh3(key) mod 1e6 < rate × 1e6`, so a \
                 key has all its decisions logged or none. Absent: the request id decides (uniform).",
            ),
            Key::new(
                "ring_bytes",
                "33554432",
                "Bytes of each shard's ring, allocated at start-up; a decision that does not fit is dropped and \
                 counted (`quiver_log_dropped_total{reason=\"ring_full\"}`), never waited for.",
            )
            .range(RING_BYTES_MIN as i64, RING_BYTES_MAX as i64),
            Key::new("segment_bytes_max", "134217728", "A segment is closed and renamed into place at this size.")
                .range(SEGMENT_BYTES_MIN as i64, SEGMENT_BYTES_MAX as i64),
            Key::new(
                "segment_age_s",
                "600",
                "A segment is closed at this age: the most of a shard's decisions a `kill -9` loses.",
            )
            .range(1, SEGMENT_AGE_S_MAX as i64),
            Key::new(
                "retention_bytes_max",
                "10737418240",
                "The oldest segments are deleted while the closed ones hold more; at least `segment_bytes_max`.",
            ),
            Key::new(
                "always",
                "[\"non_primary\", \"errors\"]",
                "Decisions logged whatever the sample: `non_primary` (answered by the cache, the fallback or the \
                 static default), `errors` (any status but `Ok`: refused, timed out or failed, before or after a model \
                 was chosen).",
            ),
            Key::new(
                "always_log_shadow_diff",
                "0.1",
                "A decision a shadow version scored is logged whatever the sample when, for some candidate, \
                 |returned score − shadow score| exceeds this (`always = \"shadow_diff\"` in its record, with the \
                 shadow's scores). Absent: no decision is logged for its shadow.",
            ),
            Key::new(
                "writer_priority",
                "\"normal\"",
                "How the writer thread is scheduled: `idle` (the default; `SCHED_IDLE`: it runs only on time no other thread of \
                 its core wants, so it never delays a shard, and falls behind, dropping and counting, when there is \
                 none) or `normal` (the default policy, competing as an equal: for housekeeping cores too busy to \
                 leave it time).",
            ),
        ],
    },
    Section {
        path: "oip",
        doc: "The Open Inference Protocol (KServe v2) over gRPC and HTTP/REST, beside the FlatBuffers port, for \
              Triton's clients, perf_analyzer and KServe ([PROTOCOL.md](PROTOCOL.md#open-inference-protocol-kserve-v2)). \
              Its own threads turn each request into a FlatBuffers one sent to the shards over the scoring port, \
              so admission, deadlines and the ladder are the same. Off unless a listener is set; refused beside \
              `[tls]`.",
        optional: false,
        fields: fields::<OipConfig>,
        keys: &[
            Key::new("grpc_listen", "\"127.0.0.1:8001\"", "The gRPC listener (`inference.GRPCInferenceService`); \"off\" disables it."),
            Key::new("http_listen", "\"127.0.0.1:8000\"", "The HTTP/REST listener (`/v2/...`, JSON and binary tensors); \"off\" disables it."),
            Key::new("threads", "2", "Worker threads of the front end, shared by both listeners, on the housekeeping cores.")
                .range(1, crate::oip::THREADS_MAX as i64),
            Key::new("connections_max", "512", "Connections each listener holds; one more is closed at once.")
                .range(1, 1 << 16),
            Key::new("streams_per_connection_max", "64", "Concurrent gRPC streams on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).")
                .range(1, 1 << 16),
            Key::new(
                "message_bytes_max",
                "8388608",
                "The largest request: a gRPC message (RESOURCE_EXHAUSTED over it) or an HTTP body (413).",
            )
            .range(1024, crate::oip::MESSAGE_BYTES_LIMIT as i64),
            Key::new("tensor_elements_max", "16384", "Most elements of one input tensor; more is INVALID_ARGUMENT (HTTP 400).")
                .range(1, 1 << 24),
            Key::new(
                "upstream_connections",
                "4",
                "Connections from the front end to the shards (loopback, counted against \
                 `limits.connections_per_source_max`); 0: two per shard.",
            )
            .range(0, crate::oip::UPSTREAM_CONNECTIONS_MAX as i64),
            Key::new("in_flight_max", "1024", "Requests in flight to the shards; one more is UNAVAILABLE (HTTP 503) at once.")
                .range(1, 1 << 20),
            Key::new(
                "grace_ms",
                "50",
                "How long a request waits for its shard beyond its budget before it is DEADLINE_EXCEEDED (HTTP 504).",
            )
            .range(0, 60_000),
        ],
    },
];

/// Sections written as arrays of tables (`[[groups]]`): the configs built
/// here hold one entry, and [`lookup`] reads the first.
pub const ARRAY_SECTIONS: &[&str] = &["groups"];

/// A section's header line: `[path]`, or `[[path]]` for an array of tables.
pub fn table_header(path: &str) -> String {
    if ARRAY_SECTIONS.contains(&path) {
        format!("[[{}]]", table_path(path))
    } else {
        format!("[{}]", table_path(path))
    }
}

/// The id that stands for `<id>` in the configs built here.
const ID_EXAMPLE: &str = "7";

/// `path` as a config file writes it, with `<id>` filled in.
pub fn table_path(path: &str) -> String {
    path.replace("<id>", ID_EXAMPLE)
}

/// A config holding each optional table with its required keys and nothing
/// else: parsed, it carries every default, optional tables' included.
pub fn required_only() -> String {
    config_text(|_, key| key.required)
}

/// A config setting every key to its example value: the tests parse it, and
/// the page shows it.
pub fn every_key() -> String {
    config_text(|_, _| true)
}

fn config_text(include: impl Fn(&Section, &Key) -> bool) -> String {
    let mut text = String::new();
    for section in SECTIONS {
        let keys: Vec<&Key> = section.keys.iter().filter(|k| include(section, k)).collect();
        if !section.path.is_empty() && (keys.is_empty() && !section.optional) {
            continue;
        }
        if !section.path.is_empty() {
            text.push_str(&format!("\n{}\n", table_header(section.path)));
        }
        for key in &keys {
            text.push_str(&format!("{} = {}\n", key.name, key.example));
        }
        // A group's example names a parent group: it must be configured too.
        if section.path == "groups" && keys.iter().any(|k| k.name == "parent") {
            text.push_str(
                "\n# The parent the example above names.\n[[groups]]\nname = \"campaign\"\nscope = \"candidate\"\n",
            );
        }
    }
    text
}

/// Every default, by table path and key: the config with only the required
/// keys, parsed by the server's own parser and serialized back.
fn defaults() -> toml::Table {
    let config = Config::parse(&required_only(), "required keys").expect("the required keys parse");
    toml::Table::try_from(&config).expect("a config serializes")
}

/// The value at `path` (`"ladder.breaker"`) and `key` in `table`.
pub fn lookup<'a>(table: &'a toml::Table, path: &str, key: &str) -> Option<&'a toml::Value> {
    let mut at = table;
    for part in table_path(path).split('.').filter(|p| !p.is_empty()) {
        at = match at.get(part)? {
            toml::Value::Array(entries) => entries.first()?.as_table()?,
            value => value.as_table()?,
        };
    }
    at.get(key)
}

/// A value as one line of TOML (tables inline).
pub fn inline(value: &toml::Value) -> String {
    match value {
        toml::Value::Table(t) if t.is_empty() => "{}".into(),
        toml::Value::Table(t) => {
            let entries: Vec<String> =
                t.iter().map(|(k, v)| format!("{} = {}", bare_or_quoted(k), inline(v))).collect();
            format!("{{ {} }}", entries.join(", "))
        }
        toml::Value::Array(a) => format!("[{}]", a.iter().map(inline).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    }
}

fn bare_or_quoted(key: &str) -> String {
    if !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        key.into()
    } else {
        toml::Value::String(key.into()).to_string()
    }
}

/// The name of a value's type, as the page shows it.
pub fn type_name(value: &toml::Value) -> String {
    match value {
        toml::Value::String(_) => "string".into(),
        toml::Value::Integer(_) => "integer".into(),
        toml::Value::Float(_) => "float".into(),
        toml::Value::Boolean(_) => "boolean".into(),
        toml::Value::Datetime(_) => "datetime".into(),
        toml::Value::Array(a) => match a.first() {
            Some(v) => format!("array of {}s", type_name(v)),
            None => "array".into(),
        },
        toml::Value::Table(t) => match t.values().next() {
            Some(v) => format!("table of {}s", type_name(v)),
            None => "table".into(),
        },
    }
}

/// A key's example, parsed as the value of a TOML key.
pub fn example_value(key: &Key) -> toml::Value {
    let table: toml::Table = toml::from_str(&format!("v = {}", key.example)).expect("an example is one TOML value");
    table["v"].clone()
}

/// docs/CONFIGURATION.md.
pub fn render() -> String {
    let defaults = defaults();
    let mut out = String::new();
    let mut w = |line: &str| {
        out.push_str(line);
        out.push('\n');
    };
    w("# Configuration reference");
    w("");
    w("<!-- Generated by src/config/reference.rs; edit the descriptions there. tests/generated.rs fails when this");
    w("     page and the code differ; `QUIVER_BLESS=1 cargo test --release --test generated` rewrites it. -->");
    w("");
    w("`quiver serve --config FILE` reads one TOML file that holds every limit. Every key is optional unless");
    w("marked required, an empty file (or none) is the defaults, and an unknown key is an error, so a typo never");
    w("falls back to a default unsaid. Defaults below are read from the code; \"absent\" means the key has no");
    w("value unless written, and its description says what that does. Ranges are checked at start-up, which");
    w("refuses a value outside them naming the key.");
    w("");
    for section in SECTIONS {
        if section.path.is_empty() {
            w("## Top level");
        } else {
            w(&format!("## `{}`", table_header(section.path)));
        }
        w("");
        w(&format!("{}{}", section.doc, if section.optional { " The table is absent unless written." } else { "" }));
        w("");
        w("| key | type | default | |");
        w("|---|---|---|---|");
        for key in section.keys {
            let mut kind = type_name(&example_value(key));
            if !key.choices.is_empty() {
                let names: Vec<String> = key.choices.iter().map(|c| format!("`\"{c}\"`")).collect();
                kind = format!("{kind}: {}", names.join(", "));
            }
            if let Some((lo, hi)) = key.range {
                kind = format!("{kind}, {lo}..={hi}");
            }
            let default = if key.required {
                "required".to_string()
            } else {
                match lookup(&defaults, section.path, key.name) {
                    Some(v) => format!("`{}`", inline(v)),
                    None => "absent".into(),
                }
            };
            w(&format!("| `{}` | {kind} | {default} | {} |", key.name, key.doc));
        }
        w("");
    }
    w("## Every key at once");
    w("");
    w("Every key set to an example value (not its default), `<id>` as client 7; the tests parse this config.");
    w("");
    w("```toml");
    w(every_key().trim());
    w("```");
    out
}

/// The keys serde accepts in `T`'s table: its derived `Deserialize` hands
/// them to `deserialize_struct` before it reads anything.
pub fn fields<T: DeserializeOwned>() -> &'static [&'static str] {
    names::<T>()
}

/// The names serde accepts for the enum `T` (with `rename_all` applied,
/// and only the variants this build compiles).
pub fn variants<T: DeserializeOwned>() -> &'static [&'static str] {
    names::<T>()
}

fn names<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut names = Names(None);
    let _refused = T::deserialize(&mut names);
    names.0.unwrap_or_else(|| panic!("{} is not a struct or enum with derived Deserialize", std::any::type_name::<T>()))
}

/// A deserializer that reads nothing: it records the field or variant
/// names a derived `Deserialize` passes it, and refuses.
struct Names(Option<&'static [&'static str]>);

impl<'de> serde::Deserializer<'de> for &mut Names {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom("only struct and enum names are read"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        self.0 = Some(fields);
        Err(serde::de::Error::custom("names read"))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        self.0 = Some(variants);
        Err(serde::de::Error::custom("names read"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct map identifier ignored_any
    }
}
