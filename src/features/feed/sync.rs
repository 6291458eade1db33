//! One full copy of a feature group from Redis into a fresh replica file
//! (SCAN + MGET, over several connections in parallel), and what tells a copy
//! of a settled source from one of a source being written or reloaded. The
//! refresher resyncs with it; `quiver replica sync` runs it once.
//!
//! A copy over one connection waits for each round trip before it decodes
//! and inserts; over several, a scanner, fetchers and the inserting caller
//! overlap, so the copy is bound by the slowest of Redis's one thread, the
//! decoding (spread over the fetchers) and the replica's one writer.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use super::contract::{self, ContractError, EntityKey, EntityKeyBuf, KeyKind, Layout, Part};
use super::redis_cluster::{key_slot, ClusterConn, ClusterError, RedisSource};
use super::resp::{RedisConfig, RedisConn, RedisError, Reply};
use super::status::GroupStatus;
use crate::features::replica::{bucket_path, temp_path, Cursor, ReplicaError, ReplicaWriter, Storage};

/// Why a refresh session ended or a sync failed.
#[derive(Debug, thiserror::Error)]
pub enum RefreshError {
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("redis replied to {command} with an unexpected shape: {what}")]
    Reply { command: &'static str, what: String },
    #[error("{0}")]
    Url(String),
    #[error("initial sync of '{group}' did not finish: {why}")]
    InitialSync { group: String, why: String },
    #[error("cannot start a full sync thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A bucket written with another bucket count than the one configured:
    /// following it would look for entities in the wrong buckets.
    #[error("{key} says the group has {stored} buckets, {configured} are configured ([feed] buckets, or --buckets): fix one of them")]
    Buckets { key: String, stored: String, configured: u16 },
    /// A group whose writers use the other key kind: its keys would be
    /// misread (`g:42` is id 42 to one kind, the string "42" to the other).
    #[error("group '{group}': {key} says its keys are {stored}, the replica is configured for {configured}: fix one of them")]
    KeyKind { group: String, key: String, stored: String, configured: KeyKind },
    /// A group's existing replica file is keyed otherwise than configured:
    /// neither damage to set aside nor a file to serve.
    #[error("group '{group}': {path} holds {found}, the group is configured with {configured}: move the file away to rebuild it from redis, or fix the group's key configuration")]
    KeyKindMismatch { group: String, path: String, found: KeyKind, configured: KeyKind },
}

impl RefreshError {
    /// A cluster node said another node serves the key (a resharding): the
    /// topology is read again and the session resumes at once.
    pub fn is_redirect(&self) -> bool {
        let message = match self {
            RefreshError::Redis(RedisError::Server { message, .. })
            | RefreshError::Cluster(ClusterError::Redis(RedisError::Server { message, .. })) => message,
            _ => return false,
        };
        message.starts_with("MOVED ") || message.starts_with("ASK ")
    }

    /// The data directory cannot be written (a read-only mount, no
    /// permission): its files can still be served as they are.
    pub fn is_read_only(&self) -> bool {
        let RefreshError::Replica(ReplicaError::Io { source, .. }) = self else {
            return false;
        };
        matches!(source.raw_os_error(), Some(libc::EROFS | libc::EACCES | libc::EPERM))
    }

    /// The replica's files failed (a full disk, a read-only or failing file
    /// system), not Redis: the served replica stays as it is.
    pub fn is_disk(&self) -> bool {
        matches!(self, RefreshError::Replica(ReplicaError::NoSpace { .. } | ReplicaError::Io { .. }))
    }
}

/// Where a part's position and stream are read: its one node, or a cluster
/// that routes each command by the key beside it (following `MOVED` and `ASK`).
pub(super) trait Keyed {
    fn run_keyed(&mut self, cmds: &[(Vec<u8>, Vec<Vec<u8>>)]) -> Result<Vec<Reply>, RefreshError>;
}

impl Keyed for RedisConn {
    fn run_keyed(&mut self, cmds: &[(Vec<u8>, Vec<Vec<u8>>)]) -> Result<Vec<Reply>, RefreshError> {
        let plain: Vec<Vec<Vec<u8>>> = cmds.iter().map(|(_, c)| c.clone()).collect();
        Ok(self.pipeline(&plain)?)
    }
}

impl Keyed for ClusterConn {
    fn run_keyed(&mut self, cmds: &[(Vec<u8>, Vec<Vec<u8>>)]) -> Result<Vec<Reply>, RefreshError> {
        Ok(self.pipeline(cmds)?)
    }
}

/// An error reply among `replies` as an error.
fn server_error(replies: &[Reply], addr: &str) -> Result<(), RefreshError> {
    match replies.iter().find(|r| matches!(r, Reply::Error(_))) {
        Some(Reply::Error(message)) => {
            Err(RedisError::Server { addr: addr.to_string(), message: message.clone() }.into())
        }
        _ => Ok(()),
    }
}

