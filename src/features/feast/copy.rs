//! The first sync of a Feast repository's served views: SCAN over the
//! project's keys (every Feast key ends with the project's name; on a Redis
//! Cluster, every master's in turn) with
//! pipelined HGETALL (one round trip reads a batch of entities, each whole:
//! feast #6856 measured HGETALL far cheaper than HMGET for wide rows), each
//! entity's hash split into one row per served view of its entity, into a
//! fresh replica file per view.
//!
//! A file is swapped in (written beside its path, then renamed over it, so
//! readers of the old file keep it whole) only if it does not drop more
//! than `shrink_max` of the rows the file it replaces holds: a Redis
//! restarted empty, flushed, or the wrong database must not wipe a served
//! replica. Such a view is held, as the Quiver contract's full sync holds
//! one, until an operator accepts the shrink.
//!
//! A file a following server writes in place is never replaced under it:
//! the copy first takes each existing file's writer lock (the `flock` every
//! [`ReplicaWriter`] holds) and refuses, naming the file, when another
//! process holds it; it keeps the locks until its files are renamed in, so
//! a server starting meanwhile waits for none and fails naming the lock.
//!
//! Each row keeps its event time (see [`super::rows`]), and each file's
//! checkpoint names a digest of the definitions it was written for, so a
//! server that finds them all current resumes from the files instead of
//! copying again ([`super::follow`] then re-reads only what moved).
//!
//! Bad data (a key of the entity that does not parse, another project's
//! key, a value that does not decode or is of a kind not served, a hash
//! past the field limit) skips that entity's row of the view, counts it per
//! view, and is logged with the key, a few lines per view and sync.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::redis_layout::JoinKeyType;
use super::repo::{FeastRepo, Plan, ServedView};
use super::rows::{self, Claim, Entities, Hash, Split};
use super::store::Store;
use super::FeastError;
use crate::features::feed::Reply;
use crate::features::replica::{Cursor, EntityKeyBuf, ReplicaBuilder, ReplicaError, ReplicaHandle, ReplicaWriter};

/// Lines logged per view and sync for skipped rows; the rest are counted.
const SKIP_LOGS_PER_VIEW_MAX: u64 = 8;

/// The most keys one SCAN asks for and one pipeline of HGETALL reads.
pub const BATCH_KEYS_MAX: usize = 10_000;

/// How a first sync runs.
#[derive(Clone, Debug)]
pub struct SyncOptions {
    /// Where each view's file goes: `<data_dir>/<view>.qrep`.
    pub data_dir: PathBuf,
    /// Keys per SCAN and per pipeline of HGETALL (1 to [`BATCH_KEYS_MAX`]).
    pub batch_keys: usize,
    /// The largest fraction of a populated file's rows a copy may drop and
    /// still be swapped in.
    pub shrink_max: f64,
    /// Swap in a copy whatever it drops (an operator said Redis lost them).
    pub accept_shrink: bool,
}

/// What the sync did with one view.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ViewReport {
    pub view: String,
    pub path: PathBuf,
    /// Entities copied into the new file.
    pub rows: u64,
    /// Entities of the view whose row was bad data, skipped.
    pub skipped: u64,
    /// Null or absent features among the rows copied (NaN in the file).
    pub values_missing: u64,
    /// Rows the replaced file held (0: none).
    pub rows_before: u64,
    /// The copy was not swapped in: it dropped more than `shrink_max`.
    pub held: bool,
}

/// What one first sync did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SyncReport {
    pub views: Vec<ViewReport>,
    /// Keys SCAN returned for the project's pattern.
    pub keys_scanned: u64,
    /// Keys of no served entity (another entity of the project, or a key
    /// that only ends like the project's).
    pub keys_other: u64,
}

/// One served view during the copy: its file's rows being built.
struct ViewCopy<'p> {
    view: &'p ServedView,
    builder: ReplicaBuilder,
    report: ViewReport,
}

