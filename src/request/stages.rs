//! The stages of [`RequestPath::handle`], read top to bottom:
//!
//! admit (decode, budget, readiness, rate, model, canary, shed)
//! → assemble (input shape, lookup, drift; or the raw rows a caller sent)
//! → look up the cache (and answer from it first, if so configured)
//! → route (budget, breaker: which rung answers, hand-off or inline)
//! → run (the inline kernel and the check after it) or hand off
//!   (`handoff::hand_off`)
//! → finish (explain when asked and the time left fits, respond, drift,
//!   cache fill, shadow sample, timings).
//!
//! Each stage is a function whose signature names the parts of the path it
//! reads (`&`) and writes (`&mut`), and returns the next one's input or a
//! [`Rejection`], which names the answer the request gets instead; [`answer`]
//! is the one place that turns a rejection into a response.
//!
//! Stages that touch many parts take one argument per part: the signature
//! is the record of what a stage reads and writes, so it is not folded into
//! a context struct (hence the `too_many_arguments` allowances).

use std::borrow::Cow;
use std::sync::Arc;

use super::explained;
use super::policies::Policies;
use super::scratch::{Answer, Inputs, Outcome};
use super::shadow::ShadowQueue;
use super::versions::{Served, Versions};
use super::{context_id_value, Handled, Replicas, StepDown, Telemetry};
use crate::deadline::{Clock, Deadline};
use crate::features::feed::FeedStatus;
use crate::features::groups::{Absent, Scope, GROUPS_MAX};
use crate::features::replica::{decode_link, key_hash, EntityKey, KeyKind, ReplicaView, KEY_BYTES_MAX};
use crate::metrics::{Stage, REASONS};
use crate::model::graph::embedding_index;
use crate::request::admission::{Admit, Peer};
use crate::request::cache::{hash_words, Key, ScoreCache};
use crate::request::ladder::BreakerState;
use crate::request::shed::ShedAnswer;
use crate::wire::{self, ExplainSkipped, Reason, ResponseFields, Status, Tier};

/// A request payload as the shard read it.
pub(super) struct Frame<'p, 'a> {
    pub(super) payload: &'p [u8],
    pub(super) read_at_ns: u64,
    /// Who sent it (what admission binds client ids to).
    pub(super) peer: Peer<'a>,
}

/// How a request that leaves the primary path is answered.
pub(super) enum Rejection {
    /// A response without scores.
    Fail { request_id: u64, status: Status, why: Cow<'static, str> },
    /// The protocol floor (benchmark mode): `Ok`, no scores.
    Floor { request_id: u64, read_at_ns: u64 },
    /// Shed by priority before any lookup, answered with the static default.
    Shed { step: StepDown },
    /// Every candidate is cached, and the cache answers before the primary.
    Cached { step: StepDown, version: u32, now_ns: u64 },
    /// A lower rung answers.
    StepDown { step: StepDown, reason: Reason },
}

impl Rejection {
    pub(super) fn fail(request_id: u64, status: Status, why: impl Into<Cow<'static, str>>) -> Rejection {
        Rejection::Fail { request_id, status, why: why.into() }
    }
}

/// A decoded request that may be served, and by which version.
pub(super) struct Admitted<'p> {
    request: wire::Request<'p>,
    read_at_ns: u64,
    decoded_ns: u64,
    deadline: Deadline,
    /// Index in `Versions::served`: the named or default model, or its canary.
    pub(super) chosen: usize,
}

impl<'p> Admitted<'p> {
    /// The request as decoded (fields read lazily from the frame), for the
    /// decision log.
    pub(super) fn raw(&self) -> wire::fb::ScoreRequest<'p> {
        self.request.raw
    }

    /// Model input floats the request's rows take in `served`'s layout.
    pub(super) fn floats(&self, served: &Served) -> usize {
        self.request.candidates * served.layout.row_dim
    }
}

/// A request whose model input rows are in `Inputs::x` (or, handed off,
/// in its job slot).
#[derive(Clone, Copy)]
pub(super) struct Assembled {
    pub(super) step: StepDown,
    /// Its score-cache key, item left 0.
    pub(super) cache_key: Key,
    pub(super) chosen: usize,
    pub(super) version: u32,
    pub(super) user_id: u64,
    /// When the lookup finished.
    pub(super) at_ns: u64,
}

/// Where the primary rung runs.
pub(super) enum Route {
    /// On the inference stage; the response follows from `complete`.
    HandOff,
    /// On the shard, now.
    Inline,
}

/// A request the primary scored in time; scores in `Answer::logits`.
pub(super) struct Ran {
    pub(super) assembled: Assembled,
    /// When its scores were ready.
    pub(super) scored_ns: u64,
}

