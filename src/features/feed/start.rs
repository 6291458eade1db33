//! Start-up of the feed: open or create each group's replica for writing,
//! repair or set aside damaged files, sync from Redis what has no usable file,
//! and start the refresher thread.
//!
//! Restarts are warm: a file whose superblock, checkpoints and default vector
//! verify is served at once; the refresher scans its slots and rows in the
//! background (readers check each row's CRC until that passes), then catches
//! up from its checkpoint. Only a group without a usable file waits for a
//! first full sync before serving starts.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::contract::{Layout, Part};
use super::refresher::Follow;
use super::refresher::Refresher;
use super::settings::FeedConfig;
use super::status::FeedStatus;
use super::sync::RefreshError;
use crate::deadline::{Clock, MonotonicClock};
use crate::features::replica::{bucket_path, KeyKind, ReplicaError, ReplicaHandle, ReplicaWriter, Storage};

/// One group to serve: its name, file, key kind, and what to create its
/// file with if there is none: the dimension, storage and default vector.
#[derive(Clone, Debug)]
pub struct GroupSpec {
    pub name: String,
    pub path: PathBuf,
    pub dim: Option<u32>,
    pub key: KeyKind,
    pub storage: Storage,
    /// The vector of an entity the replica does not hold; empty: zeros.
    pub default: Vec<f32>,
    /// The key kind of the group's parent, for a group with one.
    pub link: Option<KeyKind>,
}

impl GroupSpec {
    /// A u64-keyed group stored as f32 with a zero default row.
    pub fn new(name: &str, path: PathBuf, dim: Option<u32>) -> GroupSpec {
        GroupSpec {
            name: name.into(),
            path,
            dim,
            key: KeyKind::U64,
            storage: Storage::F32,
            default: Vec::new(),
            link: None,
        }
    }
}

/// The running feed.
pub struct Feed {
    /// In the order of the specs.
    pub handles: Vec<Arc<ReplicaHandle>>,
    pub status: Arc<FeedStatus>,
    pub thread: JoinHandle<()>,
}

fn set_aside(path: &Path, e: &ReplicaError) -> Result<(), RefreshError> {
    let mut aside = path.as_os_str().to_owned();
    aside.push(".damaged");
    tracing::error!(path = %path.display(), "replica is damaged ({e}); moved aside, rebuilding from redis");
    std::fs::rename(path, &aside)
        .map_err(|source| RefreshError::Replica(ReplicaError::Io { path: path.display().to_string(), source }))
}

/// Opens every group, syncs the ones without a usable file, and starts the
/// refresher. Fails when a group has no usable file and Redis cannot supply
/// one within `initial_sync_timeout_ms`.
pub fn start(config: &FeedConfig, specs: &[GroupSpec], stop: Arc<AtomicBool>) -> Result<Feed, RefreshError> {
    let clock = MonotonicClock::new();
    let layout = config.layout().map_err(RefreshError::Url)?;
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let status = Arc::new(FeedStatus::new(&names, config.staleness_max_ms, config.stale_policy, clock.now_ns()));
    let mut follows = Vec::new();
    let mut handles = Vec::new();
    // Files created empty here, and the follows they belong to.
    let mut created: Vec<(PathBuf, usize)> = Vec::new();
    for (at, spec) in specs.iter().enumerate() {
        let parts: Vec<Part> =
            Part::all(&spec.name, layout).into_iter().map(|p| p.with_key_kind(spec.key).with_link(spec.link)).collect();
        let mut writers = Vec::with_capacity(parts.len());
        for part in &parts {
            let path = match layout {
                Layout::Plain => spec.path.clone(),
                Layout::Bucketed { .. } => bucket_path(&spec.path, part.bucket),
            };
            let (writer, fresh) = match open_or_create(spec, part, &path) {
                Ok(opened) => opened,
                Err(e) => {
                    // An empty file left behind would be served as if current on the next start.
                    for (path, _) in &created {
                        let _ = std::fs::remove_file(path);
                    }
                    return Err(e);
                }
            };
            if fresh {
                created.push((path, follows.len() + writers.len()));
            }
            writers.push(writer);
        }
        if layout != Layout::Plain && spec.path.exists() {
            tracing::warn!(
                group = %spec.name, path = %spec.path.display(),
                "a plain-layout replica is here too, and is not used now that [feed] buckets is set"
            );
        }
        handles.push(match layout {
            Layout::Plain => writers[0].handle(),
            Layout::Bucketed { .. } => ReplicaHandle::bucketed(&mut writers),
        });
        follows.extend(parts.into_iter().zip(writers).map(|(part, writer)| Follow {
            part,
            status_at: at,
            writer,
            storage: spec.storage,
        }));
    }
    let mut refresher = Refresher::new(config.clone(), follows, status.clone())?;
    if !created.is_empty() {
        tracing::info!(parts = created.len(), "no usable replica: full sync from redis before serving");
        let needs: Vec<usize> = created.iter().map(|(_, i)| *i).collect();
        if let Err(e) = refresher.initial_sync(&needs) {
            // An empty file left behind would be served as if current on the next start.
            for (path, _) in &created {
                let _ = std::fs::remove_file(path);
            }
            return Err(e);
        }
    }
    let thread = refresher
        .spawn(stop)
        .map_err(|source| RefreshError::Replica(ReplicaError::Io { path: "quiver-feed thread".into(), source }))?;
    Ok(Feed { handles, status, thread })
}

/// Opens `part`'s replica at `path`, or creates it empty (true) when there
/// is none or it was damaged and set aside.
fn open_or_create(spec: &GroupSpec, part: &Part, path: &Path) -> Result<(ReplicaWriter, bool), RefreshError> {
    match ReplicaWriter::open_deferred(path, &spec.name) {
        Ok(w) if w.table().key_kind() != spec.key => {
            return Err(RefreshError::KeyKindMismatch {
                group: spec.name.clone(),
                path: path.display().to_string(),
                found: w.table().key_kind(),
                configured: spec.key,
            });
        }
        // Links are the file's copy of what Redis holds after each vector:
        // a group given a parent (or relieved of one) since the file was
        // written gets a fresh copy with the links its values name.
        Ok(w) if w.table().link_kind() != spec.link => {
            drop(w);
            let mut aside = path.as_os_str().to_owned();
            aside.push(".relinked");
            tracing::warn!(
                group = %part.name(), path = %path.display(),
                "the replica's links do not match the group's parent; moved aside, rebuilding from redis"
            );
            std::fs::rename(path, &aside).map_err(|source| {
                RefreshError::Replica(ReplicaError::Io { path: path.display().to_string(), source })
            })?;
        }
        Ok(w) => {
            tracing::info!(
                group = %part.name(), seq = w.cursor().seq, bytes = w.table().file_bytes(),
                "replica opened: serving it while it is verified and caught up"
            );
            return Ok((w, false));
        }
        Err(e) if e.is_damage() => set_aside(path, &e)?,
        Err(ReplicaError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let dim = spec.dim.ok_or_else(|| RefreshError::InitialSync {
        group: spec.name.clone(),
        why: format!("no replica file and no dimension known: set feed.{}_dim", spec.name),
    })?;
    let default = match spec.default.len() {
        0 => vec![0.0; dim as usize],
        n if n == dim as usize => spec.default.clone(),
        n => {
            return Err(RefreshError::InitialSync {
                group: spec.name.clone(),
                why: format!("its default vector has {n} values, its dimension is {dim}"),
            })
        }
    };
    let writer =
        ReplicaWriter::create_linked(path, &spec.name, dim, spec.storage, spec.key, spec.link, 1024, &default)?;
    Ok((writer, true))
}