/// `text` with Redis glob's special characters escaped.
pub(super) fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn shape(command: &'static str, what: impl Into<String>) -> FeastError {
    FeastError::Reply { command, what: what.into() }
}

fn skip(copy: &mut ViewCopy<'_>, key: &[u8], why: &str) {
    copy.report.skipped += 1;
    if copy.report.skipped <= SKIP_LOGS_PER_VIEW_MAX {
        tracing::warn!(
            view = %copy.view.name, key = %String::from_utf8_lossy(key).escape_debug(),
            "skipped bad feast data: {why}"
        );
        if copy.report.skipped == SKIP_LOGS_PER_VIEW_MAX {
            tracing::warn!(view = %copy.view.name, "more bad data in this view is counted, not logged");
        }
    }
}

/// Copies every entity of `plan`'s views from Redis (`store`, the Feast
/// repository's online store) into fresh files under `options.data_dir`,
/// swapping each in unless it is held (see the module's header).
pub fn first_sync(
    store: &mut Store,
    repo: &FeastRepo,
    plan: &Plan,
    options: &SyncOptions,
) -> Result<SyncReport, FeastError> {
    if !(1..=BATCH_KEYS_MAX).contains(&options.batch_keys) {
        return Err(FeastError::Repo(format!("batch_keys {} is outside 1..={BATCH_KEYS_MAX}", options.batch_keys)));
    }
    if plan.views.is_empty() {
        return Err(FeastError::Repo("no feature view to serve".into()));
    }
    // Held to the end: no writer opens a file while it is being replaced.
    let mut locks = Vec::with_capacity(plan.views.len());
    for view in &plan.views {
        let path = options.data_dir.join(format!("{}.qrep", view.name));
        match ReplicaWriter::open_deferred(&path, &view.name) {
            Ok(writer) => locks.push(writer),
            Err(ReplicaError::Locked { .. }) => {
                return Err(FeastError::Busy { view: view.name.clone(), path: path.display().to_string() })
            }
            // No file, or one that does not open: the copy replaces it.
            Err(_) => {}
        }
    }
    let mut copies = Vec::with_capacity(plan.views.len());
    for view in &plan.views {
        let width = view.features.len() as u32;
        let builder = ReplicaBuilder::new(&view.name, width).links_to(rows::ROW_TIME_LINK)?;
        let mut builder = match view.key {
            JoinKeyType::String { bytes_max } => builder.str_keys(bytes_max)?,
            JoinKeyType::Int64 | JoinKeyType::Int32 => builder,
        };
        // An entity Redis does not hold is missing whole, as Feast returns it.
        builder.set_default(&vec![f32::NAN; width as usize])?;
        copies.push(ViewCopy {
            view,
            builder,
            report: ViewReport {
                view: view.name.clone(),
                path: options.data_dir.join(format!("{}.qrep", view.name)),
                ..ViewReport::default()
            },
        });
    }
    let entities = Entities::new(repo, plan);
    let mut split = Splitting {
        rows: plan.views.iter().map(|v| vec![f32::NAN; v.features.len()]).collect(),
        out: vec![Split::Absent; plan.views.len()],
    };
    let mut report = SyncReport::default();
    let pattern = format!("*{}", glob_escape(&repo.project)).into_bytes();
    let count = options.batch_keys.to_string().into_bytes();
    let mut seen: HashSet<Vec<u8>> = HashSet::new();
    // Each master's keys in turn: a cluster's SCAN walks one node's.
    for master in store.masters() {
        let mut cursor = b"0".to_vec();
        loop {
            let scan = store.node(&master)?.command(&[b"SCAN", &cursor, b"MATCH", &pattern, b"COUNT", &count])?;
            let mut parts = scan.into_array().ok_or_else(|| shape("SCAN", "not an array"))?.into_iter();
            let (Some(next), Some(keys), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(shape("SCAN", "not [cursor, keys]"));
            };
            cursor = next.into_bytes().ok_or_else(|| shape("SCAN", "the cursor is not a string"))?;
            let keys: Vec<Vec<u8>> = keys
                .into_array()
                .ok_or_else(|| shape("SCAN", "the keys are not an array"))?
                .into_iter()
                .filter_map(Reply::into_bytes)
                // SCAN may return a key twice (a rehash during the scan).
                .filter(|k| seen.insert(k.clone()))
                .collect();
            report.keys_scanned += keys.len() as u64;
            copy_batch(store, &keys, &entities, &mut copies, &mut split, &mut report)?;
            if cursor == b"0" {
                break;
            }
        }
    }
    for copy in &mut copies {
        let path = copy.report.path.clone();
        copy.report.rows_before = rows_in(&path, &copy.view.name);
        let (before, after) = (copy.report.rows_before, copy.report.rows);
        let dropped = before.saturating_sub(after) as f64;
        if !options.accept_shrink && before > 0 && dropped > options.shrink_max * before as f64 {
            copy.report.held = true;
            tracing::error!(
                view = %copy.view.name, path = %path.display(), copied = after, served = before,
                "the copy would drop more than {:.0}% of the file's rows: held, the file is kept",
                options.shrink_max * 100.0
            );
            continue;
        }
        // The rows reflect Redis now, for the definitions the digest names:
        // a server that finds the digest resumes from the file.
        let cursor = Cursor { epoch: rows::plan_digest(repo, plan), seq: 0, change_unix_ms: unix_ms() };
        copy.builder.write_at(&path, cursor)?;
    }
    report.views = copies.into_iter().map(|c| c.report).collect();
    drop(locks);
    Ok(report)
}