/// Decode, then check the request itself: budget, readiness, rate,
/// model (and its canary), shedding.
/// `slot_fill` is the fill of the job slots (0..1, 0 inline), which shedding
/// reads as load.
pub(super) fn admit<'p>(
    frame: Frame<'p, '_>,
    clock: &impl Clock,
    policies: &mut Policies,
    versions: &mut Versions,
    slot_fill: f64,
    telemetry: &mut Telemetry,
) -> Result<Admitted<'p>, Rejection> {
    let Frame { payload, read_at_ns, peer } = frame;
    // Verify the FlatBuffer with limits before reading any field.
    let request = wire::decode_request(payload, &policies.request_limits).map_err(|e| {
        let id = wire::salvage_request_id(payload, &policies.request_limits);
        Rejection::fail(id, Status::BadRequest, e.to_string())
    })?;
    let request_id = request.request_id();
    if policies.floor {
        return Err(Rejection::Floor { request_id, read_at_ns });
    }
    let limits = &policies.limits;
    let budget_us = match request.budget_us() {
        0 => limits.budget_us_default,
        b => b.min(limits.budget_us_max),
    };
    let deadline = Deadline::from_budget(read_at_ns / 1_000, budget_us);
    let decoded_ns = clock.now_ns();
    telemetry.times.record_ns(Stage::Decode, decoded_ns.saturating_sub(read_at_ns));
    if deadline.cannot_fit(decoded_ns / 1_000, 0) {
        return Err(Rejection::fail(request_id, Status::DeadlineExceeded, "budget spent before decode finished"));
    }
    if !policies.readiness.is_ready() {
        return Err(Rejection::fail(request_id, Status::Overloaded, "server is not ready"));
    }
    let priority = match policies.admission.admit_from(request.raw.client_id(), peer, decoded_ns) {
        // A client asking for more than its cap is shed as the cap.
        Admit::Admitted { priority_max } => request.raw.priority().min(priority_max),
        Admit::OverRate => {
            return Err(Rejection::fail(request_id, Status::RateLimited, "client over its rate limit"));
        }
        Admit::WrongSource => {
            telemetry.counters.admission_wrong_source += 1;
            let why = "client_id is bound to other source networks or certificate names than this connection's";
            return Err(Rejection::fail(request_id, Status::RateLimited, why));
        }
    };
    let Some(chosen) = versions.choose(request.model(), sticky_key(&request, &policies.canary_group)) else {
        return Err(Rejection::fail(request_id, Status::ModelNotFound, "unknown model"));
    };
    if policies.shedder.enabled()
        && policies.shed_now(priority, read_at_ns, decoded_ns, slot_fill, &mut telemetry.counters)
    {
        if policies.shedder.answer() == ShedAnswer::Overloaded {
            let why = "shed: over capacity, priority below the shed level";
            return Err(Rejection::fail(request_id, Status::Overloaded, why));
        }
        let step = StepDown {
            request_id,
            rows: request.candidates,
            row_dim: 0,
            read_at_ns,
            deadline,
            missing: 0,
            fallback: false,
            cached: false,
            default_score: versions.served[chosen].default_score,
            explain_top_k: explain_top_k(&request),
            explained: explained_count(&request),
        };
        return Err(Rejection::Shed { step });
    }
    versions.served[chosen].requests += 1;
    Ok(Admitted { request, read_at_ns, decoded_ns, deadline, chosen })
}

