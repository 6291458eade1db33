//! The request path's side of the decision log: after a response is
//! encoded, whether its decision is logged (the always rules, then the
//! sample by key or request id at the client's, model's or default rate),
//! and the record handed to the shard's ring, built from borrowed parts on
//! the stack, so logging allocates nothing.
//!
//! Three kinds of decision reach it:
//!
//! - answered on the shard once a model was chosen ([`log_answered`]): the
//!   keys from the request, the rows from the shard's inputs or the
//!   reserved job slot;
//! - refused before a model was chosen ([`log_refused`]): a bad frame, an
//!   admission refusal, a spent budget, an unknown model, a shed; the keys
//!   when the frame is readable, no rows;
//! - handed to the inference thread ([`stage`], then [`log_completed`]):
//!   at the hand-off, while the frame is still there, the record's spans
//!   and keys are encoded into the job slot's staging bytes ([`Staged`]);
//!   when the response is written (by the stage's scores, a give-up or a
//!   step-down), the record is finished from them, the slot's rows and the
//!   answer.
//!
//! With `always_log_shadow_diff`, a decision just queued for its shadow
//! version (either kind) is not put yet: its record waits in the shadow
//! slot ([`Held`], [`hold`]) and is finished by [`log_shadowed`] once the
//! shadow scored it, logged when the sample or an always rule took it or
//! the shadow disagrees by more than the threshold, and holding the
//! shadow's scores. Each record says why it was logged
//! (`decision_log::record::why`).
use super::scratch::Outcome;
use super::versions::Served;
use super::Replicas;
use crate::decision_log::record::{
    encode_middle, middle_len, why, DecisionRef, KeysRef, Middle, ShadowRef, Span, KEY_GROUPS_MAX, SPANS_MAX,
};
use crate::decision_log::{SampleKey, Sampler, ShardLog};
use crate::features::groups::GROUPS_MAX;
use crate::model::layout::InputLayout;
use crate::wire::{fb, RequestLimits, Status, Tier};

/// Bytes of spans and keys one handed-off request may stage: a request's
/// keys take no more than its frame, up to this; a record with more is
/// dropped and counted (too large).
pub(super) const STAGED_BYTES_MAX: usize = 64 * 1024;

/// The key `sampler` decides `raw` by: the first key of its key group
/// (`user_id` for `user` when the request names no such group), else the
/// request id.
fn sample_key<'a>(sampler: &Sampler, raw: &fb::ScoreRequest<'a>) -> SampleKey<'a> {
    let Some(group) = sampler.key_group.as_deref() else {
        return SampleKey::Id(raw.request_id());
    };
    if let Some(g) = raw.groups().and_then(|gs| gs.iter().find(|g| g.group() == Some(group))) {
        if let Some(id) = g.ids().filter(|v| !v.is_empty()).map(|v| v.get(0)) {
            return SampleKey::Id(id);
        }
        if let Some(key) = g.keys().filter(|v| !v.is_empty()).map(|v| v.get(0)) {
            return SampleKey::Str(key);
        }
    }
    if group == "user" {
        return SampleKey::Id(raw.user_id());
    }
    SampleKey::Id(raw.request_id())
}

/// Whether the sample takes a decision of `model` on `raw`.
fn in_sample(sampler: &Sampler, model: &str, raw: &fb::ScoreRequest<'_>) -> bool {
    !sampler.samples_none() && sampler.sampled(model, raw.client_id(), sample_key(sampler, raw))
}

/// The spans and keys of a record, on the stack.
struct Parts<'a> {
    spans: [Span<'a>; SPANS_MAX],
    n_spans: usize,
    keys: [(&'a str, KeysRef<'a>); KEY_GROUPS_MAX],
    n_keys: usize,
}

