//! The composition root: a [`Config`] becomes a running server.
//!
//! [`run`] places shards and the stage on cores, opens the replicas (and the
//! Redis feed), loads the models, starts the metrics collector, the admin
//! listeners, the model watcher and the inference stage, serves until `stop`
//! is set, then stops everything in order and returns each shard's report.
//! It installs no signal handler and prints nothing: the caller owns the
//! process (`main.rs` turns signals into `stop` and events into the lines
//! scripts wait for), so tests can run a server in-process.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::admin::{auth::AdminToken, Admin, AdminState, Surface};
use crate::config::{Config, InferenceMode};
use crate::features::feed;
use crate::features::groups::Group;
use crate::features::replica::ReplicaHandle;
use crate::infer::Faults;
use crate::infer::{self, StageConfig};
use crate::metrics::{self, Readiness};
use crate::model::Model;
use crate::registry::{Fit, Registry};
use crate::request::{Shared, SharedGroup};
use crate::shard::{self, ShardPlacement, ShardReport};
use crate::wire::Status;
use crate::Error;

/// What a starting server reports as it comes up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// An admin listener (`what`: "admin" or "metrics") is bound.
    Listening { what: &'static str, addr: SocketAddr },
    /// Every shard listens on `addr`: requests are served from now on,
    /// over TLS when `tls`.
    Serving { addr: SocketAddr, shards: usize, tls: bool },
}

type Features = (Vec<SharedGroup>, Option<feed::Feed>);

/// What `[feast]` comes to at start-up: its views' `[[groups]]` entries,
/// their status for `/metrics`, each view's ttl, and, when it follows
/// Redis, the writers' handles the groups are served through and the
/// follower to start.
#[derive(Default)]
struct FeastStart {
    groups: Vec<crate::features::groups::GroupConfig>,
    status: Option<Arc<crate::features::feast::FeastStatus>>,
    ttl_s: std::collections::HashMap<String, u64>,
    handles: std::collections::HashMap<String, Arc<ReplicaHandle>>,
    follower: Option<crate::features::feast::Follower>,
}