/// Checks the inputs against the chosen version's layout, then writes the
/// model input rows into `slot_x` (the job slot taken for them, so rows
/// handed off are written once) or else `Inputs::x`: the user vector once,
/// one item vector per candidate, the context; counts what is missing and
/// records the context's drift.
#[allow(clippy::too_many_arguments)]
pub(super) fn assemble(
    a: Admitted<'_>,
    clock: &impl Clock,
    served: &mut Served,
    replicas: &mut Replicas,
    inputs: &mut Inputs,
    slot_x: Option<&mut [f32]>,
    telemetry: &mut Telemetry,
) -> Result<Assembled, Rejection> {
    let Inputs {
        x: scratch,
        vectors,
        rows: found_rows,
        ids,
        hashes,
        candidate_keys,
        links: inputs_links,
        links_next: inputs_links_next,
        context: context_floats,
    } = inputs;
    let x = match slot_x {
        Some(x) => x,
        None => &mut scratch[..],
    };
    let request = &a.request;
    if let Some(sent) = request.rows() {
        return assemble_raw(&a, sent, clock, served, candidate_keys, x, telemetry);
    }
    let request_id = request.request_id();
    let bad = |why: String| Rejection::fail(request_id, Status::BadRequest, why);
    let layout = &served.layout;
    let context = request.context();
    let context_dim = layout.context.map_or(0, |(_, d)| d);
    if !context.is_empty() && context.len() != context_dim {
        return Err(bad(format!("context has {} floats, the model takes {context_dim}", context.len())));
    }
    let context_ids = request.context_ids();
    let ids_dim = layout.context_ids.map_or(0, |(_, d)| d);
    if !context_ids.is_empty() && context_ids.len() != ids_dim {
        return Err(bad(format!("context_ids has {} ids, the model takes {ids_dim}", context_ids.len())));
    }

    let rows = request.candidates;
    let keys = keys_by_group(request, replicas, rows).map_err(bad)?;
    let row_dim = layout.row_dim;
    let x = &mut x[..rows * row_dim];
    let items = request.item_ids();
    candidate_keys.clear();
    if items.is_empty() {
        candidate_keys.resize(rows, 0);
    } else {
        candidate_keys.extend(items.iter());
    }
    let mut request_key = request.user_id();
    let mut missing = 0u32;
    // One atomic load per group; the lookups below load no table.
    replicas.refresh();
    // Each request-scope key as its table files it (a string key by its
    // hash, computed once here), then, with several request-scope groups,
    // every one of their rows starts loading before any is read, so the
    // groups' cache misses overlap instead of queueing one after another
    // (one group has nothing to overlap with).
    let mut filed = [None; GROUPS_MAX];
    let request_scope = || layout.groups.iter().filter(|s| s.scope == Scope::Request);
    for seg in request_scope() {
        filed[seg.group] = keys[seg.group].filed_first();
    }
    if request_scope().count() > 1 {
        for seg in request_scope() {
            if let Some(key) = filed[seg.group] {
                replicas.groups[seg.group].view.prefetch_slot(key);
            }
        }
        for seg in request_scope() {
            if let Some(key) = filed[seg.group] {
                replicas.groups[seg.group].view.prefetch_row(key);
            }
        }
    }
    // Links carried from one step of a chain of parents to the next.
    let (mut links, mut links_next) = (&mut inputs_links[..], &mut inputs_links_next[..]);
    let mut link_words = 0;
    for step in &layout.lookups {
        let g = &replicas.groups[step.group];
        let dim = step.dim;
        let group_tag = step.group as u64;
        let n = match step.scope {
            Scope::Request => 1,
            Scope::Candidate => rows,
        };
        // A Feast view with a ttl reads its rows' links too: their event times.
        let kept_words = if step.keep_links || g.ttl_s > 0 { g.view.link_words() } else { 0 };
        let links_out = &mut links_next[..n * kept_words];
        let vectors = &mut vectors[..n * dim];
        let missing_before = missing;
        if step.through_links {
            // Keyed by the links the step before read: no request key.
            let from = &links[..n * link_words];
            missing += read_through(&g.view, g.key, from, link_words, ids, found_rows, vectors, links_out);
        } else {
            match step.scope {
                Scope::Request => {
                    let (found, key) = match (keys[step.group], filed[step.group]) {
                        (Keys::Strs(v), Some(hash)) => {
                            (g.view.read_linked_into(hash, v.get(0).as_bytes(), vectors, links_out), hash)
                        }
                        (_, Some(id)) => (g.view.read_linked_into(id, &[], vectors, links_out), id),
                        (_, None) if g.absent == Absent::Default => {
                            g.view.default_into(vectors);
                            links_out.fill(0);
                            (false, ABSENT_KEY)
                        }
                        (_, None) => return Err(bad(absent_why(&g.name))),
                    };
                    missing += u32::from(!found);
                    if !(Some(step.group) == replicas.user && matches!(keys[step.group], Keys::One(_))) {
                        request_key = hash_words([request_key, group_tag, key]);
                    }
                }
                Scope::Candidate => {
                    // Batched so the candidates' memory loads overlap (prefetch).
                    match keys[step.group] {
                        Keys::Ids(v) | Keys::ItemIds(v) => {
                            ids.clear();
                            ids.extend(v.iter());
                            missing += g.view.read_many_into(ids, found_rows, vectors, links_out) as u32;
                            // `item_ids` already are the candidates' keys.
                            if matches!(keys[step.group], Keys::Ids(_)) {
                                for (k, id) in candidate_keys.iter_mut().zip(ids.iter()) {
                                    *k = hash_words([*k, group_tag, *id]);
                                }
                            }
                        }
                        Keys::Strs(v) => {
                            let keys = v.iter().map(str::as_bytes);
                            missing += g.view.read_many_str_into(keys, hashes, found_rows, vectors, links_out) as u32;
                            for (k, hash) in candidate_keys.iter_mut().zip(hashes.iter()) {
                                *k = hash_words([*k, group_tag, *hash]);
                            }
                        }
                        Keys::Absent if g.absent == Absent::Default => {
                            for v in vectors.chunks_exact_mut(dim) {
                                g.view.default_into(v);
                            }
                            links_out.fill(0);
                            missing += rows as u32;
                            for k in candidate_keys.iter_mut() {
                                *k = hash_words([*k, group_tag, ABSENT_KEY]);
                            }
                        }
                        Keys::One(_) | Keys::Absent => return Err(bad(absent_why(&g.name))),
                    }
                }
            }
        }
        if g.ttl_s > 0 {
            missing += expire_rows(vectors, dim, links_out, kept_words, clock.unix_s().saturating_sub(g.ttl_s));
        }
        if g.nulls_missing && dim > 0 {
            // Absent and expired rows are all NaN: each row with a NaN
            // counts once, whichever way it is missing.
            missing = missing_before + (missing - missing_before).max(rows_with_nan(vectors, dim));
        }
        if let Some(off) = step.offset {
            match step.scope {
                // One row, broadcast to every candidate.
                Scope::Request => {
                    for row in x.chunks_exact_mut(row_dim) {
                        row[off..off + dim].copy_from_slice(vectors);
                    }
                }
                Scope::Candidate => {
                    for (row, v) in x.chunks_exact_mut(row_dim).zip(vectors.chunks_exact(dim)) {
                        row[off..off + dim].copy_from_slice(v);
                    }
                }
            }
        }
        std::mem::swap(&mut links, &mut links_next);
        link_words = kept_words;
    }
    if let Some((off, dim)) = layout.context {
        // Checked above: the context is empty or `dim` floats, within the
        // wire's `context_len_max`, the scratch's capacity.
        context_floats.clear();
        context_floats.extend(context.iter());
        context_floats.resize(dim, 0.0);
        for row in x.chunks_exact_mut(row_dim) {
            row[off..off + dim].copy_from_slice(context_floats);
        }
    }
    record_drift(served, x, rows);
    if let Some((off, dim)) = served.layout.context_ids {
        missing += if context_ids.is_empty() {
            dim as u32
        } else {
            let id_rows = served.id_rows.iter();
            context_ids.iter().zip(id_rows).filter(|(id, rows)| id >= *rows || *id >= 1 << 24).count() as u32
        };
        for row in x.chunks_exact_mut(row_dim) {
            let dst = &mut row[off..off + dim];
            if context_ids.is_empty() {
                dst.fill(-1.0);
            } else {
                for (d, id) in dst.iter_mut().zip(context_ids.iter()) {
                    *d = context_id_value(id);
                }
            }
        }
    }
    missing += unknown_ids(served, x);
    let context_key = hash_words(context.iter().map(|c| u64::from(c.to_bits())).chain(context_ids.iter()));
    Ok(assembled(&a, clock, served, telemetry, missing, (request_key, context_key), request.user_id()))
}

