//! The model registry: which model versions the server serves, by name, and
//! how a new version reaches the shards without a restart.
//!
//! On disk a registry is a directory `<models_dir>/<name>/<version>/model.qm`.
//! The server loads the latest version of every name at start (or a single
//! `model` file when no directory is configured). An operator loads another
//! version or rolls back through the admin endpoint; the admin thread reads
//! and validates the file, checks its input layout against the feature
//! replicas, warms it on a batch, and only then publishes it and bumps a
//! generation counter. Each shard compares that counter once per read round
//! (one atomic load) and, when it moved, swaps in its own backend for the new
//! version between rounds. A request is served start to finish by one
//! version, and every response names that version.
//!
//! Building a backend (packing weights, SIMD tree layouts, an onnxruntime
//! session) and timing it on a full batch takes milliseconds, too long for
//! a shard's reactor. So the admin side builds one backend per shard
//! ([`Registry::with_shards`]) before it publishes a version and sends it to
//! the shard's own inbox ([`Inbox`]), from which the shard takes it; a shard
//! builds one itself only for what was never published through here
//! (start-up, tests) or found its inbox full.
//!
//! A version's explainer (reason codes) is one read-only table whatever
//! the shard count: built once, on the admin side with the backends or by
//! the first shard that builds the version at start-up, and shared
//! (`Registry::explainer`, `score::explaining`).
//!
//! It also carries how served versions are watched for drift
//! (`crate::drift::DriftConfig`), read by the shards when they build a
//! version's counters and by the admin thread when it reports.
//!
//! This is one of the few cross-thread types (with `metrics`): the admin
//! side changes the served set under a mutex and publishes it as an
//! immutable snapshot (`ArcSwap`) before it moves the generation; shards and
//! the stage read the generation and the snapshot, and take from their
//! inboxes, without a lock.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::drift::DriftConfig;
use crate::features::groups::Scope;
use crate::model::layout::{GroupFit, InputLayout, LayoutError};
use crate::model::{Model, ModelError};
use crate::score::explaining::{Built, Explainers};
use crate::score::{self, Backend, BackendKind};

/// File name of a model inside its version directory.
pub const MODEL_FILE: &str = "model.qm";
/// Model names are directory names: a bounded, boring alphabet.
pub const NAME_BYTES_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("no model named '{0}'")]
    UnknownModel(String),
    #[error("model '{name}' has no version {version} under {dir}")]
    UnknownVersion { name: String, version: u32, dir: String },
    #[error("{path} holds model '{found}' version {found_version}, expected '{name}' version {version}")]
    Mismatch { path: String, found: String, found_version: u32, name: String, version: u32 },
    #[error("model '{0}' has no previous version to roll back to")]
    NoPrevious(String),
    #[error("no models found under {0}")]
    Empty(String),
    #[error("model name '{0}' is not 1 to 64 of [A-Za-z0-9._-]")]
    BadName(String),
    #[error("models are loaded from a single file; configure models_dir to load versions")]
    NoDirectory,
    #[error("canary fraction {0} is not within 0..=1")]
    BadFraction(f64),
    #[error("a canary needs a version (?version=N)")]
    NoCanaryVersion,
    #[error("model '{0}' changed while its rollback was being prepared; retry")]
    Concurrent(String),
}

/// What the replicas and limits allow a model's inputs to be.
#[derive(Clone, Debug)]
pub struct Fit {
    /// The served feature groups, in configuration order.
    pub groups: Vec<GroupFit>,
    pub context_len_max: usize,
}

impl Fit {
    /// The two groups a server without `[[groups]]` serves: `user` and
    /// `item` of these widths.
    pub fn user_item(user_dim: usize, item_dim: usize, context_len_max: usize) -> Fit {
        let group = |name: &str, scope, dim| GroupFit { name: name.into(), scope, dim, child: None };
        Fit {
            groups: vec![group("user", Scope::Request, user_dim), group("item", Scope::Candidate, item_dim)],
            context_len_max,
        }
    }
}