/// `[feast]`: reads the repository and brings each served view's file
/// `<data_dir>/<view>.qrep` up to date: when every file was written for
/// these definitions (the digest in its checkpoint) and the follower runs,
/// it resumes from them (its first reconciliation pass re-reads what moved
/// meanwhile), else it copies them from Redis (a view whose copy is held
/// keeps the file it has). An emptied Redis is held either way. A Redis
/// that cannot be reached leaves the files as they are, and start-up serves
/// them if they are there (it fails naming the file if not); the follower
/// reconnects. Keyspace notifications the server will not send fail
/// start-up, naming the setting.
fn feast_start(config: &Config, feast: &crate::features::feast::FeastConfig) -> Result<FeastStart, Error> {
    use std::sync::atomic::Ordering::Relaxed;

    use crate::features::feast::{self, follow, repo, rows};
    if config.feed.is_some() {
        return Err(Error::Setup(
            "[feast] and [feed] together: the feed follows Quiver's own Redis contract, Feast's views are copied \
             at start-up; serve them from separate servers for now"
                .into(),
        ));
    }
    let (repo, plan, groups) = feast.groups()?;
    let url = match (&feast.redis, &repo.online_store) {
        (Some(url), _) => url.clone(),
        (None, Some(store)) => repo::redis_url(store)?,
        (None, None) => {
            return Err(Error::Setup("[feast]: feature_store.yaml names no online store; set feast.redis".into()))
        }
    };
    let source = feed::redis_cluster::RedisSource::from_url(&url).map_err(feed::FeedError::from)?;
    let options = feast::SyncOptions {
        data_dir: config.data_dir.clone(),
        batch_keys: feast.batch_keys,
        shrink_max: feast.shrink_max,
        accept_shrink: false,
    };
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|e| Error::Setup(format!("{}: {e}", config.data_dir.display())))?;
    let status = Arc::new(feast::FeastStatus::new(&plan));
    let path_of = |view: &str| config.data_dir.join(format!("{view}.qrep"));
    // Rows of each view's file, when it was written for these definitions.
    let digest = rows::plan_digest(&repo, &plan);
    let resumable: Option<Vec<u64>> = plan
        .views
        .iter()
        .map(|v| {
            let file = ReplicaHandle::open(&path_of(&v.name), &v.name).ok()?;
            (file.load().cursor_at_open().epoch == digest).then(|| file.live_rows())
        })
        .collect();
    let resumable = resumable.filter(|_| feast.follow);
    let synced = feast::Store::connect(&source).and_then(|mut conn| {
        if feast.follow {
            // On a cluster, each master sends its own keys' notifications.
            for m in conn.masters() {
                follow::enable_notifications(conn.node(&m)?, feast.notify_config)?;
            }
        }
        match &resumable {
            Some(rows) => {
                // Nothing is copied: a Redis holding far fewer keys than the
                // files rows was emptied, and the files are held.
                let keys = conn.keys()?;
                for ((v, s), &rows) in plan.views.iter().zip(&status.views).zip(rows) {
                    let held = rows > 0 && (keys as f64) < (1.0 - feast.shrink_max) * rows as f64;
                    s.resumed.store(true, Relaxed);
                    s.held.store(held, Relaxed);
                    if held {
                        tracing::error!(
                            view = %v.name, keys, served = rows,
                            "feast: redis holds far fewer keys than the file rows: held, the file is kept"
                        );
                    }
                }
                tracing::info!(
                    views = plan.views.len(),
                    "feast: resuming from the replica files written for these definitions: no full copy"
                );
                Ok(())
            }
            None => {
                let report = feast::first_sync(&mut conn, &repo, &plan, &options)?;
                for (v, s) in report.views.iter().zip(&status.views) {
                    tracing::info!(
                        view = %v.view, rows = v.rows, skipped = v.skipped, values_missing = v.values_missing,
                        held = v.held, "feast: first sync"
                    );
                    s.rows_copied.store(v.rows, Relaxed);
                    s.values_missing.store(v.values_missing, Relaxed);
                    s.skipped_total.store(v.skipped, Relaxed);
                    s.held.store(v.held, Relaxed);
                }
                Ok(())
            }
        }
    });
    match synced {
        Ok(()) => {}
        Err(e @ (feast::FeastError::Redis(_) | feast::FeastError::Cluster(_))) => {
            tracing::error!(
                "feast: redis cannot be read ({e}); serving the files already in {}",
                config.data_dir.display()
            );
        }
        Err(e) => return Err(e.into()),
    }
    let ttl_s = plan.views.iter().map(|v| (v.name.clone(), v.ttl_s)).collect();
    let mut start = FeastStart { groups, status: Some(status.clone()), ttl_s, ..FeastStart::default() };
    if feast.follow {
        let mut writers = Vec::with_capacity(plan.views.len());
        for (v, s) in plan.views.iter().zip(&status.views) {
            let (mut writer, _) = crate::features::replica::ReplicaWriter::open(&path_of(&v.name), &v.name)
                .map_err(|e| Error::Setup(format!("[feast] view '{}': {e}", v.name)))?;
            start.handles.insert(v.name.clone(), writer.handle());
            s.live_rows.store(writer.live_rows(), Relaxed);
            writers.push(writer);
        }
        start.follower = Some(feast::Follower::new(feast, source, &repo, &plan, writers, status));
    } else {
        for (v, s) in plan.views.iter().zip(&status.views) {
            if let Ok(file) = ReplicaHandle::open(&path_of(&v.name), &v.name) {
                s.live_rows.store(file.live_rows(), Relaxed);
            }
        }
    }
    Ok(start)
}