/// The rows the replica at `path` holds now; 0 when there is none or it
/// does not open (a damaged file is no population to protect).
fn rows_in(path: &Path, group: &str) -> u64 {
    ReplicaHandle::open(path, group).map_or(0, |h| h.live_rows())
}

/// Each view's row buffer and what the last hash split came to.
struct Splitting {
    rows: Vec<Vec<f32>>,
    out: Vec<Split>,
}

pub(super) fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Reads `keys` with one pipeline of HGETALL and adds each entity's rows.
fn copy_batch(
    store: &mut Store,
    keys: &[Vec<u8>],
    entities: &Entities,
    copies: &mut [ViewCopy<'_>],
    split: &mut Splitting,
    report: &mut SyncReport,
) -> Result<(), FeastError> {
    // Which entity each key is; keys of none are not read.
    let mut read: Vec<(&[u8], usize, EntityKeyBuf)> = Vec::with_capacity(keys.len());
    for key in keys {
        match entities.classify(key) {
            Claim::Of(e, k) => read.push((key, e, k)),
            Claim::Bad(e, why) => {
                let join_key = &entities.entities[e].codec.join_key;
                for &v in &entities.entities[e].views {
                    skip(&mut copies[v], key, &format!("not a key of entity '{join_key}': {why}"));
                }
            }
            Claim::Other => report.keys_other += 1,
        }
    }
    let names: Vec<&[u8]> = read.iter().map(|(k, _, _)| *k).collect();
    let hashes = rows::read_hashes(store, &names)?;
    for ((key, e, parsed), hash) in read.into_iter().zip(hashes) {
        let views = &entities.entities[e].views;
        let pairs = match hash {
            Hash::Pairs(pairs) => pairs,
            Hash::Bad(why) => {
                for &v in views {
                    skip(&mut copies[v], key, &why);
                }
                continue;
            }
        };
        entities.split(e, &pairs, &mut split.rows, &mut split.out);
        for &v in views {
            let copy = &mut copies[v];
            let row = &split.rows[v];
            match &split.out[v] {
                Split::Absent => {}
                Split::Bad { why, .. } => skip(copy, key, why),
                Split::Row { ts_unix_s } => {
                    copy.builder.push_linked(parsed.as_key(), row, rows::row_time_link(*ts_unix_s))?;
                    copy.report.rows += 1;
                    copy.report.values_missing += row.iter().filter(|x| x.is_nan()).count() as u64;
                }
            }
        }
    }
    Ok(())
}