/// A stream entry id `{ms}-{n}`.
pub(super) fn parse_id(id: &[u8]) -> Option<(u64, u64)> {
    let s = std::str::from_utf8(id).ok()?;
    let (a, b) = s.split_once('-')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

fn parse_u64(reply: &Reply) -> Option<u64> {
    match reply {
        Reply::Nil => Some(0),
        Reply::Int(n) => u64::try_from(*n).ok(),
        Reply::Bulk(b) | Reply::Simple(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

pub(super) fn shape(command: &'static str, what: impl Into<String>) -> RefreshError {
    RefreshError::Reply { command, what: what.into() }
}

/// The epoch and counter Redis holds for a part now (0 when absent).
pub(super) fn position(conn: &mut impl Keyed, part: &Part) -> Result<(u64, u64), RefreshError> {
    let get = |key: &str| (key.as_bytes().to_vec(), vec![b"GET".to_vec(), key.as_bytes().to_vec()]);
    let replies = conn.run_keyed(&[get(&part.keys.epoch), get(&part.keys.seq)])?;
    server_error(&replies, &part.name())?;
    let get = |r: &Reply| parse_u64(r).ok_or_else(|| shape("GET", format!("{r:?}")));
    Ok((get(&replies[0])?, get(&replies[1])?))
}

/// The id of the first entry of `part`'s stream at or after `{from_seq}-0`.
pub(super) fn stream_first_from(
    conn: &mut impl Keyed,
    part: &Part,
    from_seq: u64,
) -> Result<Option<(u64, u64)>, RefreshError> {
    let stream = part.keys.stream.as_bytes().to_vec();
    let from = format!("{from_seq}-0").into_bytes();
    let xrange = vec![b"XRANGE".to_vec(), stream.clone(), from, b"+".to_vec(), b"COUNT".to_vec(), b"1".to_vec()];
    let replies = conn.run_keyed(&[(stream, xrange)])?;
    server_error(&replies, &part.name())?;
    let reply = replies.into_iter().next().ok_or_else(|| shape("XRANGE", "no reply"))?;
    let first = reply.into_array().unwrap_or_default().into_iter().next();
    Ok(first
        .and_then(Reply::into_array)
        .and_then(|e| e.into_iter().next())
        .and_then(Reply::into_bytes)
        .and_then(|id| parse_id(&id)))
}

/// Why a finished copy, begun at `noted` (epoch, counter) with `copied` rows,
/// does not show a settled source, if it does not. `previous_rows` is what
/// the copy before this one of the same resync held: a source that moved
/// during the copy but kept its size is busy, not being reloaded.
pub(super) fn unsettled(
    conn: &mut impl Keyed,
    part: &Part,
    noted: (u64, u64),
    copied: u64,
    previous_rows: Option<u64>,
    rows_drift_max: f64,
) -> Result<Option<String>, RefreshError> {
    let (epoch, seq) = position(conn, part)?;
    if epoch != noted.0 {
        return Ok(Some(format!("the epoch changed from {} to {epoch} during the copy", noted.0)));
    }
    if seq < noted.1 {
        return Ok(Some(format!("the counter went back from {} to {seq} during the copy", noted.1)));
    }
    let moved = seq - noted.1;
    if moved > 0 && stream_first_from(conn, part, noted.1 + 1)? != Some((noted.1 + 1, 0)) {
        return Ok(Some(format!("the stream no longer holds entry {} the copy needs replayed", noted.1 + 1)));
    }
    let same_size = previous_rows.is_some_and(|p| p.abs_diff(copied) as f64 <= rows_drift_max * copied as f64);
    if moved > 0 && !same_size {
        let was = previous_rows.map_or(String::new(), |p| format!(" (the copy before had {p})"));
        return Ok(Some(format!("{moved} changes arrived while {copied} rows were copied{was}")));
    }
    Ok(None)
}

/// The most connections one full sync reads over. Redis answers them all on
/// one thread, so past a handful they only queue there; the bound keeps a
/// misconfigured server from opening hundreds of connections per resync.
pub const SYNC_CONNECTIONS_MAX: usize = 16;

/// Key batches (and decoded batches) queued per fetcher between the stages
/// of a parallel copy: enough that no stage waits on the next one's jitter,
/// few enough that the copy's memory stays a few batches per connection.
const BATCHES_QUEUED_PER_FETCHER: usize = 2;

/// The most keys one SCAN asks for in a parallel copy (its COUNT).
const SCAN_COUNT_MAX: usize = 16_384;

/// What a full sync writes: a fresh replica of `part` beside `path`.
pub struct SyncTarget<'a> {
    pub part: &'a Part,
    pub path: &'a Path,
    pub dim: usize,
    pub storage: Storage,
    pub default: &'a [f32],
    pub batch_keys_max: usize,
    /// Connections the copy reads over, the caller's included: 1 to
    /// [`SYNC_CONNECTIONS_MAX`]. With 1 the caller's connection does it all;
    /// with more it SCANs while the others MGET in parallel.
    pub connections: usize,
}

/// Copies every entity key of the part from Redis into a fresh replica file at a
/// temporary name beside the target's path; the caller swaps it in. The
/// returned writer is checkpointed at the counter noted before the copy
/// began, so replaying the stream from there loses nothing written meanwhile.
///
/// `redis` is what `conn` was opened with: the extra connections of a
/// parallel copy are opened the same way (address, credentials, database,
/// TLS, timeouts). An error on any connection fails the whole copy, and
/// every thread the copy started has ended when this returns.
pub fn full_sync(
    conn: &mut RedisConn,
    redis: &RedisConfig,
    target: &SyncTarget<'_>,
    status: Option<&GroupStatus>,
    progress: &mut dyn FnMut(u64),
) -> Result<ReplicaWriter, RefreshError> {
    let SyncTarget { part, path, dim, storage, default, connections, .. } = *target;
    assert!(
        (1..=SYNC_CONNECTIONS_MAX).contains(&connections),
        "{connections} sync connections: callers keep it within 1..={SYNC_CONNECTIONS_MAX}"
    );
    let (epoch, tail) = position(conn, part)?;
    let tmp = temp_path(path, "sync");
    // Sized from the whole database so the copy never stops to grow the
    // file; DBSIZE counts other groups too, an overestimate at most. Three
    // quarters more leaves the copy, once swapped in, under the three
    // quarters full at which the refresher's writer starts growing a file in
    // the background: a fresh copy must not be copied again at once. Rows
    // never written stay holes in the file.
    let dbsize = conn.command(&[b"DBSIZE"])?.as_int().and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
    // The part's change counter bounds its entities (every entity was
    // written by a change) far better than DBSIZE when other groups are
    // large: a file sized by DBSIZE reserves their share of the disk too.
    // An estimate short of the truth only makes the copy grow its file.
    let changes = changes_counted(conn, part)?.unwrap_or(u64::MAX);
    let capacity = match part.layout.bucket_count() {
        1 => with_headroom(dbsize.min(changes)),
        buckets => bucket_capacity(conn, part, (dbsize / buckets as u64).min(changes))?,
    };
    check_key_kind(conn, part)?;
    let (keys, link) = (part.key_kind, part.link);
    let fresh = ReplicaWriter::create_linked(&tmp, &part.group, dim as u32, storage, keys, link, capacity, default)?;
    let mut sink = Sink { fresh, dim, copied: 0, status, progress };
    if connections == 1 {
        copy_serial(conn, target, status, &mut sink)?;
    } else {
        copy_parallel(conn, redis, target, status, &mut sink)?;
    }
    let mut fresh = sink.fresh;
    fresh.checkpoint(Cursor { epoch, seq: tail, change_unix_ms: 0 })?;
    Ok(fresh)
}

/// Refuses a bucket written with another bucket count: its entities would
/// hash to buckets this replica does not look in.
pub(super) fn check_bucket_count(conn: &mut impl Keyed, part: &Part) -> Result<(), RefreshError> {
    let (Some(key), Layout::Bucketed { buckets }) = (&part.keys.buckets, part.layout) else {
        return Ok(());
    };
    let get = (key.as_bytes().to_vec(), vec![b"GET".to_vec(), key.as_bytes().to_vec()]);
    let reply = conn.run_keyed(&[get])?.pop().unwrap_or(Reply::Nil);
    match reply {
        Reply::Nil => Ok(()),
        Reply::Bulk(stored) if stored == buckets.to_string().as_bytes() => Ok(()),
        Reply::Error(message) => Err(RedisError::Server { addr: part.name(), message }.into()),
        other => Err(RefreshError::Buckets {
            key: key.clone(),
            stored: other.as_bytes().map_or_else(|| format!("{other:?}"), |b| String::from_utf8_lossy(b).into_owned()),
            configured: buckets,
        }),
    }
}

/// Refuses a part whose group Redis records with the other key kind
/// (`quiver:keys:g`); a group with no record but a counter was written
/// before kinds were recorded, and holds u64 ids.
pub(super) fn check_key_kind(conn: &mut impl Keyed, part: &Part) -> Result<(), RefreshError> {
    let command = |verb: &[u8], key: &str| (key.as_bytes().to_vec(), vec![verb.to_vec(), key.as_bytes().to_vec()]);
    let replies = conn.run_keyed(&[command(b"GET", &part.keys.kind), command(b"EXISTS", &part.keys.seq)])?;
    server_error(&replies, &part.name())?;
    let stored = match (&replies[0], &replies[1]) {
        (Reply::Bulk(kind), _) => String::from_utf8_lossy(kind).into_owned(),
        (Reply::Nil, Reply::Int(1)) => contract::KIND_U64.to_string(),
        (Reply::Nil, _) => return Ok(()),
        (other, _) => return Err(shape("GET", format!("{other:?}"))),
    };
    if stored == contract::kind_name(part.key_kind) {
        return Ok(());
    }
    Err(RefreshError::KeyKind { group: part.name(), key: part.keys.kind.clone(), stored, configured: part.key_kind })
}

/// Deletes `key`, of the writer's kind; false when it was not there.
pub(super) fn delete(writer: &mut ReplicaWriter, key: EntityKey<'_>) -> bool {
    match key {
        EntityKey::Id(id) => writer.delete(id),
        EntityKey::Str(bytes) => writer.delete_str(bytes),
    }
}

/// A whole group to copy once (`quiver replica sync`): its parts go to
/// `path` (the plain layout) or to one file per bucket beside it, named as
/// the server names them ([`bucket_path`]).
pub struct GroupTarget<'a> {
    pub group: &'a str,
    pub layout: Layout,
    pub key_kind: KeyKind,
    /// The key kind of the group's parent, for a group with one.
    pub link: Option<KeyKind>,
    pub path: &'a Path,
    pub dim: usize,
    pub storage: Storage,
    pub default: &'a [f32],
    pub batch_keys_max: usize,
    pub connections: usize,
}

/// Copies every part of a group into fresh files, from one node or, on a
/// cluster, each bucket from the master of its slot; renames them into place
/// only once every part is copied, so a failure leaves whatever files were
/// there before. `progress` gets the entities copied so far, all parts
/// together. Returns each part's file and writer, in bucket order.
///
/// A bucket whose slot is migrating, or moves while it is copied, fails the
/// copy (a reshard is not waited out here; the server's refresher does): its
/// keys are split between two masters.
pub fn sync_group(
    source: &RedisSource,
    target: &GroupTarget<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<Vec<(PathBuf, ReplicaWriter)>, RefreshError> {
    enum Via {
        Node(RedisConn, RedisConfig),
        Cluster(ClusterConn),
    }
    if matches!(source, RedisSource::Cluster { .. }) && target.layout == Layout::Plain {
        return Err(RefreshError::InitialSync {
            group: target.group.to_string(),
            why: "on a Redis Cluster a group is stored in buckets (each bucket's keys share a slot): give their count"
                .into(),
        });
    }
    let mut via = match source {
        RedisSource::Node(config) => Via::Node(RedisConn::connect(config)?, config.clone()),
        RedisSource::Cluster { config, seeds } => Via::Cluster(ClusterConn::connect(config, seeds)?),
    };
    let moving = |part: &Part, slot: u16| RefreshError::InitialSync {
        group: part.name(),
        why: format!("its hash slot {slot} is moving between masters (a reshard): copy it again once that is over"),
    };
    let mut copies: Vec<(PathBuf, ReplicaWriter)> = Vec::new();
    let mut copy_all = || -> Result<(), RefreshError> {
        let mut copied = 0u64;
        for part in Part::all(target.group, target.layout) {
            let part = part.with_key_kind(target.key_kind).with_link(target.link);
            let path = match target.layout {
                Layout::Plain => target.path.to_path_buf(),
                Layout::Bucketed { .. } => bucket_path(target.path, part.bucket),
            };
            let one = SyncTarget {
                part: &part,
                path: &path,
                dim: target.dim,
                storage: target.storage,
                default: target.default,
                batch_keys_max: target.batch_keys_max,
                connections: target.connections,
            };
            let mut counted = |rows: u64| progress(copied + rows);
            let fresh = match &mut via {
                Via::Node(conn, config) => {
                    check_bucket_count(conn, &part)?;
                    full_sync(conn, config, &one, None, &mut counted)?
                }
                Via::Cluster(cluster) => {
                    let slot = key_slot(part.keys.stream.as_bytes());
                    if !cluster.slot_stable(slot)? {
                        return Err(moving(&part, slot));
                    }
                    check_bucket_count(cluster, &part)?;
                    let master = cluster.master_addr(slot)?;
                    let config = RedisConfig { addr: master.clone(), ..cluster.config().clone() };
                    let fresh = full_sync(cluster.node(&master)?, &config, &one, None, &mut counted)?;
                    cluster.refresh()?;
                    if !cluster.slot_stable(slot)? || cluster.master_addr(slot)? != master {
                        fresh.discard();
                        return Err(moving(&part, slot));
                    }
                    fresh
                }
            };
            copied += fresh.live_rows();
            copies.push((path, fresh));
        }
        Ok(())
    };
    let mut result = copy_all();
    if let (Ok(()), Via::Node(conn, _), Layout::Plain) = (&result, &mut via, target.layout) {
        if copies.iter().all(|(_, fresh)| fresh.live_rows() == 0) {
            result = plain_but_bucketed(conn, target.group);
        }
    }
    if let Err(e) = result {
        for (_, fresh) in copies {
            fresh.discard();
        }
        return Err(e);
    }
    for (path, fresh) in &mut copies {
        fresh.rename_to(path)?;
    }
    Ok(copies)
}

/// An empty plain copy of a group that its writers store in buckets is a
/// mistake, not an empty group: says so, with the count to give.
fn plain_but_bucketed(conn: &mut RedisConn, group: &str) -> Result<(), RefreshError> {
    let Some(key) = Layout::Bucketed { buckets: 1 }.keys(group, 0).buckets else {
        return Ok(());
    };
    match conn.command(&[b"GET", key.as_bytes()])? {
        Reply::Bulk(count) => {
            let count = String::from_utf8_lossy(&count).into_owned();
            Err(RefreshError::InitialSync {
                group: group.to_string(),
                why: format!("no entities in the plain layout, but {key} says it is stored in {count} buckets: give that bucket count"),
            })
        }
        _ => Ok(()),
    }
}

/// Rows to create a bucket's copy with: its slot's key count where the node
/// is a cluster node (exact but for the bucket's own four keys), else its
/// share of the database; with the same headroom as a group's copy.
fn bucket_capacity(conn: &mut RedisConn, part: &Part, share: u64) -> Result<u64, RefreshError> {
    let slot = super::redis_cluster::key_slot(part.keys.stream.as_bytes()).to_string();
    let keys = match conn.command(&[b"CLUSTER", b"COUNTKEYSINSLOT", slot.as_bytes()]) {
        Ok(Reply::Int(n)) => u64::try_from(n).unwrap_or(0),
        // A node without cluster support says so.
        Ok(_) | Err(RedisError::Server { .. }) => share + share / 2,
        Err(e) => return Err(e.into()),
    };
    Ok(with_headroom(keys))
}

/// The part's change counter (`quiver:seq:…`), when it is set.
fn changes_counted(conn: &mut RedisConn, part: &Part) -> Result<Option<u64>, RefreshError> {
    let reply = conn.command(&[b"GET", part.keys.seq.as_bytes()])?;
    Ok(reply.as_bytes().and_then(|b| std::str::from_utf8(b).ok()?.parse().ok()))
}

/// Rows for a copy of about `keys` entities (see `full_sync`).
fn with_headroom(keys: u64) -> u64 {
    (keys + keys / 4 * 3).clamp(1024, crate::features::replica::ROW_CAPACITY_MAX)
}

/// One MGET's entities, decoded: `keys[i]`'s vector is the `i`-th run of
/// `dim` values in `values`.
struct Rows {
    keys: Vec<EntityKeyBuf>,
    values: Vec<f32>,
    /// `keys[i]`'s parent key, for a group with a parent.
    parents: Vec<Option<EntityKeyBuf>>,
}

/// Where decoded rows go: the one writer of the fresh file, on the caller's
/// thread (its inserts take `&mut self`), and the copy's progress.
struct Sink<'a, 'p> {
    fresh: ReplicaWriter,
    dim: usize,
    copied: u64,
    status: Option<&'a GroupStatus>,
    progress: &'p mut dyn FnMut(u64),
}

impl Sink<'_, '_> {
    fn take(&mut self, rows: &Rows) -> Result<(), RefreshError> {
        for ((key, v), parent) in rows.keys.iter().zip(rows.values.chunks_exact(self.dim)).zip(&rows.parents) {
            self.fresh.upsert_linked(key.as_key(), v, parent.as_ref().map(EntityKeyBuf::as_key))?;
            self.copied += 1;
        }
        (self.progress)(self.copied);
        if let Some(s) = self.status {
            s.sync_rows.store(self.copied, Ordering::Relaxed);
        }
        Ok(())
    }
}

fn scan_command(cursor: &[u8], pattern: &[u8], count: usize) -> Vec<Vec<u8>> {
    vec![
        b"SCAN".to_vec(),
        cursor.to_vec(),
        b"MATCH".to_vec(),
        pattern.to_vec(),
        b"COUNT".to_vec(),
        count.max(1).to_string().into_bytes(),
    ]
}

/// The next cursor and the keys of a SCAN reply.
fn scan_reply(reply: Reply) -> Result<(Vec<u8>, Vec<Vec<u8>>), RefreshError> {
    if let Reply::Error(message) = reply {
        return Err(shape("SCAN", message));
    }
    let mut parts = reply.into_array().ok_or_else(|| shape("SCAN", "not an array"))?.into_iter();
    let (Some(next), Some(found)) = (parts.next(), parts.next()) else {
        return Err(shape("SCAN", "fewer than two elements"));
    };
    let cursor = next.into_bytes().ok_or_else(|| shape("SCAN", "cursor is not a string"))?;
    let keys = found
        .into_array()
        .ok_or_else(|| shape("SCAN", "keys are not an array"))?
        .into_iter()
        .filter_map(Reply::into_bytes)
        .collect();
    Ok((cursor, keys))
}

/// Sends one command held as owned arguments; an error reply is an error.
fn run(conn: &mut RedisConn, command: &[Vec<u8>]) -> Result<Reply, RedisError> {
    let args: Vec<&[u8]> = command.iter().map(Vec::as_slice).collect();
    conn.command(&args)
}

fn mget_command(keys: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut mget = Vec::with_capacity(keys.len() + 1);
    mget.push(b"MGET".to_vec());
    mget.extend(keys.iter().cloned());
    mget
}

/// Decodes the MGET reply for `keys`; bad data is skipped (and counted). A
/// nil is a key deleted since SCAN saw it (not bad data: the stream replay
/// after the copy deletes it here too) or one of another type, which TYPE,
/// asked on `conn` for all of the batch's nils in one round trip, tells apart.
fn decode_rows(
    conn: &mut RedisConn,
    part: &Part,
    dim: usize,
    keys: &[Vec<u8>],
    reply: Reply,
    status: Option<&GroupStatus>,
) -> Result<Rows, RefreshError> {
    let values = match reply {
        Reply::Array(values) => values,
        Reply::Error(message) => return Err(RedisError::Server { addr: conn.addr().to_string(), message }.into()),
        other => return Err(shape("MGET", format!("not an array: {other:?}"))),
    };
    if values.len() != keys.len() {
        return Err(shape("MGET", format!("{} values for {} keys", values.len(), keys.len())));
    }
    let mut rows = Rows {
        keys: Vec::with_capacity(keys.len()),
        values: Vec::with_capacity(keys.len() * dim),
        parents: Vec::with_capacity(keys.len()),
    };
    let mut nils = Vec::new();
    for (i, (key, value)) in keys.iter().zip(values).enumerate() {
        let decoded = match value {
            Reply::Bulk(bytes) => part
                .parse_key(key)
                .ok_or_else(|| format!("key {} is not {}", String::from_utf8_lossy(key), part.key_form()))
                .and_then(|parsed| {
                    contract::split_value(&bytes, dim, part.link)
                        .and_then(|(vector, parent)| {
                            contract::decode_vector_into(vector, dim, &mut rows.values)?;
                            Ok((parsed.to_buf(), parent.map(EntityKey::to_buf)))
                        })
                        .map_err(|e| format!("key {}: {e}", String::from_utf8_lossy(key)))
                }),
            Reply::Nil => {
                nils.push(i);
                continue;
            }
            other => Err(format!("key {}: unexpected reply {other:?}", String::from_utf8_lossy(key))),
        };
        match decoded {
            Ok((parsed, parent)) => {
                rows.keys.push(parsed);
                rows.parents.push(parent);
            }
            Err(why) => skip(status, part, &why),
        }
    }
    if nils.is_empty() {
        return Ok(rows);
    }
    let types: Vec<Vec<Vec<u8>>> = nils.iter().map(|&i| vec![b"TYPE".to_vec(), keys[i].clone()]).collect();
    for (&i, reply) in nils.iter().zip(conn.pipeline(&types)?) {
        match reply {
            Reply::Simple(t) if t == b"none" => {}
            Reply::Simple(t) => skip(
                status,
                part,
                &format!(
                    "key {} holds a {}, not a string",
                    String::from_utf8_lossy(&keys[i]),
                    String::from_utf8_lossy(&t)
                ),
            ),
            Reply::Error(message) => return Err(RedisError::Server { addr: conn.addr().to_string(), message }.into()),
            other => return Err(shape("TYPE", format!("{other:?}"))),
        }
    }
    Ok(rows)
}

/// The copy over the caller's connection alone: each round trip carries the
/// next SCAN and the MGET of the keys the previous SCAN returned, so it
/// costs one round trip per batch; decoding and inserting wait for it.
fn copy_serial(
    conn: &mut RedisConn,
    target: &SyncTarget<'_>,
    status: Option<&GroupStatus>,
    sink: &mut Sink<'_, '_>,
) -> Result<(), RefreshError> {
    if let Some(keys) = slot_keys(conn, target.part)? {
        for batch in keys.chunks(target.batch_keys_max.max(1)) {
            let reply = conn.command(&mget_command(batch).iter().map(Vec::as_slice).collect::<Vec<_>>())?;
            let rows = decode_rows(conn, target.part, target.dim, batch, reply, status)?;
            sink.take(&rows)?;
        }
        return Ok(());
    }
    let pattern = target.part.scan_pattern().into_bytes();
    let mut cursor = b"0".to_vec();
    let mut scanned_all = false;
    let mut pending: Vec<Vec<u8>> = Vec::new();
    while !(scanned_all && pending.is_empty()) {
        let mut commands = Vec::with_capacity(2);
        if !scanned_all {
            commands.push(scan_command(&cursor, &pattern, target.batch_keys_max));
        }
        let keys = std::mem::take(&mut pending);
        if !keys.is_empty() {
            commands.push(mget_command(&keys));
        }
        let mut replies = conn.pipeline(&commands)?.into_iter();
        if !scanned_all {
            (cursor, pending) = scan_reply(replies.next().ok_or_else(|| shape("SCAN", "no reply"))?)?;
            scanned_all = cursor == b"0";
        }
        if keys.is_empty() {
            continue;
        }
        let reply = replies.next().ok_or_else(|| shape("MGET", "no reply"))?;
        let rows = decode_rows(conn, target.part, target.dim, &keys, reply, status)?;
        sink.take(&rows)?;
    }
    Ok(())
}

/// The copy over `target.connections`: a scanner thread SCANs on the
/// caller's connection and hands key batches to fetcher threads, one per
/// extra connection, which MGET and decode them in parallel; this thread
/// inserts what they decoded. Channels between the stages are bounded, so
/// a slow stage holds the others back instead of queueing without limit.
///
/// Stopping: the first stage that fails raises `failed`, which the others
/// check before each batch; a stage blocked on a channel is released when
/// the stage on its other side ends and drops its end. Every thread is
/// joined before this returns, and the first error is the copy's.
fn copy_parallel(
    conn: &mut RedisConn,
    redis: &RedisConfig,
    target: &SyncTarget<'_>,
    status: Option<&GroupStatus>,
    sink: &mut Sink<'_, '_>,
) -> Result<(), RefreshError> {
    let fetchers = target.connections - 1;
    let queued = fetchers * BATCHES_QUEUED_PER_FETCHER;
    let failed = AtomicBool::new(false);
    let (keys_tx, keys_rx) = mpsc::sync_channel::<Vec<Vec<u8>>>(queued);
    let (rows_tx, rows_rx) = mpsc::sync_channel::<Rows>(queued);
    // Shared by the fetchers only: when the last one ends, the scanner's
    // sends fail and it stops too.
    let keys_rx = Arc::new(Mutex::new(keys_rx));
    let (part, dim, batch_keys_max) = (target.part, target.dim, target.batch_keys_max.max(1));
    let scan_count = (batch_keys_max * fetchers).min(SCAN_COUNT_MAX);
    std::thread::scope(|scope| {
        let mut fetcher_threads = Vec::with_capacity(fetchers);
        let mut spawn_error = None;
        for n in 1..=fetchers {
            let (keys_rx, rows_tx, failed) = (keys_rx.clone(), rows_tx.clone(), &failed);
            let spawned = std::thread::Builder::new().name(format!("quiver-sync-{n}")).spawn_scoped(scope, move || {
                let result = fetch(redis, part, dim, &keys_rx, &rows_tx, failed, status);
                if result.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                result
            });
            match spawned {
                Ok(thread) => fetcher_threads.push(thread),
                Err(e) => {
                    spawn_error = Some(RefreshError::Thread(e));
                    break;
                }
            }
        }
        drop((keys_rx, rows_tx));
        let scanner = match spawn_error {
            Some(_) => {
                // Fetchers already started wait for keys until this goes.
                drop(keys_tx);
                None
            }
            None => {
                let failed = &failed;
                let spawned =
                    std::thread::Builder::new().name("quiver-sync-scan".into()).spawn_scoped(scope, move || {
                        let result = scan(conn, part, scan_count, batch_keys_max, &keys_tx, failed);
                        if result.is_err() {
                            failed.store(true, Ordering::Relaxed);
                        }
                        result
                    });
                match spawned {
                    Ok(thread) => Some(thread),
                    Err(e) => {
                        spawn_error = Some(RefreshError::Thread(e));
                        None
                    }
                }
            }
        };
        let mut first_error = spawn_error;
        if first_error.is_none() {
            for rows in &rows_rx {
                if let Err(e) = sink.take(&rows) {
                    failed.store(true, Ordering::Relaxed);
                    first_error = Some(e);
                    break;
                }
            }
        }
        // Fetchers blocked on a full channel are released by its end going.
        drop(rows_rx);
        let mut scanned_all = false;
        if let Some(thread) = scanner {
            match joined(thread) {
                Ok(all) => scanned_all = all,
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        for thread in fetcher_threads {
            if let Err(e) = joined(thread) {
                first_error = first_error.or(Some(e));
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => {
                // Stages stop early only after one of them failed.
                assert!(scanned_all, "a parallel copy ended without an error before its scan did");
                Ok(())
            }
        }
    })
}

/// What a copy's thread returned; its panic is the caller's.
fn joined<T>(thread: std::thread::ScopedJoinHandle<'_, T>) -> T {
    thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The most keys a bucket's slot may hold for its keys to be listed in one
/// `CLUSTER GETKEYSINSLOT` (a reply of a few MB that Redis builds in one
/// go); a larger slot is SCANned like a plain group.
const SLOT_KEYS_MAX: i64 = 262_144;

/// A bucket's entity keys listed from its slot, when `conn` is a cluster
/// node holding at most [`SLOT_KEYS_MAX`] keys there: SCAN would walk the
/// node's whole keyspace for each of its buckets, this reads the slot's
/// own index. `None` for a plain group, a node without cluster support, or
/// a slot too large. Other keys that share the slot are left out.
fn slot_keys(conn: &mut RedisConn, part: &Part) -> Result<Option<Vec<Vec<u8>>>, RefreshError> {
    if part.layout == contract::Layout::Plain {
        return Ok(None);
    }
    let slot = super::redis_cluster::key_slot(part.keys.stream.as_bytes()).to_string();
    let count = match conn.command(&[b"CLUSTER", b"COUNTKEYSINSLOT", slot.as_bytes()]) {
        Ok(Reply::Int(n)) if n <= SLOT_KEYS_MAX => n,
        Ok(_) | Err(RedisError::Server { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    // Room for keys written between the two commands; the stream replay
    // after the copy brings any beyond it.
    let asked = (count + count / 8 + 64).to_string();
    let reply = conn.command(&[b"CLUSTER", b"GETKEYSINSLOT", slot.as_bytes(), asked.as_bytes()])?;
    let prefix = part.entity_prefix().into_bytes();
    let keys = reply
        .into_array()
        .ok_or_else(|| shape("CLUSTER GETKEYSINSLOT", "not an array"))?
        .into_iter()
        .filter_map(Reply::into_bytes)
        .filter(|k| k.starts_with(&prefix))
        .collect();
    Ok(Some(keys))
}

/// The scanner: SCANs `scan_count` keys at a time (enough for a batch per
/// fetcher, so that the one SCAN in flight keeps them all busy) and hands
/// them on in batches of `batch_keys_max`. True once the scan went through
/// the whole keyspace; false when it stopped because another stage ended.
fn scan(
    conn: &mut RedisConn,
    part: &Part,
    scan_count: usize,
    batch_keys_max: usize,
    keys_tx: &mpsc::SyncSender<Vec<Vec<u8>>>,
    failed: &AtomicBool,
) -> Result<bool, RefreshError> {
    if let Some(keys) = slot_keys(conn, part)? {
        for batch in keys.chunks(batch_keys_max) {
            if failed.load(Ordering::Relaxed) || keys_tx.send(batch.to_vec()).is_err() {
                return Ok(false);
            }
        }
        return Ok(true);
    }
    let pattern = part.scan_pattern().into_bytes();
    let mut cursor = b"0".to_vec();
    loop {
        if failed.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let (next, mut keys) = scan_reply(run(conn, &scan_command(&cursor, &pattern, scan_count))?)?;
        cursor = next;
        while !keys.is_empty() {
            let rest = keys.split_off(keys.len().min(batch_keys_max));
            if keys_tx.send(keys).is_err() {
                return Ok(false);
            }
            keys = rest;
        }
        if cursor == b"0" {
            return Ok(true);
        }
    }
}

/// A fetcher: opens its own connection the way `redis` says, then MGETs and
/// decodes key batches until there are no more (or another stage failed).
fn fetch(
    redis: &RedisConfig,
    part: &Part,
    dim: usize,
    keys_rx: &Mutex<mpsc::Receiver<Vec<Vec<u8>>>>,
    rows_tx: &mpsc::SyncSender<Rows>,
    failed: &AtomicBool,
    status: Option<&GroupStatus>,
) -> Result<(), RefreshError> {
    let mut conn = RedisConn::connect(redis)?;
    loop {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        // The lock is held only while waiting for the next batch; a poisoned
        // lock means another fetcher panicked, and the scope re-raises that.
        let next = keys_rx.lock().map_err(|_| shape("MGET", "a fetcher panicked"))?.recv();
        let Ok(keys) = next else {
            return Ok(());
        };
        let reply = run(&mut conn, &mget_command(&keys))?;
        let rows = decode_rows(&mut conn, part, dim, &keys, reply, status)?;
        if rows_tx.send(rows).is_err() {
            return Ok(());
        }
    }
}

/// The key, vector and parent key of an entity key and value, or why they are bad data.
pub(super) fn entity<'k>(
    part: &Part,
    key: &'k [u8],
    value: &'k [u8],
    dim: usize,
) -> Result<(EntityKey<'k>, Vec<f32>, Option<EntityKey<'k>>), String> {
    let name = || String::from_utf8_lossy(key).into_owned();
    let parsed = part.parse_key(key).ok_or_else(|| format!("key {} is not {}", name(), part.key_form()))?;
    let bad = |e: ContractError| format!("key {}: {e}", name());
    let (vector, parent) = contract::split_value(value, dim, part.link).map_err(bad)?;
    let v = contract::decode_vector(vector, dim).map_err(bad)?;
    Ok((parsed, v, parent))
}

pub(super) fn skip(status: Option<&GroupStatus>, part: &Part, why: &str) {
    tracing::warn!(group = %part.name(), "skipped bad feature data: {why}");
    if let Some(s) = status {
        GroupStatus::bump(&s.skipped_total, 1);
    }
}