/// Closes the assemble stage: times the lookup and says what the lower
/// rungs and the cache need, the cache key made of the request's
/// (user, context) words.
fn assembled(
    a: &Admitted<'_>,
    clock: &impl Clock,
    served: &Served,
    telemetry: &mut Telemetry,
    missing: u32,
    (user, context): (u64, u64),
    user_id: u64,
) -> Assembled {
    let request = &a.request;
    let at_ns = clock.now_ns();
    telemetry.times.record_ns(Stage::Lookup, at_ns.saturating_sub(a.decoded_ns));
    let version = served.model.version;
    let cache_key = Key { model: served.name_hash, version, user, item: 0, context };
    let step = StepDown {
        request_id: request.request_id(),
        rows: request.candidates,
        row_dim: served.layout.row_dim,
        read_at_ns: a.read_at_ns,
        deadline: a.deadline,
        missing,
        fallback: served.fallback_fits,
        cached: false,
        default_score: served.default_score,
        explain_top_k: explain_top_k(request),
        explained: explained_count(request),
    };
    Assembled { step, cache_key, chosen: a.chosen, version, user_id, at_ns }
}

/// The cache-key word standing for the user of a request that sent raw
/// rows: its candidates' keys are the rows' own hashes.
const RAW_ROWS_KEY: u64 = 0x2A77_0F10_A75E_5EED;

/// [`assemble`] for a request that sent the model's input rows itself:
/// checks their width against the chosen version's and copies them into
/// `x`. Nothing is looked up, so only categorical ids no embedding row
/// matches count as missing; each candidate's cache key is its row's hash,
/// so equal rows share a cached score.
fn assemble_raw(
    a: &Admitted<'_>,
    sent: flatbuffers::Vector<'_, f32>,
    clock: &impl Clock,
    served: &mut Served,
    candidate_keys: &mut Vec<u64>,
    x: &mut [f32],
    telemetry: &mut Telemetry,
) -> Result<Assembled, Rejection> {
    let request = &a.request;
    let (rows, row_dim) = (request.candidates, served.layout.row_dim);
    // `decode_request` checked `sent` holds `rows` rows of equal width.
    if sent.len() != rows * row_dim {
        let why = format!(
            "raw rows: {rows} rows of {} floats; the model '{}' takes rows of {row_dim} (its input width)",
            sent.len() / rows,
            served.model.name
        );
        return Err(Rejection::fail(request.request_id(), Status::BadRequest, why));
    }
    let x = &mut x[..rows * row_dim];
    for (dst, v) in x.iter_mut().zip(sent.iter()) {
        *dst = v;
    }
    record_drift(served, x, rows);
    let missing = unknown_ids(served, x);
    candidate_keys.clear();
    candidate_keys.extend(x.chunks_exact(row_dim).map(|row| hash_words(row.iter().map(|v| u64::from(v.to_bits())))));
    Ok(assembled(a, clock, served, telemetry, missing, (RAW_ROWS_KEY, 0), 0))
}

/// Records the inputs' drift as the rows `x` hold them (the context, zeros
/// when none was sent; each group's row, its default when missing), in the
/// calibration's order: the per-request ones from the first row, the
/// per-candidate ones from one candidate's row, which the request count
/// picks, weighted by the candidates (an unbiased sample of the rows'
/// moments at the cost of one row).
fn record_drift(served: &mut Served, x: &[f32], rows: usize) {
    let row_dim = served.layout.row_dim;
    if let Some(d) = &mut served.drift {
        let first = &x[..row_dim];
        let pick = (served.requests as usize) % rows;
        let picked = &x[pick * row_dim..(pick + 1) * row_dim];
        let per_request = served.drift_request_segments;
        let columns = served.drift_columns.iter().enumerate().flat_map(|(i, &(at, dim))| {
            let row = if i < per_request { first } else { picked };
            row[at..at + dim].iter().copied()
        });
        d.record_context(columns, rows);
    }
}

/// Categorical ids in float columns that no embedding row matches: they
/// read the default row, so they count as missing, like an unknown key.
fn unknown_ids(served: &Served, x: &[f32]) -> u32 {
    let row_dim = served.layout.row_dim;
    let mut missing = 0;
    for &(c, table_rows, per_request) in served.index_cols.iter() {
        let bad = |row: &[f32]| embedding_index(row[c], table_rows).is_none();
        missing += if per_request {
            u32::from(bad(&x[..row_dim]))
        } else {
            x.chunks_exact(row_dim).filter(|r| bad(r)).count() as u32
        };
    }
    missing
}

/// The request's `explain_top_k`, within `EXPLAIN_TOP_K_MAX` (checked by
/// `decode_request`).
fn explain_top_k(request: &wire::Request<'_>) -> u16 {
    u16::try_from(request.explain_top_k()).expect("decode_request bounds explain_top_k")
}

/// How many candidates the request has explained, within
/// `EXPLAIN_CANDIDATES_MAX` when it asks (checked by `decode_request`).
fn explained_count(request: &wire::Request<'_>) -> u16 {
    u16::try_from(request.explained()).unwrap_or(u16::MAX)
}

/// Serves as missing (NaN) each row of `vectors` (`dim` wide) whose event
/// time, in its `link_words` of `links`, is before `oldest_s` (Unix
/// seconds: now less the view's ttl), as Feast does; returns how many. One
/// compare per row; a row with no time (not found, or written without one)
/// is left as it is.
fn expire_rows(vectors: &mut [f32], dim: usize, links: &[u32], link_words: usize, oldest_s: u64) -> u32 {
    let mut expired = 0;
    for (row, link) in vectors.chunks_exact_mut(dim).zip(links.chunks_exact(link_words)) {
        let ts = crate::features::feast::rows::row_time_s(link);
        if ts != 0 && ts < oldest_s {
            row.fill(f32::NAN);
            expired += 1;
        }
    }
    expired
}

