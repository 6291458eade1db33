//! The request path's side of the decision log: after a response is
//! encoded, whether its decision is logged (the always rules, then the
//! sample by key or request id), and the record handed to the shard's ring,
//! built from borrowed parts on the stack, so logging allocates nothing.

use super::scratch::Outcome;
use super::versions::Served;
use super::Replicas;
use crate::decision_log::record::{DecisionRef, KeysRef, Span, KEY_GROUPS_MAX, SPANS_MAX};
use crate::decision_log::{SampleKey, Sampler, ShardLog};
use crate::features::groups::GROUPS_MAX;
use crate::wire::{fb, Status, Tier};

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

/// What of one answered request the log may record.
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

/// Logs `a` when the rules or the sample say so.
pub(super) fn log_decision(log: &mut ShardLog, replicas: &Replicas, a: &Answered<'_>) {
    let o = a.outcome;
    let ok = o.status == Status::Ok.0;
    if !log.sampler.always(ok, o.tier == Tier::Primary.0)
        && (log.sampler.samples_none() || !log.sampler.sampled(sample_key(&log.sampler, &a.raw)))
    {
        return;
    }
    let layout = &a.served.layout;
    let mut spans = [Span::EMPTY; SPANS_MAX];
    let mut n_spans = 0;
    for seg in layout.groups.iter().take(GROUPS_MAX) {
        let name = replicas.groups.get(seg.group).map_or("", |g| &*g.name);
        spans[n_spans] = Span { name, offset: seg.offset as u32, dim: seg.dim as u32 };
        n_spans += 1;
    }
    for (name, part) in [("context", layout.context), ("context_id", layout.context_ids)] {
        if let Some((offset, dim)) = part {
            spans[n_spans] = Span { name, offset: offset as u32, dim: dim as u32 };
            n_spans += 1;
        }
    }
    let mut keys = [("", KeysRef::None); KEY_GROUPS_MAX];
    let mut n_keys = 0;
    let groups = a.raw.groups().unwrap_or_default();
    for g in groups.iter().take(KEY_GROUPS_MAX - 2) {
        let k = match (g.ids(), g.keys()) {
            (Some(ids), _) => KeysRef::Ids(ids),
            (None, Some(strs)) => KeysRef::Strs(strs),
            (None, None) => KeysRef::None,
        };
        keys[n_keys] = (g.group().unwrap_or(""), k);
        n_keys += 1;
    }
    let named = |name: &str| groups.iter().any(|g| g.group() == Some(name));
    // The older fields key `user` and `item` when no group entry does.
    if replicas.user.is_some() && !named("user") {
        keys[n_keys] = ("user", KeysRef::One(a.raw.user_id()));
        n_keys += 1;
    }
    if let Some(items) = a.raw.item_ids().filter(|v| !v.is_empty() && !named("item")) {
        keys[n_keys] = ("item", KeysRef::Ids(items));
        n_keys += 1;
    }
    let rows = if ok { o.rows } else { 0 };
    let assembled = ok && o.row_dim == layout.row_dim && o.row_dim > 0;
    let decision = DecisionRef {
        request_id: a.raw.request_id(),
        client_id: a.raw.client_id(),
        received_unix_ns: a.received_unix_ns,
        budget_us: a.raw.budget_us(),
        server_us: o.server_us,
        model: &a.served.model.name,
        model_version: if ok { o.version } else { a.served.model.version },
        status: o.status,
        tier: o.tier,
        reason: o.reason,
        features_missing: o.missing,
        features_stale: o.stale,
        rows: rows as u32,
        row_dim: layout.row_dim as u32,
        spans: &spans[..n_spans],
        keys: &keys[..n_keys],
        x: a.x.get(..rows * layout.row_dim).filter(|_| assembled),
        scores: a.scores.get(..rows).filter(|_| ok),
    };
    log.put(&decision);
}