#[derive(Clone, Debug)]
struct Slot {
    current: Arc<Model>,
    previous: Option<Arc<Model>>,
    /// A candidate version serving a fraction of users (parts per million).
    canary: Option<(Arc<Model>, u32)>,
    /// A candidate version scored beside the current one for a fraction of
    /// requests, its scores never returned.
    shadow: Option<(Arc<Model>, u32)>,
}

/// A served model as a shard sees it after a generation change.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub generation: u64,
    pub default: String,
    pub models: Vec<Arc<Model>>,
    /// Candidate versions and the share of users each serves, in parts per
    /// million; a canary has the name of the current model it shadows.
    pub canaries: Vec<(Arc<Model>, u32)>,
    /// Shadow versions and the share of requests each also scores.
    pub shadows: Vec<(Arc<Model>, u32)>,
}

/// What `slots` serve, as of `generation`.
fn snapshot_of(slots: &BTreeMap<String, Slot>, default: &str, generation: u64) -> Snapshot {
    Snapshot {
        generation,
        default: default.to_string(),
        models: slots.values().map(|s| s.current.clone()).collect(),
        canaries: slots.values().filter_map(|s| s.canary.clone()).collect(),
        shadows: slots.values().filter_map(|s| s.shadow.clone()).collect(),
    }
}

/// What `GET /models` reports for one name.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ModelStatus {
    pub name: String,
    pub version: u32,
    pub previous: Option<u32>,
    pub on_disk: Vec<u32>,
    /// The canary version and the fraction of users it serves.
    pub canary: Option<(u32, f64)>,
    /// The shadow version and the fraction of requests it also scores.
    #[serde(default)]
    pub shadow: Option<(u32, f64)>,
    /// The current version's input columns by name, in row order
    /// (`Model::feature_names`): what an explanation's feature index names.
    #[serde(default)]
    pub features: Vec<String>,
}

#[derive(Debug)]
pub struct Registry {
    dir: Option<PathBuf>,
    fit: Fit,
    backend: BackendKind,
    rows_max: usize,
    default: String,
    slots: Mutex<BTreeMap<String, Slot>>,
    /// What the shards and the stage serve, published with each change of
    /// `slots` (under its lock) and read without a lock.
    published: ArcSwap<Snapshot>,
    generation: AtomicU64,
    /// Versions `load_newer` failed to load, with their file's stamp then,
    /// so a broken file on disk is reported once, not on every poll, and
    /// tried again once it changes.
    refused: Mutex<std::collections::BTreeMap<(String, u32), Option<FileStamp>>>,
    drift: DriftConfig,
    /// Shards that take a prebuilt backend of each published version; 0
    /// builds none.
    shards: usize,
    /// Per shard, its inbox of backends built ahead for published versions
    /// (`with_shards`): the admin side sends, the shard receives without a
    /// lock. A backend that finds the inbox full is dropped (the shard
    /// builds its own).
    inboxes: Vec<SyncSender<Arrival>>,
    /// The inboxes' receiving ends, until each shard takes its own.
    inbox_ends: Mutex<Vec<Option<Inbox>>>,
    /// One explainer per served version, shared by the shards
    /// (`explainer`): locked to find an entry, when a shard or the admin
    /// side builds a version, never per request.
    explainers: Explainers,
}

/// A published version and the backends built for it, by shard.
type BuiltAhead = (Arc<Model>, Vec<Option<Prebuilt>>);

/// Backends an inbox holds at most: a few publications ahead of its shard.
const INBOX_MAX: usize = 8;

/// A backend built ahead for `model`, published under `generation`.
type Arrival = (u64, Arc<Model>, Prebuilt);

/// One shard's end of its inbox of backends built ahead.
#[derive(Debug)]
pub struct Inbox {
    rx: Receiver<Arrival>,
    /// Received and not yet taken.
    arrived: Vec<Arrival>,
}