/// How many rows of `vectors` (`dim` wide) hold a NaN (a Feast null).
fn rows_with_nan(vectors: &[f32], dim: usize) -> u32 {
    vectors.chunks_exact(dim).filter(|row| row.iter().fold(false, |nan, x| nan | x.is_nan())).count() as u32
}

/// Looks up the rows the `links` name (`link_words` per key, as the lookup
/// before in a chain of parents returned them) in `view`, a group keyed by
/// `kind`: each into `out` (its width per key) and its own links into
/// `links_out` (when not empty). A key whose row names no parent, or names
/// one that is not there, reads the default row and counts as missing.
/// Three passes, as `Replica::read_many_into`, so the loads overlap: each
/// link's index slot, then its row, then the copies. `filed` and `present`
/// are scratch.
#[allow(clippy::too_many_arguments)]
fn read_through(
    view: &ReplicaView,
    kind: KeyKind,
    links: &[u32],
    link_words: usize,
    filed: &mut Vec<u64>,
    present: &mut [u32],
    out: &mut [f32],
    links_out: &mut [u32],
) -> u32 {
    let mut buf = [0u8; KEY_BYTES_MAX as usize];
    filed.clear();
    for (link, p) in links.chunks_exact(link_words).zip(present.iter_mut()) {
        let key = decode_link(link, kind, &mut buf);
        *p = u32::from(key.is_some());
        let at = key.map_or(0, EntityKey::bucket_hash);
        if key.is_some() {
            view.prefetch_slot(at);
        }
        filed.push(at);
    }
    for (&at, &p) in filed.iter().zip(present.iter()) {
        if p == 1 {
            view.prefetch_row(at);
        }
    }
    let dim = view.dim();
    let kept = view.link_words();
    let mut missing = 0;
    for (i, (link, dst)) in links.chunks_exact(link_words).zip(out.chunks_exact_mut(dim)).enumerate() {
        let link_out = links_out.get_mut(i * kept..(i + 1) * kept).unwrap_or_default();
        // A u64 parent is its filed key; only a string's bytes are decoded again.
        let found = match (present[i], kind) {
            (0, _) => {
                view.default_into(dst);
                link_out.fill(0);
                false
            }
            (_, KeyKind::U64) => view.read_linked_into(filed[i], &[], dst, link_out),
            (_, KeyKind::Str { .. }) => {
                let bytes = match decode_link(link, kind, &mut buf) {
                    Some(EntityKey::Str(bytes)) => bytes,
                    _ => unreachable!("pass one decoded this link as a string key"),
                };
                view.read_linked_into(filed[i], bytes, dst, link_out)
            }
        };
        missing += u32::from(!found);
    }
    missing
}

/// The key a request's canary choice is sticky by: its key of the
/// configured group (a string key by its hash), else `user_id`.
fn sticky_key(request: &wire::Request<'_>, group: &str) -> u64 {
    let entry = request.groups().iter().find(|g| g.group() == Some(group));
    match entry.map(|g| (g.ids(), g.keys())) {
        Some((Some(ids), _)) if !ids.is_empty() => ids.get(0),
        Some((_, Some(keys))) if !keys.is_empty() => key_hash(keys.get(0).as_bytes()),
        _ => request.user_id(),
    }
}

/// The cache-key word of a group whose key the request left out (its
/// default row served): no key a request can send hashes to it by design,
/// and a collision only shares a cached score between two default rows.
const ABSENT_KEY: u64 = 0xA85E_A75E_D0DE_FA17;

/// Where one group's keys are in a request.
#[derive(Clone, Copy)]
enum Keys<'p> {
    /// `user_id`, keying the group `user`.
    One(u64),
    Ids(flatbuffers::Vector<'p, u64>),
    Strs(flatbuffers::Vector<'p, flatbuffers::ForwardsUOffset<&'p str>>),
    /// `item_ids`, keying the group `item`.
    ItemIds(flatbuffers::Vector<'p, u64>),
    Absent,
}

impl Keys<'_> {
    /// The first key as its table files it: a u64 key itself, a string
    /// key's [`key_hash`]; none when the request carries no key.
    #[inline]
    fn filed_first(self) -> Option<u64> {
        match self {
            Keys::One(id) => Some(id),
            Keys::Ids(v) | Keys::ItemIds(v) => Some(v.get(0)),
            Keys::Strs(v) => Some(key_hash(v.get(0).as_bytes())),
            Keys::Absent => None,
        }
    }
}

fn absent_why(group: &str) -> String {
    format!("the model reads feature group '{group}', and the request carries no key for it")
}