impl<'a> Parts<'a> {
    fn middle(&'a self) -> Middle<'a> {
        Middle::Parts { spans: &self.spans[..self.n_spans], keys: &self.keys[..self.n_keys] }
    }
}

/// The replica position of group `group`: the change sequence its refresher
/// last published (`quiver_replica_applied_seq`), read after the lookup, so
/// no row read holds a later change; else its file's checkpoint.
fn position(replicas: &Replicas, group: usize) -> u64 {
    let Some(g) = replicas.groups.get(group) else {
        return 0;
    };
    match replicas.feed.as_ref().and_then(|f| f.group(&g.name)) {
        Some(status) => status.applied_seq.load(std::sync::atomic::Ordering::Relaxed),
        None => g.view.handle().load().cursor_at_open().seq,
    }
}

/// The spans of `layout` (none without one) and every group's keys in `raw`
/// (none without it).
fn parts<'a>(layout: Option<&'a InputLayout>, replicas: &'a Replicas, raw: Option<&fb::ScoreRequest<'a>>) -> Parts<'a> {
    let mut p =
        Parts { spans: [Span::EMPTY; SPANS_MAX], n_spans: 0, keys: [("", KeysRef::None); KEY_GROUPS_MAX], n_keys: 0 };
    if let Some(layout) = layout {
        for seg in layout.groups.iter().take(GROUPS_MAX) {
            let name = replicas.groups.get(seg.group).map_or("", |g| &*g.name);
            let position = position(replicas, seg.group);
            p.spans[p.n_spans] = Span { name, offset: seg.offset as u32, dim: seg.dim as u32, position };
            p.n_spans += 1;
        }
        for (name, part) in [("context", layout.context), ("context_id", layout.context_ids)] {
            if let Some((offset, dim)) = part {
                p.spans[p.n_spans] = Span { name, offset: offset as u32, dim: dim as u32, position: 0 };
                p.n_spans += 1;
            }
        }
    }
    // A request that sent raw rows carries no keys: its record holds the
    // rows alone.
    let Some(raw) = raw.filter(|r| r.rows().is_none()) else {
        return p;
    };
    let groups = raw.groups().unwrap_or_default();
    for g in groups.iter().take(KEY_GROUPS_MAX - 2) {
        let k = match (g.ids(), g.keys()) {
            (Some(ids), _) => KeysRef::Ids(ids),
            (None, Some(strs)) => KeysRef::Strs(strs),
            (None, None) => KeysRef::None,
        };
        p.keys[p.n_keys] = (g.group().unwrap_or(""), k);
        p.n_keys += 1;
    }
    let named = |name: &str| groups.iter().any(|g| g.group() == Some(name));
    // The older fields key `user` and `item` when no group entry does.
    if replicas.user.is_some() && !named("user") {
        p.keys[p.n_keys] = ("user", KeysRef::One(raw.user_id()));
        p.n_keys += 1;
    }
    if let Some(items) = raw.item_ids().filter(|v| !v.is_empty() && !named("item")) {
        p.keys[p.n_keys] = ("item", KeysRef::Ids(items));
        p.n_keys += 1;
    }
    p
}

/// What every record holds besides its middle, rows and outcome.
#[derive(Clone, Copy, Debug)]
pub(super) struct Head {
    request_id: u64,
    client_id: u32,
    budget_us: u32,
    received_unix_ns: i64,
}

impl Head {
    fn of(raw: &fb::ScoreRequest<'_>, received_unix_ns: i64) -> Head {
        Head { request_id: raw.request_id(), client_id: raw.client_id(), budget_us: raw.budget_us(), received_unix_ns }
    }
}

/// Encodes one decision into the ring: the outcome's rows of `x` (when
/// they were assembled at `row_dim`), its scores, why it is logged
/// (`why` bits) and the shadow's scores when it waited for them.
#[allow(clippy::too_many_arguments)]
fn put(
    log: &mut ShardLog,
    head: Head,
    model: &str,
    version: u32,
    row_dim: usize,
    middle: Middle<'_>,
    o: &Outcome,
    x: &[f32],
    scores: &[f32],
    why: u8,
    shadow: Option<ShadowRef<'_>>,
) {
    let ok = o.status == Status::Ok.0;
    let rows = if ok { o.rows } else { 0 };
    let assembled = ok && o.row_dim == row_dim && row_dim > 0;
    log.put(&DecisionRef {
        request_id: head.request_id,
        client_id: head.client_id,
        received_unix_ns: head.received_unix_ns,
        budget_us: head.budget_us,
        server_us: o.server_us,
        model,
        model_version: if ok { o.version } else { version },
        status: o.status,
        tier: o.tier,
        reason: o.reason,
        features_missing: o.missing,
        features_stale: o.stale,
        rows: rows as u32,
        row_dim: row_dim as u32,
        middle,
        x: x.get(..rows * row_dim).filter(|_| assembled),
        scores: scores.get(..rows).filter(|_| ok),
        why,
        shadow: shadow.filter(|s| ok && s.scores.len() == rows),
    });
}

/// Why a decision would be logged now: the always rule that takes it and
/// whether the sample does (bits of `why`; 0: not logged, unless its
/// shadow disagrees).
fn why_now(sampler: &Sampler, o: &Outcome, sampled: bool) -> u8 {
    let rule = sampler.always_rule(o.status == Status::Ok.0, o.tier == Tier::Primary.0);
    rule | if sampled { why::SAMPLE } else { 0 }
}

/// A decision's record waiting in a shadow slot for the shadow's scores
/// (`always_log_shadow_diff`): what `put` needs besides the rows and the
/// returned scores (the slot's) and the spans and keys (its staging
/// bytes, `staged` long).
#[derive(Clone, Copy, Debug)]
pub(super) struct Held {
    head: Head,
    /// Why it is logged whatever the shadow says (bits of `why`; 0: only
    /// if the shadow disagrees).
    why: u8,
    /// The model's name (`Served::name_hash`) and the version answered.
    name_hash: u64,
    version: u32,
    row_dim: usize,
    outcome: Outcome,
    staged: usize,
}