impl Inbox {
    /// The backend built for `model` when it was published, once; `None`
    /// when there is none (the shard then builds its own).
    pub fn take(&mut self, model: &Arc<Model>) -> Option<Prebuilt> {
        self.arrived.extend(self.rx.try_iter());
        let at = self.arrived.iter().position(|(_, m, _)| Arc::ptr_eq(m, model))?;
        Some(self.arrived.swap_remove(at).2)
    }

    /// Drops what was published up to `generation`, once the shard serves
    /// that generation: it has taken what it needed, the rest was replaced
    /// before it could. Later publications stay.
    pub fn trim(&mut self, generation: u64) {
        self.arrived.extend(self.rx.try_iter());
        self.arrived.retain(|(g, _, _)| *g > generation);
    }
}

/// A backend built for one shard ahead of a swap, with its measured cost,
/// and the version's shared explainer (or its refusal; `None` for a shadow,
/// which never explains).
pub struct Prebuilt {
    pub backend: Box<dyn Backend>,
    /// Kernel time per row on a full batch of `rows_max` rows.
    pub ns_per_row: f64,
    pub explainer: Option<Built>,
}

impl std::fmt::Debug for Prebuilt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prebuilt").field("backend", &self.backend.name()).field("ns_per_row", &self.ns_per_row).finish()
    }
}

/// Builds a backend for `model` and times one full batch of `rows_max`
/// zero rows, which also warms it (first-touch page faults, lazy
/// initialisation). `now_ns` is the clock it is timed by. The version's
/// explainer is not built here: it is one per version, shared by every
/// shard (`Registry::explainer`).
pub fn build_timed(
    kind: BackendKind,
    model: &Arc<Model>,
    rows_max: usize,
    row_dim: usize,
    out: &mut [f32],
    now_ns: impl Fn() -> u64,
) -> Prebuilt {
    let mut backend = score::build(kind, model, rows_max);
    let x = vec![0.0; rows_max * row_dim];
    let started_ns = now_ns();
    // A backend that cannot score fails at once; its requests step down the
    // ladder, so its cost is never consulted.
    let _ = backend.score(&x, rows_max, &mut out[..rows_max]);
    let ns_per_row = now_ns().saturating_sub(started_ns) as f64 / rows_max as f64;
    Prebuilt { backend, ns_per_row, explainer: None }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && name != "."
        && name != ".."
}

/// Versions of `name` present on disk, ascending.
fn versions_on_disk(dir: &Path, name: &str) -> Result<Vec<u32>, RegistryError> {
    let d = dir.join(name);
    let io = |source| RegistryError::Io { path: d.display().to_string(), source };
    let mut versions = Vec::new();
    for entry in std::fs::read_dir(&d).map_err(io)? {
        let entry = entry.map_err(io)?;
        let Some(v) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if entry.path().join(MODEL_FILE).is_file() {
            versions.push(v);
        }
    }
    versions.sort_unstable();
    Ok(versions)
}

impl Registry {
    /// Serves one model file (no versions on disk to switch between).
    pub fn single(path: &Path, fit: Fit, backend: BackendKind, rows_max: usize) -> Result<Registry, RegistryError> {
        Registry::from_models(vec![Model::load(path)?], fit, backend, rows_max)
    }

    /// Serves models held in memory; the first is the default.
    pub fn from_models(
        models: Vec<Model>,
        fit: Fit,
        backend: BackendKind,
        rows_max: usize,
    ) -> Result<Registry, RegistryError> {
        let default = models.first().map(|m| m.name.clone()).ok_or_else(|| RegistryError::Empty("(memory)".into()))?;
        let mut slots = BTreeMap::new();
        for model in models {
            InputLayout::new(&model, &fit.groups, fit.context_len_max)?;
            slots.insert(
                model.name.clone(),
                Slot { current: Arc::new(model), previous: None, canary: None, shadow: None },
            );
        }
        Ok(Registry::with_slots(None, fit, backend, rows_max, default, slots))
    }