/// Each served group's keys in `request`, checked: every named group is
/// served and named once, its keys are of the group's type (strings within
/// its length bound) and as many as its scope takes (one, or one per
/// candidate). `user` and `item` fall back to `user_id` and `item_ids`.
fn keys_by_group<'p>(
    request: &wire::Request<'p>,
    replicas: &Replicas,
    rows: usize,
) -> Result<[Keys<'p>; GROUPS_MAX], String> {
    let mut keys = [Keys::Absent; GROUPS_MAX];
    let mut named = [false; GROUPS_MAX];
    for entry in request.groups() {
        // The wire layer refused an unnamed entry.
        let name = entry.group().unwrap_or("");
        let Some(at) = replicas.position(name) else {
            return Err(format!("unknown feature group '{name}'"));
        };
        if named[at] {
            return Err(format!("feature group '{name}' is named twice"));
        }
        named[at] = true;
        let g = &replicas.groups[at];
        if let Some(child) = &g.child {
            return Err(format!(
                "feature group '{name}' is keyed through the links in '{child}''s rows; a request does not carry its keys"
            ));
        }
        let count = wire::key_count(&entry);
        let want = match g.scope {
            Scope::Request => 1,
            Scope::Candidate => rows,
        };
        if count != want {
            return Err(match g.scope {
                Scope::Request => format!("group '{name}' takes one key per request, the request sends {count}"),
                Scope::Candidate => {
                    format!("group '{name}' takes one key per candidate: {count} keys for {rows} candidates")
                }
            });
        }
        keys[at] = match (g.key, entry.ids(), entry.keys()) {
            (KeyKind::U64, Some(ids), None) => Keys::Ids(ids),
            (KeyKind::U64, _, Some(_)) => {
                return Err(format!("group '{name}' is keyed by u64 ids, the request sends string keys"));
            }
            (KeyKind::Str { bytes_max }, None, Some(strs)) => {
                if let Some(k) = strs.iter().find(|k| k.is_empty() || k.len() > bytes_max as usize) {
                    return Err(format!("group '{name}': a key of {} bytes; keys are 1 to {bytes_max} bytes", k.len()));
                }
                Keys::Strs(strs)
            }
            (KeyKind::Str { .. }, Some(_), _) => {
                return Err(format!("group '{name}' is keyed by strings, the request sends u64 ids"));
            }
            // `count == want >= 1`: some vector is present.
            (_, None, None) => Keys::Absent,
        };
    }
    if let Some(at) = replicas.user.filter(|&at| !named[at] && replicas.groups[at].key == KeyKind::U64) {
        keys[at] = Keys::One(request.user_id());
    }
    let items = request.item_ids();
    if let Some(at) = replicas.item.filter(|&at| !named[at] && replicas.groups[at].key == KeyKind::U64) {
        if !items.is_empty() {
            keys[at] = Keys::ItemIds(items);
        }
    }
    Ok(keys)
}

/// Checks the time the lookup left, then looks every candidate up in the
/// score cache (`a.step.cached` when all are there, their scores in
/// `Answer::cached`); the cache answers at once when it comes before the
/// primary.
pub(super) fn look_up_cache(
    a: &mut Assembled,
    policies: &Policies,
    cache: &mut ScoreCache,
    inputs: &Inputs,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
) -> Result<(), Rejection> {
    if a.step.deadline.cannot_fit(a.at_ns / 1_000, 0) {
        return Err(Rejection::fail(a.step.request_id, Status::DeadlineExceeded, "budget spent during lookup"));
    }
    let items = &inputs.candidate_keys[..a.step.rows];
    a.step.cached = cached_scores(cache, &a.cache_key, items, a.at_ns, &mut answer.cached, telemetry);
    if a.step.cached && policies.cache_before_primary {
        return Err(Rejection::Cached { step: a.step, version: a.version, now_ns: a.at_ns });
    }
    Ok(())
}

/// Whether every one of `items` is in the cache under `key` at `now_ns`;
/// their scores go to `cached` (up to the first missing one).
pub(super) fn cached_scores(
    cache: &mut ScoreCache,
    key: &Key,
    items: &[u64],
    now_ns: u64,
    cached: &mut [f32],
    telemetry: &mut Telemetry,
) -> bool {
    if !cache.enabled() {
        return false;
    }
    let mut all = true;
    for (slot, &item) in cached.iter_mut().zip(items) {
        match cache.get(&Key { item, ..*key }, now_ns) {
            Some(score) => *slot = score,
            None => {
                all = false;
                break;
            }
        }
    }
    telemetry.counters.cache_hits = cache.hits;
    telemetry.counters.cache_misses = cache.misses;
    all
}

/// Picks the rung: a lower one when the primary cannot fit the time left or
/// its breaker is open, else the primary on the stage (`stage_us`, its
/// expected turnaround, when one is attached and the rows fit a job slot)
/// or inline.
pub(super) fn route(
    a: &Assembled,
    policies: &mut Policies,
    stage_us: Option<u64>,
    served: &Served,
) -> Result<Route, Rejection> {
    let (now_ns, rows) = (a.at_ns, a.step.rows);
    let primary_us = match stage_us {
        Some(us) => us + policies.ladder.reserve_us,
        None => served.kernel_cost.expected_us(rows),
    };
    // Budget first: a half-open breaker's probe is spent only on a
    // request that can use it.
    let breaker = &mut policies.breaker;
    if breaker.state() == BreakerState::Closed && a.step.deadline.cannot_fit(now_ns / 1_000, primary_us) {
        return Err(Rejection::StepDown { step: a.step, reason: Reason::Budget });
    }
    if !breaker.allow(now_ns) {
        return Err(Rejection::StepDown { step: a.step, reason: Reason::BreakerOpen });
    }
    Ok(if stage_us.is_some() { Route::HandOff } else { Route::Inline })
}