/// Makes the record of a decision just queued for its shadow wait in the
/// shadow slot (`held`, `staging`): its spans and keys are copied in
/// (`middle`, at most the staging bytes). False when they do not fit: it
/// is then logged now, as without the rule.
#[allow(clippy::too_many_arguments)]
fn hold(
    (held, staging): (&mut Option<Held>, &mut [u8]),
    head: Head,
    why: u8,
    (name_hash, version): (u64, u32),
    row_dim: usize,
    outcome: &Outcome,
    middle_len: usize,
    encode: impl FnOnce(&mut [u8]),
) -> bool {
    let Some(out) = staging.get_mut(..middle_len) else {
        return false;
    };
    encode(out);
    *held = Some(Held { head, why, name_hash, version, row_dim, outcome: *outcome, staged: middle_len });
    true
}

/// Finishes a record that waited for its shadow: `x` and `returned` are
/// the slot's rows and the scores answered, `shadow` the shadow's scores
/// (`None` when it could not score, or its queue was dropped). Logged when
/// the sample or an always rule took it, or when for some candidate
/// |returned − shadow| exceeds `always_log_shadow_diff` (NaN counts as
/// exceeding).
pub(super) fn log_shadowed(
    log: &mut ShardLog,
    held: &Held,
    served: &[Served],
    staging: &[u8],
    x: &[f32],
    returned: &[f32],
    shadow: Option<ShadowRef<'_>>,
) {
    let mut bits = held.why;
    if let (Some(s), Some(limit)) = (shadow, log.sampling.load().shadow_diff) {
        let exceeds = |d: f32| d.is_nan() || d > limit;
        if returned.iter().zip(s.scores).any(|(a, b)| exceeds((a - b).abs())) {
            bits |= why::SHADOW_DIFF;
        }
    }
    let Some(middle) = staging.get(..held.staged).filter(|_| bits != 0) else {
        return;
    };
    let model = served.iter().find(|v| v.name_hash == held.name_hash).map_or("", |v| &*v.model.name);
    let o = &held.outcome;
    put(log, held.head, model, held.version, held.row_dim, Middle::Encoded(middle), o, x, returned, bits, shadow);
}

/// What of one request answered on the shard, its model chosen, the log
/// may record.
pub(super) struct Answered<'a> {
    pub(super) raw: fb::ScoreRequest<'a>,
    pub(super) served: &'a Served,
    pub(super) outcome: &'a Outcome,
    /// The request's assembled rows (at least `rows × row_dim`, when
    /// assembled) and its scores (at least `rows`).
    pub(super) x: &'a [f32],
    pub(super) scores: &'a [f32],
    pub(super) received_unix_ns: i64,
}

/// Where a record waits for its shadow's scores: a shadow slot's held
/// record and staging bytes (`ShadowQueue::holding`), when the decision
/// was just queued for its shadow and records can wait.
pub(super) type Waits<'a> = Option<(&'a mut Option<Held>, &'a mut [u8])>;

/// Logs `a` when the rules or the sample say so; or, when it was just
/// queued for its shadow (`waits`) and the shadow rule is on, makes its
/// record wait there for the shadow's scores.
pub(super) fn log_answered(log: &mut ShardLog, replicas: &Replicas, a: &Answered<'_>, waits: Waits<'_>) {
    let o = a.outcome;
    let model = &*a.served.model.name;
    let sampler = log.sampling.load();
    let bits = why_now(&sampler, o, in_sample(&sampler, model, &a.raw));
    let waits = waits.filter(|_| sampler.shadow_diff.is_some());
    drop(sampler);
    if bits == 0 && waits.is_none() {
        return;
    }
    let layout = &a.served.layout;
    let p = parts(Some(layout), replicas, Some(&a.raw));
    let head = Head::of(&a.raw, a.received_unix_ns);
    if let Some(at) = waits {
        let (spans, keys) = (&p.spans[..p.n_spans], &p.keys[..p.n_keys]);
        let len = middle_len(spans, keys);
        let model_at = (a.served.name_hash, a.served.model.version);
        if hold(at, head, bits, model_at, layout.row_dim, o, len, |out| encode_middle(spans, keys, out)) {
            return;
        }
    }
    if bits != 0 {
        put(log, head, model, a.served.model.version, layout.row_dim, p.middle(), o, a.x, a.scores, bits, None);
    }
}