    /// Loads the latest version of every model under `dir`. `default` names
    /// the model for requests that name none (else the only model, or the
    /// first name in order).
    pub fn open(
        dir: &Path,
        default: Option<&str>,
        fit: Fit,
        backend: BackendKind,
        rows_max: usize,
    ) -> Result<Registry, RegistryError> {
        let io = |source| RegistryError::Io { path: dir.display().to_string(), source };
        let mut slots = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if !entry.path().is_dir() || !valid_name(&name) {
                continue;
            }
            let Some(&latest) = versions_on_disk(dir, &name)?.last() else {
                continue;
            };
            let model = load_checked(dir, &name, latest, &fit)?;
            slots.insert(name, Slot { current: Arc::new(model), previous: None, canary: None, shadow: None });
        }
        let default = match default {
            Some(d) if slots.contains_key(d) => d.to_string(),
            Some(d) => return Err(RegistryError::UnknownModel(d.to_string())),
            None => slots.keys().next().cloned().ok_or_else(|| RegistryError::Empty(dir.display().to_string()))?,
        };
        Ok(Registry::with_slots(Some(dir.to_path_buf()), fit, backend, rows_max, default, slots))
    }

    fn with_slots(
        dir: Option<PathBuf>,
        fit: Fit,
        backend: BackendKind,
        rows_max: usize,
        default: String,
        slots: BTreeMap<String, Slot>,
    ) -> Registry {
        let published = ArcSwap::from_pointee(snapshot_of(&slots, &default, 1));
        Registry {
            dir,
            fit,
            backend,
            rows_max,
            default,
            slots: Mutex::new(slots),
            published,
            generation: AtomicU64::new(1),
            refused: Mutex::default(),
            drift: DriftConfig::default(),
            shards: 0,
            inboxes: Vec::new(),
            inbox_ends: Mutex::default(),
            explainers: Explainers::default(),
        }
    }

    /// Builds a backend for each of `shards` shards whenever a version is
    /// published, so the shards' swaps only take them.
    pub fn with_shards(mut self, shards: usize) -> Registry {
        self.shards = shards;
        let (inboxes, ends): (Vec<_>, Vec<_>) = (0..shards)
            .map(|_| {
                let (tx, rx) = std::sync::mpsc::sync_channel(INBOX_MAX);
                (tx, Some(Inbox { rx, arrived: Vec::with_capacity(INBOX_MAX) }))
            })
            .unzip();
        self.inboxes = inboxes;
        self.inbox_ends = Mutex::new(ends);
        self
    }

    /// Shard `shard`'s inbox of backends built ahead, once (at start-up: the
    /// only lock a shard takes here); `None` when it was taken or there is
    /// none (`with_shards`).
    pub fn take_inbox(&self, shard: usize) -> Option<Inbox> {
        self.inbox_ends.lock().unwrap_or_else(|e| e.into_inner()).get_mut(shard)?.take()
    }

    /// One backend per shard for `model`, built and timed here (the admin
    /// side), or one warm-up run when no shard takes them; with them the
    /// version's explainer, built once here for all of them, when the
    /// version `explains` (not a shadow).
    fn prebuild(&self, model: &Arc<Model>, explains: bool) -> Vec<Option<Prebuilt>> {
        use crate::deadline::Clock;
        let clock = crate::deadline::MonotonicClock::new();
        let mut out = vec![0.0; self.rows_max];
        let explainer = explains.then(|| self.explainer(model, || clock.now_ns()));
        let mut build = || {
            let built = build_timed(self.backend, model, self.rows_max, model.input_dim(), &mut out, || clock.now_ns());
            Prebuilt { explainer: explainer.clone(), ..built }
        };
        if self.shards == 0 {
            build();
            return Vec::new();
        }
        (0..self.shards).map(|_| Some(build())).collect()
    }

    /// `model`'s explainer, one per version whichever shard or admin call
    /// asks: built (and timed by `now_ns`) by the first, shared by the
    /// rest. Versions no longer published are dropped from the table as it
    /// is next used; a shard's copy lives as long as the shard serves it.
    pub fn explainer(&self, model: &Arc<Model>, now_ns: impl Fn() -> u64) -> Built {
        let published = self.published.load();
        let served = |m: &Arc<Model>| {
            let named = |c: &(Arc<Model>, u32)| Arc::ptr_eq(&c.0, m);
            published.models.iter().any(|s| Arc::ptr_eq(s, m))
                || published.canaries.iter().any(named)
                || published.shadows.iter().any(named)
        };
        self.explainers.get(model, served, now_ns)
    }

    /// Model versions with an explainer built or being built.
    pub fn explainers_held(&self) -> usize {
        self.explainers.len()
    }

    /// Sends the backends built for a newly published version, if any, to
    /// their shards' inboxes. Returns those that found an inbox full, for
    /// the caller to free after it released the lock.
    fn stash(&self, new: Option<BuiltAhead>) -> Vec<Prebuilt> {
        let mut dropped = Vec::new();
        let Some((model, built)) = new else {
            return dropped;
        };
        // Called under the slots lock, just before `publish`.
        let generation = self.generation.load(Ordering::Relaxed) + 1;
        for (inbox, prebuilt) in self.inboxes.iter().zip(built) {
            let Some(prebuilt) = prebuilt else { continue };
            if let Err(e) = inbox.try_send((generation, model.clone(), prebuilt)) {
                let (TrySendError::Full((_, _, p)) | TrySendError::Disconnected((_, _, p))) = e;
                dropped.push(p);
            }
        }
        dropped
    }

    /// Watches served versions for drift with `config` (default otherwise).
    pub fn with_drift(mut self, config: DriftConfig) -> Registry {
        self.drift = config;
        self
    }

    pub fn drift(&self) -> &DriftConfig {
        &self.drift
    }

    /// Changes whenever any served version changes; shards poll it.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The versions served now: no lock, whatever the admin side holds.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot::clone(&self.published.load())
    }

    /// Whether a model of this name is served now.
    pub fn serves(&self, name: &str) -> bool {
        self.published.load().models.iter().any(|m| m.name == name)
    }

    /// Makes `slots` what is served, under the next generation. Called with
    /// the slots lock held, so publications do not cross; the snapshot is
    /// stored before the generation moves, so a shard that sees the new
    /// generation reads this snapshot or a later one.
    fn publish(&self, slots: &BTreeMap<String, Slot>) {
        let generation = self.generation.load(Ordering::Relaxed) + 1;
        self.published.store(Arc::new(snapshot_of(slots, &self.default, generation)));
        self.generation.store(generation, Ordering::Release);
    }

    /// Serves `version` of `name` to `fraction` (0..=1) of requests, chosen
    /// by a hash of each request's key of `canary_group` (`user_id` by
    /// default) so each key stays on one side; a fraction of 0 ends the
    /// canary. Returns the canary version, if one is running.
    pub fn canary(&self, name: &str, version: Option<u32>, fraction: f64) -> Result<Option<u32>, RegistryError> {
        self.candidate(name, version, fraction, true, |slot| &mut slot.canary)
    }

    /// Also scores `fraction` of `name`'s requests with `version`, off the
    /// critical path, for comparison; its scores are never returned. A
    /// fraction of 0 ends it.
    pub fn shadow(&self, name: &str, version: Option<u32>, fraction: f64) -> Result<Option<u32>, RegistryError> {
        self.candidate(name, version, fraction, false, |slot| &mut slot.shadow)
    }

    fn candidate(
        &self,
        name: &str,
        version: Option<u32>,
        fraction: f64,
        explains: bool,
        which: impl Fn(&mut Slot) -> &mut Option<(Arc<Model>, u32)>,
    ) -> Result<Option<u32>, RegistryError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(RegistryError::BadFraction(fraction));
        }
        let ppm = (fraction * 1e6).round() as u32;
        let candidate = match (ppm, version) {
            (0, _) => None,
            (_, None) => return Err(RegistryError::NoCanaryVersion),
            (_, Some(v)) => {
                let dir = self.dir.as_ref().ok_or(RegistryError::NoDirectory)?;
                let model = Arc::new(load_checked(dir, name, v, &self.fit)?);
                let built = self.prebuild(&model, explains);
                Some((model, ppm, built))
            }
        };
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = slots.get_mut(name).ok_or_else(|| RegistryError::UnknownModel(name.into()))?;
        let version = candidate.as_ref().map(|(m, _, _)| m.version);
        *which(slot) = candidate.as_ref().map(|(m, ppm, _)| (m.clone(), *ppm));
        let dropped = self.stash(candidate.map(|(m, _, built)| (m, built)));
        self.publish(&slots);
        drop(slots);
        drop(dropped);
        tracing::info!(model = name, ?version, fraction, "candidate version set");
        Ok(version)
    }

    pub fn status(&self) -> Vec<ModelStatus> {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        slots
            .into_iter()
            .map(|(name, s)| ModelStatus {
                on_disk: self.dir.as_ref().and_then(|d| versions_on_disk(d, &name).ok()).unwrap_or_default(),
                version: s.current.version,
                previous: s.previous.as_ref().map(|p| p.version),
                canary: s.canary.as_ref().map(|(m, ppm)| (m.version, f64::from(*ppm) / 1e6)),
                shadow: s.shadow.as_ref().map(|(m, ppm)| (m.version, f64::from(*ppm) / 1e6)),
                features: s.current.feature_names(),
                name,
            })
            .collect()
    }

    /// Loads `version` of `name` (the latest on disk when `None`), warms it
    /// and makes it current; the old current becomes the rollback target.
    /// Returns the version now served.
    pub fn load(&self, name: &str, version: Option<u32>) -> Result<u32, RegistryError> {
        let dir = self.dir.as_ref().ok_or(RegistryError::NoDirectory)?;
        if !valid_name(name) {
            return Err(RegistryError::BadName(name.into()));
        }
        let version = match version {
            Some(v) => v,
            None => *versions_on_disk(dir, name)?.last().ok_or_else(|| RegistryError::UnknownModel(name.into()))?,
        };
        let model = Arc::new(load_checked(dir, name, version, &self.fit)?);
        let built = self.prebuild(&model, true);
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        match slots.get_mut(name) {
            Some(slot) => {
                let old = std::mem::replace(&mut slot.current, model.clone());
                slot.previous = Some(old);
            }
            None => {
                let slot = Slot { current: model.clone(), previous: None, canary: None, shadow: None };
                slots.insert(name.to_string(), slot);
            }
        }
        let dropped = self.stash(Some((model, built)));
        self.publish(&slots);
        drop(slots);
        drop(dropped);
        tracing::info!(model = name, version, "model version loaded");
        Ok(version)
    }

    /// Returns `name` to its previous version (the two swap, so a second
    /// rollback undoes the first). The shards' backends for it are built
    /// first, so the swap itself is at once.
    pub fn rollback(&self, name: &str) -> Result<u32, RegistryError> {
        let previous = {
            let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            let slot = slots.get(name).ok_or_else(|| RegistryError::UnknownModel(name.into()))?;
            slot.previous.clone().ok_or_else(|| RegistryError::NoPrevious(name.into()))?
        };
        // Built outside the lock; the swap below checks nothing moved since.
        let built = self.prebuild(&previous, true);
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = slots.get_mut(name).ok_or_else(|| RegistryError::UnknownModel(name.into()))?;
        if !slot.previous.as_ref().is_some_and(|p| Arc::ptr_eq(p, &previous)) {
            return Err(RegistryError::Concurrent(name.into()));
        }
        let previous = slot.previous.take().expect("checked above");
        let old = std::mem::replace(&mut slot.current, previous.clone());
        slot.previous = Some(old);
        let version = slot.current.version;
        let dropped = self.stash(Some((previous, built)));
        self.publish(&slots);
        drop(slots);
        drop(dropped);
        tracing::info!(model = name, version, "model rolled back");
        Ok(version)
    }

    /// Loads any version newer than the one served, for every name on disk.
    /// Returns what changed.
    pub fn load_newer(&self) -> Vec<(String, u32)> {
        let Some(dir) = &self.dir else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut changed = Vec::new();
        for entry in entries.flatten() {
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if !valid_name(&name) {
                continue;
            }
            let latest = versions_on_disk(dir, &name).ok().and_then(|v| v.last().copied());
            let served = self.slots.lock().unwrap_or_else(|e| e.into_inner()).get(&name).map(|s| s.current.version);
            let Some(latest) = latest.filter(|&l| served.is_none_or(|s| l > s)) else {
                continue;
            };
            let key = (name.clone(), latest);
            // A refused version is tried again once its file changes: a
            // directory still being copied loads when the copy is complete.
            let stamp = FileStamp::of(&dir.join(&name).join(latest.to_string()).join(MODEL_FILE));
            if self.refused.lock().unwrap_or_else(|e| e.into_inner()).get(&key) == Some(&stamp) {
                continue;
            }
            match self.load(&name, Some(latest)) {
                Ok(v) => {
                    self.refused.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
                    changed.push((name, v));
                }
                Err(e) => {
                    tracing::warn!(
                        model = %name, version = latest, error = %e,
                        "new version not loaded; it is tried again when its file changes"
                    );
                    self.refused.lock().unwrap_or_else(|e| e.into_inner()).insert(key, stamp);
                }
            }
        }
        changed
    }
}