/// Runs the primary on the shard over the model input rows `x`, then
/// checks it finished in time. A backend that fails (onnxruntime's error,
/// or one that could not be built) steps down with reason `model_error`.
pub(super) fn run(
    a: Assembled,
    clock: &impl Clock,
    policies: &mut Policies,
    served: &mut Served,
    x: &[f32],
    answer: &mut Answer,
    telemetry: &mut Telemetry,
) -> Result<Ran, Rejection> {
    let (rows, row_dim) = (a.step.rows, a.step.row_dim);
    let logits = &mut answer.logits[..rows];
    let scored = served.backend.score(&x[..rows * row_dim], rows, logits);
    let after_kernel_ns = clock.now_ns();
    if scored.is_err() {
        policies.breaker.record(true, after_kernel_ns);
        return Err(Rejection::StepDown { step: a.step, reason: Reason::ModelError });
    }
    let kernel_ns = after_kernel_ns.saturating_sub(a.at_ns);
    telemetry.times.record_ns(Stage::Kernel, kernel_ns);
    served.kernel_cost.observe(rows, kernel_ns / 1_000);
    for l in logits.iter_mut() {
        *l = served.model.score(*l);
    }
    let late = a.step.deadline.cannot_fit(after_kernel_ns / 1_000, 0);
    policies.breaker.record(late, after_kernel_ns);
    if late {
        let id = a.step.request_id;
        return Err(Rejection::fail(id, Status::DeadlineExceeded, "kernel finished past the deadline"));
    }
    Ok(Ran { assembled: a, scored_ns: after_kernel_ns })
}

/// Answers the primary's scores (in `Answer::logits`), then what follows
/// from them: drift counts, the cache fill, the shadow sample and the stage
/// timings. `x` and `items` are the request's model input rows and item ids
/// (in `Inputs` inline, in the job slot handed off). The one finish of
/// both inference modes.
#[allow(clippy::too_many_arguments)]
pub(super) fn finish(
    ran: Ran,
    x: &[f32],
    items: &[u64],
    clock: &impl Clock,
    versions: &mut Versions,
    cache: &mut ScoreCache,
    shadows: &mut ShadowQueue,
    feed: &Option<Arc<FeedStatus>>,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
    out: &mut Vec<u8>,
) -> Handled {
    let Ran { assembled: a, scored_ns } = ran;
    let rows = a.step.rows;
    // Explained by the version that scored it, if it is still served here.
    let scorer =
        versions.served.get_mut(a.chosen).filter(|s| s.name_hash == a.cache_key.model && s.model.version == a.version);
    let scores = &answer.logits[..rows];
    let counters = &mut telemetry.counters;
    match explained::explain(&a.step, x, scores, scorer, clock, &mut answer.explained, counters) {
        explained::Outcome::Explained { late: true } => {
            let why = "explaining finished past the deadline";
            fail(a.step.request_id, Status::DeadlineExceeded, why, answer, telemetry, out);
        }
        explained::Outcome::Explained { late: false } | explained::Outcome::Skipped => {
            respond_ok(&a.step, Tier::Primary, Reason::None, a.version, scored_ns, feed, answer, telemetry, out);
        }
    }
    let returned = &answer.logits[..rows];
    // A request handed off before a swap of versions may name another
    // version's place: it is then left out of drift counts and shadow
    // samples (rare, and those are samples anyway).
    let chosen =
        versions.served.get_mut(a.chosen).filter(|s| s.name_hash == a.cache_key.model && s.model.version == a.version);
    let same_version = chosen.is_some();
    if let Some(d) = chosen.and_then(|s| s.drift.as_mut()) {
        d.record_scores(returned);
    }
    cache.put_all(&a.cache_key, items, returned, scored_ns);
    if same_version {
        shadows.sample(&versions.served, a.chosen, a.user_id, x, returned, a.step.row_dim);
    }
    let done_ns = clock.now_ns();
    telemetry.times.record_ns(Stage::Respond, done_ns.saturating_sub(scored_ns));
    telemetry.times.record_ns(Stage::EndToEnd, done_ns.saturating_sub(a.step.read_at_ns));
    Handled::Answered
}

/// The one place a rejection becomes a response. `x` holds the model input
/// rows, for the fallback model.
#[allow(clippy::too_many_arguments)]
pub(super) fn answer(
    rejection: Rejection,
    x: &[f32],
    clock: &impl Clock,
    fallback: Option<&mut Served>,
    feed: &Option<Arc<FeedStatus>>,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
    out: &mut Vec<u8>,
) -> Handled {
    match rejection {
        Rejection::Fail { request_id, status, why } => fail(request_id, status, &why, answer, telemetry, out),
        Rejection::Floor { request_id, read_at_ns } => {
            respond_floor(request_id, read_at_ns, clock, answer, telemetry, out)
        }
        Rejection::Shed { step } => answer_shed(&step, clock, feed, answer, telemetry, out),
        Rejection::Cached { step, version, now_ns } => {
            answer.logits[..step.rows].copy_from_slice(&answer.cached[..step.rows]);
            respond_ok(&step, Tier::Cached, Reason::None, version, now_ns, feed, answer, telemetry, out);
            telemetry.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(step.read_at_ns));
            Handled::Answered
        }
        Rejection::StepDown { step, reason } => {
            step_down(&step, reason, &x[..step.rows * step.row_dim], clock, fallback, feed, answer, telemetry, out)
        }
    }
}

/// Answers a shed request with its model's static default, reason
/// `overload` (`shed.answer = "default"`).
fn answer_shed(
    step: &StepDown,
    clock: &impl Clock,
    feed: &Option<Arc<FeedStatus>>,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
    out: &mut Vec<u8>,
) -> Handled {
    answer.logits[..step.rows].fill(step.default_score);
    let now_ns = clock.now_ns();
    respond_ok(step, Tier::Default, Reason::Overload, 0, now_ns, feed, answer, telemetry, out);
    telemetry.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(step.read_at_ns));
    Handled::Answered
}

/// Counts and encodes a response without scores.
pub(super) fn fail(
    request_id: u64,
    status: Status,
    error: &str,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
    out: &mut Vec<u8>,
) -> Handled {
    let counters = &mut telemetry.counters;
    counters.requests += 1;
    counters.by_status[usize::from(status.0).min(7)] += 1;
    answer.last = Outcome { status: status.0, ..Outcome::default() };
    answer.encoder.encode(&ResponseFields::failure(request_id, status, error), out);
    Handled::Answered
}