/// Every feature group's replica: read-only files, or files the Redis feed
/// keeps current (then also the running feed). Each file must hold the
/// key type and width its group is configured with.
fn open_features(
    config: &Config,
    groups: &[Group],
    feast: &FeastStart,
    stop: &Arc<AtomicBool>,
) -> Result<Features, Error> {
    let read_only = || -> Result<Vec<SharedGroup>, Error> {
        groups
            .iter()
            .map(|g| {
                let ttl_s = feast.ttl_s.get(&g.name).copied();
                match feast.handles.get(&g.name) {
                    Some(handle) => checked(g, handle.clone(), ttl_s),
                    None => checked(g, ReplicaHandle::open_serving(&g.path, &g.name)?, ttl_s),
                }
            })
            .collect()
    };
    let Some(feed_config) = &config.feed else {
        return Ok((read_only()?, None));
    };
    // A group with no file yet is created with the width the model reads.
    let model = if config.models_dir.is_none() { Model::load(&config.model_path()).ok() } else { None };
    let model_dim = |name: &str| {
        let seg = model.as_ref()?.inputs.iter().find(|s| s.source.group().is_some_and(|(n, _)| n == name))?;
        u32::try_from(seg.dim).ok()
    };
    let specs: Vec<feed::GroupSpec> = groups
        .iter()
        .map(|g| feed::GroupSpec {
            name: g.name.clone(),
            path: g.path.clone(),
            dim: g.width.or_else(|| model_dim(&g.name)),
            key: g.key,
            storage: g.storage,
            default: g.default.clone(),
            link: g.parent.as_ref().map(|(_, kind)| *kind),
        })
        .collect();
    let started = match feed::start(feed_config, &specs, stop.clone()) {
        Ok(started) => started,
        // The files are there to serve, only not to write: stale features
        // beat no node. Without them there is nothing to serve.
        Err(e) if e.is_read_only() => {
            let served = read_only()?;
            tracing::error!(
                error = %e,
                "the data directory cannot be written: serving its replica files as they are, not following \
                 redis (features go stale until it is writable and the server restarts)"
            );
            return Ok((served, None));
        }
        Err(e) => return Err(e.into()),
    };
    let served =
        groups.iter().zip(&started.handles).map(|(g, h)| checked(g, h.clone(), None)).collect::<Result<Vec<_>, _>>()?;
    Ok((served, Some(started)))
}

/// `handle` as group `g` serves it, once its file is seen to hold `g`'s key
/// type and width. `feast_ttl_s`: `g` is a Feast view with this ttl (0:
/// none), whose rows' links hold their event times (files written before
/// they did have none, and serve without a ttl).
fn checked(g: &Group, handle: Arc<ReplicaHandle>, feast_ttl_s: Option<u64>) -> Result<SharedGroup, Error> {
    let path = g.path.display();
    if handle.key_kind() != g.key {
        return Err(Error::Setup(format!(
            "group '{}' is configured with {}, its replica {path} holds {}",
            g.name,
            g.key,
            handle.key_kind()
        )));
    }
    if let Some(w) = g.width.filter(|&w| w as usize != handle.dim()) {
        return Err(Error::Setup(format!(
            "group '{}' is configured {w} wide, its replica {path} is {} wide",
            g.name,
            handle.dim()
        )));
    }
    if let Some(ttl_s) = feast_ttl_s {
        let timed = handle.link_kind() == Some(crate::features::feast::rows::ROW_TIME_LINK);
        if !timed && handle.link_kind().is_some() {
            return Err(Error::Setup(format!("Feast view '{}': its replica {path} links rows to a parent", g.name)));
        }
        let ttl_s = if timed { ttl_s } else { 0 };
        return Ok(SharedGroup {
            name: g.name.clone(),
            scope: g.scope,
            absent: g.absent,
            handle,
            child: None,
            ttl_s,
            nulls_missing: true,
        });
    }
    let link = g.parent.as_ref().map(|(_, kind)| *kind);
    if handle.link_kind() != link {
        let holds = match handle.link_kind() {
            Some(kind) => format!("links to a parent with {kind}"),
            None => "no links to a parent".into(),
        };
        return Err(Error::Setup(match &g.parent {
            Some((parent, kind)) => format!(
                "group '{}' links to its parent '{parent}' ({kind}), its replica {path} holds {holds}: rebuild it (quiver replica build --parent-key-bytes, or a sync)",
                g.name
            ),
            None => format!("group '{}' has no parent, its replica {path} holds {holds}", g.name),
        }));
    }
    Ok(SharedGroup {
        name: g.name.clone(),
        scope: g.scope,
        absent: g.absent,
        handle,
        child: g.child.clone(),
        ttl_s: 0,
        nulls_missing: false,
    })
}

