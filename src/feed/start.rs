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

use super::config::FeedConfig;
use super::refresher::Refresher;
use super::status::FeedStatus;
use super::sync::RefreshError;
use crate::deadline::{Clock, MonotonicClock};
use crate::replica::{ReplicaError, ReplicaHandle, ReplicaWriter};

/// One group to serve: its name, file, and the dimension to create it with
/// if there is no file.
pub struct GroupSpec {
    pub name: String,
    pub path: PathBuf,
    pub dim: Option<u32>,
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
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let status = Arc::new(FeedStatus::new(&names, config.staleness_max_ms, config.stale_policy, clock.now_ns()));
    let mut writers = Vec::new();
    let mut needs_sync = Vec::new();
    for spec in specs {
        let opened = match ReplicaWriter::open_deferred(&spec.path, &spec.name) {
            Ok(w) => {
                tracing::info!(
                    group = %spec.name, seq = w.cursor().seq, bytes = w.table().file_bytes(),
                    "replica opened: serving it while it is verified and caught up"
                );
                Some(w)
            }
            Err(e) if e.is_damage() => {
                set_aside(&spec.path, &e)?;
                None
            }
            Err(ReplicaError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e.into()),
        };
        let writer = match opened {
            Some(w) => w,
            None => {
                let dim = spec.dim.ok_or_else(|| RefreshError::InitialSync {
                    group: spec.name.clone(),
                    why: format!("no replica file and no dimension known: set feed.{}_dim", spec.name),
                })?;
                needs_sync.push(spec.name.clone());
                let default = vec![0.0; dim as usize];
                ReplicaWriter::create(&spec.path, &spec.name, dim, config.storage(&spec.name), 1024, &default)?
            }
        };
        writers.push(writer);
    }
    let handles: Vec<Arc<ReplicaHandle>> = writers.iter_mut().map(ReplicaWriter::handle).collect();
    let mut refresher = Refresher::new(config.clone(), writers, status.clone())?;
    if !needs_sync.is_empty() {
        tracing::info!(groups = ?needs_sync, "no usable replica: full sync from redis before serving");
        if let Err(e) = refresher.initial_sync(&needs_sync) {
            // An empty file left behind would be served as if current on the next start.
            for spec in specs.iter().filter(|s| needs_sync.contains(&s.name)) {
                let _ = std::fs::remove_file(&spec.path);
            }
            return Err(e);
        }
    }
    let thread = refresher
        .spawn(stop)
        .map_err(|source| RefreshError::Replica(ReplicaError::Io { path: "quiver-feed thread".into(), source }))?;
    Ok(Feed { handles, status, thread })
}