/// Encodes an `Ok` response with the scores in `Answer::logits`.
#[allow(clippy::too_many_arguments)]
pub(super) fn respond_ok(
    step: &StepDown,
    tier: Tier,
    reason: Reason,
    version: u32,
    now_ns: u64,
    feed: &Option<Arc<FeedStatus>>,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
    out: &mut Vec<u8>,
) {
    let counters = &mut telemetry.counters;
    counters.requests += 1;
    counters.by_status[usize::from(Status::Ok.0)] += 1;
    counters.by_tier[usize::from(tier.0).min(3)] += 1;
    counters.by_reason[usize::from(reason.0).min(REASONS - 1)] += 1;
    counters.features_missing += u64::from(step.missing);
    counters.candidates_scored += step.rows as u64;
    let server_us = now_ns.saturating_sub(step.read_at_ns) / 1_000;
    // Whether the feed has gone past its staleness bound; responses say so.
    let features_stale = feed.as_ref().is_some_and(|f| f.is_stale(now_ns));
    counters.stale_responses += u64::from(features_stale);
    let server_us = u32::try_from(server_us).unwrap_or(u32::MAX);
    let missing = u16::try_from(step.missing).unwrap_or(u16::MAX);
    // Only the primary explains (`finish` did, just before); a lower rung
    // says it did not.
    if tier != Tier::Primary {
        let asked = step.explain_top_k > 0;
        answer.explained.skip(if asked { ExplainSkipped::LowerRung } else { ExplainSkipped::None });
    }
    answer.last = Outcome {
        status: Status::Ok.0,
        tier: tier.0,
        reason: reason.0,
        version,
        server_us,
        missing,
        stale: features_stale,
        rows: step.rows,
        row_dim: step.row_dim,
    };
    answer.encoder.encode(
        &ResponseFields {
            request_id: step.request_id,
            status: Status::Ok,
            scores: &answer.logits[..step.rows],
            tier,
            model_version: version,
            server_us,
            features_missing: missing,
            error: "",
            reason,
            features_stale,
            explain: answer.explained.fields(),
        },
        out,
    );
}

/// Answers from the rungs below the primary: the cached scores when
/// `step.cached` (they are in `Answer::cached`), the fallback model when it
/// reads the same inputs and fits the time left, else the static default.
/// `x` holds the request's model input rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn step_down(
    step: &StepDown,
    reason: Reason,
    x: &[f32],
    clock: &impl Clock,
    fallback: Option<&mut Served>,
    feed: &Option<Arc<FeedStatus>>,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
    out: &mut Vec<u8>,
) -> Handled {
    let now_ns = clock.now_ns();
    let rows = step.rows;
    let mut tier = Tier::Default;
    let mut version = 0;
    if step.cached {
        answer.logits[..rows].copy_from_slice(&answer.cached[..rows]);
        tier = Tier::Cached;
    }
    if let Some(fb) = fallback.filter(|_| step.fallback && tier == Tier::Default) {
        if !step.deadline.cannot_fit(now_ns / 1_000, fb.kernel_cost.expected_us(rows)) {
            let started_ns = clock.now_ns();
            let scored = fb.backend.score(x, rows, &mut answer.logits[..rows]);
            fb.kernel_cost.observe(rows, clock.now_ns().saturating_sub(started_ns) / 1_000);
            // A fallback that cannot score leaves the static default.
            if scored.is_ok() {
                for l in answer.logits[..rows].iter_mut() {
                    *l = fb.model.score(*l);
                }
                tier = Tier::Fallback;
                version = fb.model.version;
            }
        }
    }
    if tier == Tier::Default {
        answer.logits[..rows].fill(step.default_score);
    }
    let now_ns = clock.now_ns();
    if step.deadline.cannot_fit(now_ns / 1_000, 0) {
        // No `Ok` once the deadline was seen to pass: the fallback model
        // finished late, or the step-down itself came late (a give-up
        // the shard reached after the deadline).
        telemetry.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(step.read_at_ns));
        let why = if tier == Tier::Fallback {
            "the fallback model finished after the deadline"
        } else {
            "the deadline passed before a lower rung could answer"
        };
        return fail(step.request_id, Status::DeadlineExceeded, why, answer, telemetry, out);
    }
    respond_ok(step, tier, reason, version, now_ns, feed, answer, telemetry, out);
    telemetry.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(step.read_at_ns));
    Handled::Answered
}

/// The protocol floor's answer: `Ok`, no scores, no lookup, no model.
fn respond_floor(
    request_id: u64,
    read_at_ns: u64,
    clock: &impl Clock,
    answer: &mut Answer,
    telemetry: &mut Telemetry,
    out: &mut Vec<u8>,
) -> Handled {
    let counters = &mut telemetry.counters;
    counters.requests += 1;
    counters.by_status[usize::from(Status::Ok.0)] += 1;
    counters.by_tier[usize::from(Tier::Primary.0)] += 1;
    let now_ns = clock.now_ns();
    let fields = ResponseFields {
        server_us: u32::try_from(now_ns.saturating_sub(read_at_ns) / 1_000).unwrap_or(u32::MAX),
        tier: Tier::Primary,
        ..ResponseFields::failure(request_id, Status::Ok, "")
    };
    answer.encoder.encode(&fields, out);
    telemetry.times.record_ns(Stage::EndToEnd, clock.now_ns().saturating_sub(read_at_ns));
    Handled::Answered
}