/// `addr` as a client reaches it: an unspecified address (0.0.0.0, ::)
/// through loopback.
fn loopback(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::from(([127, 0, 0, 1], addr.port())),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port()))
        }
        _ => addr,
    }
}

/// Serves `config` until `stop` is set; `on_event` hears of each listener
/// as it binds. Returns each shard's report once everything has stopped.
pub fn run(config: Config, stop: Arc<AtomicBool>, mut on_event: impl FnMut(Event)) -> Result<Vec<ShardReport>, Error> {
    if config.oip.enabled() && config.tls.is_some() {
        return Err(Error::Config(crate::config::ConfigError::Invalid(crate::config::OIP_WITH_TLS.into())));
    }
    // First, so a certificate problem is told before anything else starts.
    let tls = match &config.tls {
        None => None,
        Some(t) => Some(shard::ListenerTls {
            config: crate::tls::server_config(t).map_err(|e| Error::Setup(format!("[tls]: {e}")))?,
            handshake_timeout: Duration::from_millis(t.handshake_timeout_ms),
            handshakes_per_s_max: t.handshakes_per_s_max,
            handshake_burst: t.handshake_burst,
        }),
    };
    // The cores `taskset` (or a cgroup) allows; shards default to one each.
    let allowed = crate::cores::allowed();
    let cores: Vec<usize> = if !config.cores.is_empty() {
        config.cores.clone()
    } else {
        let n = if config.shards == 0 { allowed.len() } else { config.shards };
        (0..n).map(|i| allowed[i % allowed.len()]).collect()
    };

    // Every thread but the shards and the inference stage runs on the
    // housekeeping cores: pin this thread before it starts any of them.
    let stage_core = match config.inference {
        InferenceMode::Inline => None,
        InferenceMode::Thread => config.stage.core.or_else(|| allowed.iter().copied().find(|c| !cores.contains(c))),
    };
    let busy: Vec<usize> = cores.iter().copied().chain(stage_core).collect();
    let housekeeping =
        config.reactor.housekeeping_cores.clone().unwrap_or_else(|| crate::cores::spare(&allowed, &busy));
    if housekeeping.is_empty() {
        tracing::info!("no spare core for housekeeping threads: they run unpinned, beside the shards");
    } else {
        if housekeeping.iter().any(|c| busy.contains(c)) {
            tracing::warn!(?housekeeping, shards = ?cores, ?stage_core, "housekeeping cores overlap shard or stage cores");
        }
        crate::cores::pin_current_thread(&housekeeping)
            .map_err(|e| Error::Setup(format!("pinning housekeeping threads to cores {housekeeping:?}: {e}")))?;
        tracing::info!(?housekeeping, "housekeeping threads pinned");
    }

    crate::features::replica::lock_pages(config.replica_lock);
    crate::features::replica::huge_pages(config.replica_huge_pages);
    if let Some(lib) = &config.onnxruntime_lib {
        crate::score::configure_onnxruntime(lib);
    }
    let kernel = crate::score::cpu::configure_kernel(config.kernel)
        .map_err(|e| Error::Setup(format!("kernel = {:?}: {e}", config.kernel)))?;
    tracing::info!(kernel = kernel.name(), requested = ?config.kernel, "INT8 kernel");
    let mut feast = match &config.feast {
        Some(feast) => feast_start(&config, feast)?,
        None => FeastStart::default(),
    };
    let groups =
        config.groups_with(&feast.groups).map_err(|e| Error::Config(crate::config::ConfigError::Invalid(e)))?;
    config.check_canary_group(&groups).map_err(|e| Error::Config(crate::config::ConfigError::Invalid(e)))?;
    config.check_log_key_group(&groups).map_err(|e| Error::Config(crate::config::ConfigError::Invalid(e)))?;
    let (groups, feed) = open_features(&config, &groups, &feast, &stop)?;
    let feast_thread = match feast.follower.take() {
        Some(follower) => {
            Some(follower.spawn(stop.clone()).map_err(|e| Error::Setup(format!("quiver-feast thread: {e}")))?)
        }
        None => None,
    };
    let fit =
        Fit { groups: groups.iter().map(SharedGroup::fit).collect(), context_len_max: config.limits.context_len_max };
    let rows_max = config.limits.candidates_max;
    let registry = Arc::new(
        match &config.models_dir {
            Some(dir) => Registry::open(dir, config.default_model.as_deref(), fit, config.backend, rows_max)?,
            None => Registry::single(&config.model_path(), fit, config.backend, rows_max)?,
        }
        .with_drift(config.drift.clone())
        .with_shards(cores.len()),
    );
    for m in registry.status() {
        tracing::info!(model = %m.name, version = m.version, "model loaded");
    }
    let fallback_path = config.ladder.fallback_model.clone().or_else(|| {
        let p = config.data_dir.join("fallback.qm");
        p.exists().then_some(p)
    });
    let fallback = match fallback_path {
        Some(p) => {
            let m = Model::load(&p)?;
            tracing::info!(model = %m.name, version = m.version, "fallback model loaded");
            Some(Arc::new(m))
        }
        None => {
            tracing::info!("no fallback model: requests that cannot reach the primary get the static default");
            None
        }
    };
    let faults = Arc::new(Faults::default());
    for g in &groups {
        tracing::info!(group = %g.name, rows = g.handle.live_rows(), width = g.handle.dim(), keys = %g.handle.key_kind(), "replica loaded");
    }
    tracing::info!(backend = ?config.backend, redis = feed.is_some(), groups = groups.len(), "replicas loaded");
    let readiness = Arc::new(Readiness::not_ready());
    if let Some(f) = &feed {
        readiness.attach_feed(f.status.clone());
    }
    let board = metrics::board(cores.len());
    let (collector, publishers) =
        metrics::Collector::start(board.clone()).map_err(|e| Error::Setup(format!("metrics collector thread: {e}")))?;
    // The decision log: one ring per shard, allocated now, and the writer
    // thread on the housekeeping cores.
    let log_status = Arc::new(crate::decision_log::LogStatus::default());
    let (log_rings, log_writer) = if config.log.runs() {
        let rings = crate::decision_log::LogRings::new(&config.log, cores.len());
        rings.sampling.know_groups(groups.iter().map(|g| (g.name.as_str(), g.scope)));
        let _ = log_status.sampling.set(rings.sampling.clone());
        let consumers = rings.consumers().expect("the rings were made just now: no consumer was taken");
        let writer = crate::decision_log::writer::Writer::start(&config.log, consumers, log_status.clone())
            .map_err(|e| Error::Setup(format!("decision-log writer thread: {e}")))?;
        let dir = config.log.dir.as_deref().unwrap_or(std::path::Path::new("")).display().to_string();
        tracing::info!(
            %dir,
            sample_rate = config.log.sample_rate,
            key_group = config.log.key_group.as_deref().unwrap_or("(request id)"),
            always = ?config.log.always,
            "decision log on"
        );
        for model in config.log.model_sample_rates.keys().filter(|m| !registry.serves(m)) {
            tracing::warn!(
                %model,
                "log.model_sample_rates names a model that is not served: its rate applies once one of that name is"
            );
        }
        (Some(rings), Some(writer))
    } else {
        (None, None)
    };
    let token = match &config.admin_token_file {
        Some(path) => Some(AdminToken::load(path).map_err(Error::Setup)?),
        None => None,
    };
    let oip_counters = config.oip.enabled().then(|| Arc::new(crate::metrics::OipCounters::default()));
    let admin_state = Arc::new(AdminState {
        board: board.clone(),
        readiness: readiness.clone(),
        registry: registry.clone(),
        backend: format!("{:?}", config.backend).to_lowercase(),
        kernel: kernel.name(),
        faults: config.faults_endpoint.then(|| faults.clone()),
        token,
        refusals: Default::default(),
        http: Default::default(),
        groups: groups.clone(),
        decision_log: log_writer.is_some().then(|| log_status.clone()),
        feast: feast.status.clone(),
        oip: oip_counters.clone(),
    });
    let mut admins = Vec::new();
    for (listen, surface, name) in
        [(&config.admin_listen, Surface::Control, "admin"), (&config.metrics_listen, Surface::ReadOnly, "metrics")]
    {
        if listen != "off" {
            let admin = Admin::start(listen, surface, admin_state.clone(), config.admin_token_over_plaintext)?;
            tracing::info!(addr = %admin.addr, controls = surface == Surface::Control, "{name} endpoint");
            on_event(Event::Listening { what: name, addr: admin.addr });
            admins.push(admin);
        }
    }
    let watcher = (config.watch_models_ms > 0).then(|| {
        let (registry, stop) = (registry.clone(), stop.clone());
        let every = Duration::from_millis(config.watch_models_ms);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                registry.load_newer();
                std::thread::sleep(every);
            }
        })
    });
    // The shard cores the stage thread also runs on: pinned to one, that
    // one; unpinned with no spare core, all of them.
    let stage_shares: Vec<usize> = match (config.inference, stage_core) {
        (InferenceMode::Inline, _) => Vec::new(),
        (InferenceMode::Thread, Some(c)) => cores.iter().copied().filter(|&s| s == c).collect(),
        (InferenceMode::Thread, None) if allowed.iter().all(|c| cores.contains(c)) => cores.clone(),
        (InferenceMode::Thread, None) => Vec::new(),
    };
    let stage = match config.inference {
        InferenceMode::Inline => None,
        InferenceMode::Thread => {
            let row_dim_max = registry.snapshot().models.iter().map(|m| m.input_dim()).max().unwrap_or(0);
            let stage_config = StageConfig {
                batch_rows_max: config.stage.batch_rows_max.max(1),
                batch_wait_us_max: config.stage.batch_wait_us_max,
                spin_us: config.stage.spin_us,
                jobs_per_shard_max: config.stage.jobs_per_shard_max.clamp(2, 1 << 16),
                rows_per_job_max: rows_max,
                // Sized for the models served at start; a wider version
                // loaded later is scored inline (see RequestPath::handle).
                row_dim_max,
                core: stage_core,
                shares_core: !stage_shares.is_empty(),
            };
            let started = infer::start(stage_config, cores.len(), registry.clone(), config.backend, faults.clone())
                .map_err(|e| Error::Setup(format!("starting the inference thread: {e}")))?;
            tracing::info!(?stage_config, "inference stage started");
            Some(started)
        }
    };
    let (stage, stage_ends) = match stage {
        Some((s, ends)) => (Some(s), ends),
        None => (None, Vec::new()),
    };
    let shared = Shared {
        registry,
        groups,
        canary_group: config.canary_group.clone(),
        feed: feed.as_ref().map(|f| f.status.clone()),
        limits: config.limits.clone(),
        backend: config.backend,
        floor: config.floor,
        readiness: readiness.clone(),
        admission: config.admission.clone(),
        client_usage: Arc::new(crate::request::admission::ClientUsage::new(&config.admission, cores.len())),
        ladder: config.ladder.clone(),
        cache: config.cache.clone(),
        shed: config.shed.clone(),
        fallback,
        shards: cores.len(),
        decision_log: log_rings,
    };
    let listen = shard::resolve_listen(&config.listen)?;
    // The v2 listeners are bound now, so an address in use fails start-up;
    // they are served once the shards are, through the shards' own port.
    let mut oip = if config.oip.enabled() {
        config.oip.validate().map_err(|e| Error::Config(crate::config::ConfigError::Invalid(e)))?;
        let upstream = config.oip.upstream_connections_for(cores.len());
        if upstream > config.limits.connections_per_source_max {
            return Err(Error::Setup(format!(
                "oip: {upstream} connections to the shards, over limits.connections_per_source_max ({}): \
                 they all come from loopback",
                config.limits.connections_per_source_max
            )));
        }
        let bound = crate::oip::Bound::bind(&config.oip).map_err(|e| Error::Setup(e.to_string()))?;
        for (what, addr) in [("oip-grpc", bound.grpc_addr()), ("oip-http", bound.http_addr())] {
            if let Some(addr) = addr {
                tracing::info!(%addr, "{what} endpoint");
                on_event(Event::Listening { what, addr });
            }
        }
        let context = (shared.registry.clone(), shared.groups.clone(), readiness.clone());
        Some((bound, context))
    } else {
        None
    };
    let mut frontend = None;

    let shards = cores.len();
    let serves_tls = tls.is_some();
    let placement = ShardPlacement {
        listen,
        cores,
        not_ready: config.not_ready,
        reactor: config.reactor.clone(),
        stage_shares,
        tls,
    };
    let limits = config.limits.clone();
    let reports = shard::serve(shared, placement, publishers, stage_ends, stop, |addr| {
        if let Some((bound, (registry, groups, oip_readiness))) = oip.take() {
            let context = crate::oip::Context {
                registry,
                readiness: oip_readiness,
                groups,
                scoring: loopback(addr),
                shards,
                candidates_max: limits.candidates_max,
                budget_us_default: limits.budget_us_default,
                budget_us_max: limits.budget_us_max,
                counters: oip_counters.clone().unwrap_or_default(),
            };
            match bound.serve(context) {
                Ok(f) => frontend = Some(f),
                Err(e) => tracing::error!(error = %e, "oip: the v2 front end did not start"),
            }
        }
        readiness.set(true);
        tracing::info!(%addr, shards, tls = serves_tls, "serving");
        on_event(Event::Serving { addr, shards, tls: serves_tls });
    })?;
    if let Some(f) = frontend {
        f.stop();
    }
    collector.join();
    // The shards have stopped: the writer drains their rings and closes
    // its segments.
    if let Some(w) = log_writer {
        w.stop();
    }
    for a in admins {
        a.stop();
    }
    if let Some(w) = watcher {
        let _ = w.join();
    }
    if let Some(f) = feed {
        // The refresher checkpoints on its way out, so a restart resumes here.
        let _ = f.thread.join();
    }
    if let Some(t) = feast_thread {
        // So does the Feast follower.
        let _ = t.join();
    }
    if let Some(s) = stage {
        s.stop();
    }
    for r in &reports {
        tracing::info!(
            shard = r.shard,
            core = r.core,
            connections = r.connections_accepted,
            refused = r.connections_refused,
            rejected_streams = r.streams_rejected,
            requests = r.counters.requests,
            ok = r.counters.by_status[usize::from(Status::Ok.0)],
            features_missing = r.counters.features_missing,
            "shard stopped"
        );
    }
    Ok(reports)
}