/// What tells one state of a file from another: its inode, length and
/// modification time (`None` when it cannot be read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    inode: u64,
    bytes: u64,
    modified_ns: i128,
}

impl FileStamp {
    fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            inode: m.ino(),
            bytes: m.len(),
            modified_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        })
    }
}

fn load_checked(dir: &Path, name: &str, version: u32, fit: &Fit) -> Result<Model, RegistryError> {
    // Every way in (load, canary, shadow, the watcher) names a file under
    // `dir` through here: a name with a separator or `..` would leave it.
    if !valid_name(name) {
        return Err(RegistryError::BadName(name.into()));
    }
    let path = dir.join(name).join(version.to_string()).join(MODEL_FILE);
    if !path.is_file() {
        return Err(RegistryError::UnknownVersion { name: name.into(), version, dir: dir.display().to_string() });
    }
    let model = Model::load(&path)?;
    if model.name != name || model.version != version {
        return Err(RegistryError::Mismatch {
            path: path.display().to_string(),
            found: model.name,
            found_version: model.version,
            name: name.into(),
            version,
        });
    }
    InputLayout::new(&model, &fit.groups, fit.context_len_max)?;
    Ok(model)
}

/// Writes `model` into a registry directory as `<name>/<version>/model.qm`.
pub fn publish(dir: &Path, model: &Model) -> Result<PathBuf, RegistryError> {
    if !valid_name(&model.name) {
        return Err(RegistryError::BadName(model.name.clone()));
    }
    let d = dir.join(&model.name).join(model.version.to_string());
    std::fs::create_dir_all(&d).map_err(|source| RegistryError::Io { path: d.display().to_string(), source })?;
    let path = d.join(MODEL_FILE);
    model.save(&path)?;
    Ok(path)
}