/// Logs a request answered before a model was chosen (`outcome`, and the
/// static defaults in `scores` when it was shed), when the rules or the
/// sample say so. `payload` is its frame: its keys are recorded when it
/// verifies as a FlatBuffer, within the size limits or not
/// (`wire::verify_request`); `default_model` names the model when the
/// request named none.
#[allow(clippy::too_many_arguments)]
pub(super) fn log_refused(
    log: &mut ShardLog,
    replicas: &Replicas,
    payload: &[u8],
    limits: &RequestLimits,
    default_model: &str,
    outcome: &Outcome,
    scores: &[f32],
    received_unix_ns: i64,
) {
    // Verified again, without the size limits (a request refused for its
    // sizes still has its keys read, each within the frame): only a
    // refusal pays for it. A frame that does not verify has nothing that
    // can be read safely (its offsets are unchecked): no keys, request id 0.
    let raw = crate::wire::verify_request(payload, limits).ok();
    let model = raw.as_ref().and_then(|r| r.model()).filter(|m| !m.is_empty()).unwrap_or(default_model);
    let sampler = log.sampling.load();
    let sampled = match &raw {
        Some(r) => in_sample(&sampler, model, r),
        None => false,
    };
    let bits = why_now(&sampler, outcome, sampled);
    if bits == 0 {
        return;
    }
    drop(sampler);
    let p = parts(None, replicas, raw.as_ref());
    let head = match &raw {
        Some(r) => Head::of(r, received_unix_ns),
        None => Head { request_id: 0, client_id: 0, budget_us: 0, received_unix_ns },
    };
    // Shed with the static default: `Ok` without assembled rows.
    put(log, head, model, 0, 0, p.middle(), outcome, &[], scores, bits, None);
}

/// A handed-off request's record, begun at the hand-off: its head, the
/// model it was handed to, and whether the sample took it (the always
/// rules wait for its answer). Its spans and keys are the job slot's
/// staging bytes, `staged` long.
#[derive(Clone, Copy, Debug)]
pub(super) struct Staged {
    head: Head,
    sampled: bool,
    /// The model's name (`Served::name_hash`, found again among the served
    /// versions when the answer comes) and version.
    name_hash: u64,
    version: u32,
    row_dim: usize,
    staged: usize,
}

/// Begins the record of a request handed off to `served`, when it may be
/// logged: encodes its spans and keys into `staging` (a job slot's,
/// [`STAGED_BYTES_MAX`]). `None` when it will not be logged, or does not
/// fit (counted too large).
pub(super) fn stage(
    log: &mut ShardLog,
    replicas: &Replicas,
    raw: &fb::ScoreRequest<'_>,
    served: &Served,
    received_unix_ns: i64,
    staging: &mut [u8],
) -> Option<Staged> {
    let sampler = log.sampling.load();
    let sampled = in_sample(&sampler, &served.model.name, raw);
    if !sampled && !sampler.has_always() {
        return None;
    }
    drop(sampler);
    let p = parts(Some(&served.layout), replicas, Some(raw));
    let (spans, keys) = (&p.spans[..p.n_spans], &p.keys[..p.n_keys]);
    let len = middle_len(spans, keys);
    let Some(out) = staging.get_mut(..len) else {
        log.dropped_too_large += 1;
        return None;
    };
    encode_middle(spans, keys, out);
    Some(Staged {
        head: Head::of(raw, received_unix_ns),
        sampled,
        name_hash: served.name_hash,
        version: served.model.version,
        row_dim: served.layout.row_dim,
        staged: len,
    })
}

/// Logs a handed-off request answered as `outcome`, when it was sampled or
/// the always rules say so (or makes it wait for its shadow, as
/// [`log_answered`]): `staging` is its job slot's staging bytes, `x` the
/// slot's rows, `scores` the answer's; its model's name is found in
/// `served` (any version of it: a name outlives versions).
#[allow(clippy::too_many_arguments)]
pub(super) fn log_completed(
    log: &mut ShardLog,
    s: &Staged,
    served: &[Served],
    staging: &[u8],
    outcome: &Outcome,
    x: &[f32],
    scores: &[f32],
    waits: Waits<'_>,
) {
    let sampler = log.sampling.load();
    let bits = why_now(&sampler, outcome, s.sampled);
    let waits = waits.filter(|_| sampler.shadow_diff.is_some());
    drop(sampler);
    let Some(middle) = staging.get(..s.staged).filter(|_| bits != 0 || waits.is_some()) else {
        return;
    };
    if let Some(at) = waits {
        let model_at = (s.name_hash, s.version);
        if hold(at, s.head, bits, model_at, s.row_dim, outcome, middle.len(), |out| out.copy_from_slice(middle)) {
            return;
        }
    }
    if bits != 0 {
        let model = served.iter().find(|v| v.name_hash == s.name_hash).map_or("", |v| &*v.model.name);
        put(log, s.head, model, s.version, s.row_dim, Middle::Encoded(middle), outcome, x, scores, bits, None);
    }
}
