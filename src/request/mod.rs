//! The request path, top to bottom in one place ([`RequestPath::handle`]):
//! admit → assemble → cache → route → run inline or hand off → finish,
//! and any rejection on the way answered by `answer`.
//!
//! The shard reads frames off a socket and hands each payload here with the
//! time it was read; everything from there to the encoded response happens
//! in `handle`, whose stages are in `stages.rs` (and, for requests handed to
//! the inference stage, `handoff.rs`). One [`Deadline`] is derived from the
//! request's budget at read time and checked at every stage boundary. A
//! request that can no longer be answered in time gets `DeadlineExceeded`
//! at once.
//!
//! A `RequestPath` belongs to one shard and is made of owned parts, each
//! with one job, and every stage's signature names the parts it reads (`&`)
//! and writes (`&mut`):
//!
//! - [`Policies`](policies::Policies): limits, readiness, admission,
//!   shedding, the breaker;
//! - [`Versions`](versions::Versions): the served model versions, their
//!   backends and the fallback;
//! - [`Replicas`]: the feature tables;
//! - [`Inputs`](scratch::Inputs) and [`Answer`](scratch::Answer): the
//!   current request's model input rows, scores and encoder;
//! - the score cache ([`ScoreCache`]);
//! - [`InFlight`](handoff::InFlight): requests on the inference stage;
//! - the shadow queue (`shadow.rs`);
//! - the decision log's ring, when `[log]` is on (`logged.rs`);
//! - [`Telemetry`]: counters and stage timings.
//!
//! What shards share is immutable: the models and the feature replicas,
//! behind `Arc`.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::deadline::{Clock, Deadline};
use crate::decision_log::{LogRings, ShardLog};
use crate::features::feed::FeedStatus;
use crate::features::groups::{Absent, Scope};
use crate::features::replica::{KeyKind, ReplicaHandle, ReplicaView};
use crate::infer::{Done, ShardEnd, SlotToken};
use crate::metrics::{Readiness, StageTimes, VersionReport};
use crate::model::Model;
use crate::registry::Registry;
use crate::request::admission::{AdmissionConfig, Peer};
use crate::request::cache::{CacheConfig, ScoreCache};
use crate::request::ladder::{BreakerState, LadderConfig};
use crate::request::shed::ShedConfig;
use crate::score::BackendKind;
use crate::wire::{self, Status};
use handoff::InFlight;
use policies::Policies;
use scratch::{Answer, Inputs};
use shadow::ShadowQueue;
use stages::{Frame, Route};
use versions::{BuildPlace, Versions};

pub mod admission;
pub mod cache;
mod explained;
mod handoff;
pub mod ladder;
mod limits;
mod logged;
mod policies;
mod scratch;
mod shadow;
pub mod shed;
mod stages;
mod versions;

/// The state every shard reads: the replica handles (tables the refresher
/// updates or swaps), and the registry through which new model versions arrive.
#[derive(Clone, Debug)]
pub struct Shared {
    pub registry: Arc<Registry>,
    /// The feature groups served, in configuration order (at most
    /// `GROUPS_MAX`; names unique).
    pub groups: Vec<SharedGroup>,
    /// The request-scope group whose key picks a request's canary (sticky per key):
    /// `user` unless configured.
    pub canary_group: String,
    pub limits: Limits,
    pub backend: BackendKind,
    /// Benchmark floor: verify, then answer `Ok` with no scores.
    pub floor: bool,
    /// Whether the server takes traffic; requests get `Overloaded` while not.
    pub readiness: Arc<Readiness>,
    /// The lower rungs: fallback model and static defaults; the breaker.
    pub ladder: LadderConfig,
    pub fallback: Option<Arc<Model>>,
    /// Per-client rate limits, and how many shards split them.
    pub admission: AdmissionConfig,
    /// Each shard's demand of each configured client, which the shards
    /// exchange to hold a client's rate across them.
    pub client_usage: Arc<crate::request::admission::ClientUsage>,
    /// The per-shard score cache.
    pub cache: CacheConfig,
    /// Load shedding by priority.
    pub shed: ShedConfig,
    /// The Redis feed's state, when features are refreshed from Redis.
    pub feed: Option<Arc<FeedStatus>>,
    pub shards: usize,
    /// The decision log's rings, one per shard, when `[log]` logs anything.
    pub decision_log: Option<LogRings>,
}

/// One served feature group: its replica and how requests key it.
#[derive(Clone, Debug)]
pub struct SharedGroup {
    pub name: String,
    pub scope: Scope,
    pub absent: Absent,
    pub handle: Arc<ReplicaHandle>,
    /// The group whose rows link to this one's: its keys come from there,
    /// never from a request.
    pub child: Option<String>,
    /// A Feast view's `ttl` (0: none): a row whose event time (its link
    /// words, `features::feast::rows`) is older is served as missing.
    pub ttl_s: u64,
    /// A Feast view: a row holding a null (NaN) feature counts in
    /// `features_missing` like a missing row, as Feast reports the feature
    /// missing.
    pub nulls_missing: bool,
}

impl SharedGroup {
    /// The groups a server without `[[groups]]` serves: `user` at request
    /// scope, `item` at candidate scope, a missing key reading the default.
    pub fn user_item(user: Arc<ReplicaHandle>, item: Arc<ReplicaHandle>) -> Vec<SharedGroup> {
        let group = |name: &str, scope, handle| SharedGroup {
            name: name.into(),
            scope,
            absent: Absent::Default,
            handle,
            child: None,
            ttl_s: 0,
            nulls_missing: false,
        };
        vec![group("user", Scope::Request, user), group("item", Scope::Candidate, item)]
    }
}

impl SharedGroup {
    /// What this group lets a model read.
    pub fn fit(&self) -> GroupFit {
        GroupFit { name: self.name.clone(), scope: self.scope, dim: self.handle.dim(), child: self.child.clone() }
    }
}

impl Shared {
    /// What the served groups let a model read.
    pub fn group_fits(&self) -> Vec<GroupFit> {
        self.groups.iter().map(SharedGroup::fit).collect()
    }
}

pub use crate::model::layout::{GroupFit, InputLayout, LayoutError};
pub use limits::{LimitError, Limits};

/// A categorical id as the model reads it: the id as a float where that is
/// exact (below 2^24), else -1, which no embedding row has (its default).
#[inline]
pub fn context_id_value(id: u64) -> f32 {
    if id < 1 << 24 {
        id as f32
    } else {
        -1.0
    }
}

pub use crate::metrics::{Counters, REASONS};

/// What `handle` did with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    /// Its response is in the output buffer.
    Answered,
    /// It is in the inference stage; `complete` will answer it.
    Pending,
}

/// What the lower rungs need to answer a request.
#[derive(Clone, Copy, Debug)]
struct StepDown {
    request_id: u64,
    rows: usize,
    row_dim: usize,
    read_at_ns: u64,
    deadline: Deadline,
    missing: u32,
    /// The fallback model reads the same inputs as the chosen model.
    fallback: bool,
    /// Every candidate's score is in the cache (and in `Answer::cached`
    /// until the next request).
    cached: bool,
    default_score: f32,
    /// Features per explained candidate (`explain_top_k`, 0: none asked)
    /// and how many candidates to explain (`Request::explained`).
    explain_top_k: u16,
    explained: u16,
}

/// The feature tables a request's rows are looked up in, and the feed that
/// keeps them fresh (every answer says whether it has gone stale).
struct Replicas {
    /// In `Shared::groups`' order.
    groups: Vec<GroupView>,
    /// The groups a request's `user_id` and `item_ids` key.
    user: Option<usize>,
    item: Option<usize>,
    feed: Option<Arc<FeedStatus>>,
}

/// A shard's view of one feature group.
struct GroupView {
    name: Box<str>,
    scope: Scope,
    absent: Absent,
    /// Settled when the group's file is opened; a view never changes it.
    key: KeyKind,
    /// The group whose rows' links key this one (`ad` for `campaign`).
    child: Option<Box<str>>,
    /// [`SharedGroup::ttl_s`].
    ttl_s: u64,
    /// [`SharedGroup::nulls_missing`].
    nulls_missing: bool,
    view: ReplicaView,
}

impl Replicas {
    fn new(groups: &[SharedGroup], feed: Option<Arc<FeedStatus>>) -> Replicas {
        let views: Vec<GroupView> = groups
            .iter()
            .map(|g| {
                let view = ReplicaView::new(g.handle.clone());
                GroupView {
                    name: g.name.as_str().into(),
                    scope: g.scope,
                    absent: g.absent,
                    key: view.key_kind(),
                    child: g.child.as_deref().map(Into::into),
                    ttl_s: g.ttl_s,
                    nulls_missing: g.nulls_missing,
                    view,
                }
            })
            .collect();
        let at = |name: &str| views.iter().position(|g| &*g.name == name);
        Replicas { user: at("user"), item: at("item"), groups: views, feed }
    }

    /// The index of the group named `name`.
    #[inline]
    fn position(&self, name: &str) -> Option<usize> {
        self.groups.iter().position(|g| &*g.name == name)
    }

    /// Takes the tables a writer swapped in since the last refresh: once
    /// per request before its lookups, and on the shard's publication tick
    /// so that an idle shard lets a replaced table go.
    fn refresh(&mut self) {
        for g in &mut self.groups {
            g.view.refresh();
        }
    }
}

/// What the shard measures of its requests, for publication.
#[derive(Default)]
pub struct Telemetry {
    pub counters: Counters,
    pub times: StageTimes,
}

/// One shard's request path: its parts, and the clock it reads time by.
///
/// `!Send`: it is built on its shard's thread and never leaves it, so what
/// it owns (counters, timings, drift counts, backends' scratch) needs no
/// synchronisation; the marker keeps it so, and the assertion below fails
/// to compile if it ever became `Send`.
pub struct RequestPath<C: Clock> {
    clock: C,
    policies: Policies,
    versions: Versions,
    replicas: Replicas,
    inputs: Inputs,
    answer: Answer,
    cache: ScoreCache,
    in_flight: InFlight,
    shadows: ShadowQueue,
    pub telemetry: Telemetry,
    /// The rings, until `set_shard` takes this shard's producer.
    log_rings: Option<LogRings>,
    log: Option<ShardLog>,
    _shard_local: PhantomData<*const ()>,
}

// `RequestPath` is `!Send`. Were it `Send`, both impls below would apply and
// the path's `not_send` would be ambiguous: a compile error.
const _: fn() = || {
    trait AmbiguousIfSend<A> {
        fn not_send() {}
    }
    impl<T: ?Sized> AmbiguousIfSend<()> for T {}
    struct IsSend;
    impl<T: ?Sized + Send> AmbiguousIfSend<IsSend> for T {}
    let _ = <RequestPath<crate::deadline::MonotonicClock> as AmbiguousIfSend<_>>::not_send;
};

/// Largest size of one encoded response frame, for output buffer sizing:
/// scores, the error line and, when asked for, explanations.
pub fn response_frame_bytes_max(candidates_max: usize) -> usize {
    wire::FRAME_PREFIX_BYTES + 256 + wire::ERROR_BYTES_MAX + candidates_max * 4 + wire::EXPLANATIONS_BYTES_MAX
}

impl<C: Clock> RequestPath<C> {
    /// Allocates every buffer the path will use and builds a backend for
    /// every served model, measuring each once at full batch size so the
    /// first request's cost check is informed.
    pub fn new(shared: Shared, clock: C) -> Result<RequestPath<C>, LayoutError> {
        let rows_max = shared.limits.candidates_max;
        let mut telemetry = Telemetry::default();
        let mut answer = Answer::new(rows_max);
        let fit = versions::Fit {
            kind: shared.backend,
            rows_max,
            context_len_max: shared.limits.context_len_max,
            groups: shared.group_fits(),
            ladder: shared.ladder.clone(),
        };
        // Per key a lookup reads: a candidate-scope group's row per
        // candidate, a request-scope group's one row.
        let floats_per_lookup = |g: &SharedGroup| match g.scope {
            Scope::Candidate => rows_max * g.handle.dim(),
            Scope::Request => g.handle.dim(),
        };
        let vectors_len = shared.groups.iter().map(floats_per_lookup).max().unwrap_or(0);
        let at = BuildPlace { clock: &clock, counters: &mut telemetry.counters, logits: &mut answer.logits };
        let versions = Versions::new(shared.registry.clone(), fit, shared.fallback.clone(), at)?;
        let mut path = RequestPath {
            policies: Policies::new(&shared),
            versions,
            inputs: Inputs::new(rows_max, vectors_len, shared.limits.context_len_max),
            answer,
            cache: ScoreCache::new(&shared.cache),
            in_flight: InFlight::default(),
            shadows: ShadowQueue::default(),
            telemetry,
            replicas: Replicas::new(&shared.groups, shared.feed.clone()),
            clock,
            log_rings: shared.decision_log.clone(),
            log: None,
            _shard_local: PhantomData,
        };
        path.refresh_models()?;
        Ok(path)
    }

    /// Handles one request payload read at `read_at_ns` on connection `conn`,
    /// whose peer is `peer` (what admission binds client ids to).
    /// Appends exactly one response frame to `out`, or, when the request went
    /// to the inference stage, returns `Pending`: its response comes later
    /// from [`RequestPath::complete`].
    pub fn handle(&mut self, payload: &[u8], read_at_ns: u64, conn: u32, peer: Peer<'_>, out: &mut Vec<u8>) -> Handled {
        let RequestPath {
            clock,
            policies,
            versions,
            replicas,
            inputs,
            answer,
            cache,
            in_flight,
            shadows,
            telemetry,
            log,
            ..
        } = self;
        let clock = &*clock;
        shadows.queued_now = None;
        let frame = Frame { payload, read_at_ns, peer };
        // The decoded request and its chosen version, once admitted: what
        // the decision log reads after the response is encoded; and the job
        // slot it was handed off in.
        let mut admitted_as = None;
        let mut handed_to = None;
        let primary = (|| {
            let admitted = stages::admit(frame, clock, policies, versions, in_flight.slot_fill(), telemetry)?;
            admitted_as = Some((admitted.raw(), admitted.chosen));
            let served = &mut versions.served[admitted.chosen];
            // Rows that fit a job slot are assembled into one taken now, so
            // a hand-off copies none; inline or stepped down, they are read
            // from it and it is given back below.
            in_flight.reserve(admitted.floats(served));
            let x = in_flight.reserved_rows_mut();
            let mut assembled = stages::assemble(admitted, clock, served, replicas, inputs, x, telemetry)?;
            stages::look_up_cache(&mut assembled, policies, cache, inputs, answer, telemetry)?;
            match stages::route(&assembled, policies, in_flight.stage_us(&assembled), served)? {
                Route::HandOff => handoff::hand_off(assembled, conn, policies, in_flight, served, inputs).map(|slot| {
                    handed_to = Some(slot);
                    None
                }),
                Route::Inline => {
                    let x = in_flight.reserved_rows().unwrap_or(&inputs.x);
                    stages::run(assembled, clock, policies, served, x, answer, telemetry).map(Some)
                }
            }
        })();
        let x = in_flight.reserved_rows().unwrap_or(&inputs.x);
        let handled = match primary {
            Ok(Some(ran)) => {
                let rows = ran.assembled.step.rows;
                let x = &x[..rows * ran.assembled.step.row_dim];
                let items = &inputs.candidate_keys[..rows];
                stages::finish(ran, x, items, clock, versions, cache, shadows, &replicas.feed, answer, telemetry, out)
            }
            Ok(None) => Handled::Pending,
            Err(rejection) => {
                let fallback = versions.fallback.as_mut();
                let feed = &replicas.feed;
                stages::answer(rejection, x, clock, fallback, feed, answer, telemetry, out)
            }
        };
        if let Some(log) = log.as_mut() {
            let received_unix_ns = log.wall_offset_ns.saturating_add(i64::try_from(read_at_ns).unwrap_or(i64::MAX));
            match (handled, admitted_as, handed_to) {
                (Handled::Answered, Some((raw, chosen)), _) => {
                    let answered = logged::Answered {
                        raw,
                        served: &versions.served[chosen],
                        outcome: &answer.last,
                        x: in_flight.reserved_rows().unwrap_or(&inputs.x),
                        scores: &answer.logits,
                        received_unix_ns,
                    };
                    logged::log_answered(log, replicas, &answered, shadows.holding());
                }
                // The benchmark floor answers without a decision.
                (Handled::Answered, None, _) if !policies.floor => {
                    let default_model = versions.served.get(versions.default_model).map_or("", |s| &*s.model.name);
                    let limits = &policies.request_limits;
                    let (last, scores) = (&answer.last, &answer.logits);
                    logged::log_refused(log, replicas, payload, limits, default_model, last, scores, received_unix_ns);
                }
                (Handled::Pending, Some((raw, chosen)), Some(slot)) => {
                    let staging = in_flight.staging_mut(slot);
                    let staged =
                        logged::stage(log, replicas, &raw, &versions.served[chosen], received_unix_ns, staging);
                    if let Some(s) = in_flight.log_staged.get_mut(slot as usize) {
                        *s = staged;
                    }
                }
                _ => {}
            }
            count_log(&mut telemetry.counters, log);
        }
        in_flight.unreserve();
        handled
    }

    /// Lets go of replica tables a writer replaced, between requests (the
    /// publication tick), so an idle shard does not keep them mapped.
    pub fn refresh_replicas(&mut self) {
        self.replicas.refresh();
    }

    /// Makes this the path of shard `shard`, whose backends the registry
    /// builds ahead of each swap: takes that shard's inbox (until then,
    /// every version is built here).
    pub fn set_shard(&mut self, shard: usize) {
        self.versions.inbox = self.versions.registry.take_inbox(shard);
        // Made here, on the shard's thread: the producer is `!Send`.
        self.log = self.log_rings.take().and_then(|rings| rings.shard(shard));
        self.keep_log_staging();
    }

    /// With the decision log and the inference stage both on, the staging
    /// bytes of each job slot: a handed-off request's keys take at most
    /// its frame (and a few bytes per group), up to `STAGED_BYTES_MAX`.
    /// The same per shadow slot, where a record waits for its shadow's
    /// scores under `always_log_shadow_diff`: kept whenever the log runs,
    /// as `POST /log` may set the rule at any time.
    fn keep_log_staging(&mut self) {
        if self.log.is_none() {
            return;
        }
        let frame = self.policies.request_limits.frame_bytes_max.min(logged::STAGED_BYTES_MAX);
        let spans = crate::decision_log::record::SPANS_MAX * (1 + 255 + 16);
        let groups = crate::decision_log::record::KEY_GROUPS_MAX * (1 + 255 + 1 + 4 + 8);
        if self.in_flight.stage.is_some() {
            self.in_flight.keep_log(frame + spans + groups);
        }
        if self.shadows.held_bytes == 0 {
            self.shadows.keep_log(frame + spans + groups);
        }
    }

    /// Trades configured clients' demand with the other shards so each
    /// client's rate holds across them (`Admission::exchange`); the shard's
    /// watcher calls it every few milliseconds, between requests.
    pub fn exchange_admission(&mut self, now_ns: u64) {
        self.policies.admission.exchange(now_ns);
    }

    /// Picks up model versions the registry published since the last call.
    /// One atomic load when nothing changed; the shard calls it between
    /// read rounds, never in the middle of a request. Returns whether the
    /// served set changed.
    pub fn refresh_models(&mut self) -> Result<bool, LayoutError> {
        let at =
            BuildPlace { clock: &self.clock, counters: &mut self.telemetry.counters, logits: &mut self.answer.logits };
        if !self.versions.refresh(at)? {
            return Ok(false);
        }
        // Queued shadow work names served entries by position.
        let rows_max = self.policies.limits.candidates_max;
        let floats = rows_max * self.versions.row_dim_max();
        self.inputs.fit(floats);
        self.shadows.release_held(self.log.as_mut(), &self.versions.served);
        self.shadows.items.clear();
        if self.versions.shadowing() {
            self.shadows.fit(rows_max, floats);
        }
        Ok(true)
    }

    pub fn clock(&self) -> &C {
        &self.clock
    }

    pub fn backend_name(&self) -> &'static str {
        self.versions.served.first().map_or("none", |s| s.backend.name())
    }

    /// Expected kernel time of the default model for `rows` candidates.
    pub fn expected_kernel_us(&self, rows: usize) -> u64 {
        self.versions.served[self.versions.default_model].kernel_cost.expected_us(rows)
    }

    /// Stage timings of the current interval, for publication.
    pub fn times_mut(&mut self) -> &mut StageTimes {
        &mut self.telemetry.times
    }

    /// Answers a frame the shard could not even split (bad length prefix).
    pub fn reject_stream(&mut self, error: &wire::FrameError, out: &mut Vec<u8>) {
        stages::fail(0, Status::BadRequest, &error.to_string(), &mut self.answer, &mut self.telemetry, out);
        if let Some(log) = self.log.as_mut() {
            let received_unix_ns = log.wall_offset_ns.saturating_add(self.clock.now_ns() as i64);
            let default_model = self.versions.served.get(self.versions.default_model).map_or("", |s| &*s.model.name);
            let limits = &self.policies.request_limits;
            let (last, scores) = (&self.answer.last, &self.answer.logits);
            logged::log_refused(log, &self.replicas, &[], limits, default_model, last, scores, received_unix_ns);
            count_log(&mut self.telemetry.counters, log);
        }
    }

    /// Requests answered per served version, and the drift counts of the
    /// interval (which start again from zero), for publication.
    pub fn version_report(&mut self) -> VersionReport {
        self.versions.report()
    }

    /// The primary's breaker state, for metrics.
    pub fn breaker_state(&self) -> BreakerState {
        self.policies.breaker.state()
    }

    /// Sends later requests through the inference stage instead of scoring
    /// them inline.
    pub fn attach_stage(&mut self, stage: ShardEnd) {
        let rows_max = self.policies.limits.candidates_max;
        self.in_flight.attach(stage, rows_max);
        self.keep_log_staging();
    }

    /// A stage completion, the slot it returns and the connection it goes
    /// to, if one is waiting; that connection answers it (`complete`).
    pub fn poll_stage(&mut self) -> Option<(u32, Done, SlotToken)> {
        self.in_flight.poll()
    }

    /// The stage's bell for this shard (`ShardEnd::take_bell`).
    pub fn take_stage_bell(&mut self) -> Option<std::os::unix::net::UnixStream> {
        self.in_flight.stage.as_mut()?.take_bell()
    }

    /// See `ShardEnd::will_wait`.
    pub fn stage_will_wait(&self) -> bool {
        self.in_flight.stage.as_ref().is_some_and(ShardEnd::will_wait)
    }

    /// See `ShardEnd::woke`.
    pub fn stage_woke(&self) {
        if let Some(s) = &self.in_flight.stage {
            s.woke();
        }
    }

    /// Requests handed to the stage whose completion has not been polled
    /// yet (`poll_stage`).
    pub fn in_flight(&self) -> usize {
        self.in_flight.owed()
    }

    /// Answers a stage completion into `out`, by the same `finish` as an
    /// inline request when it was scored in time; nothing when the request
    /// was given up on. Returns whether it answered.
    pub fn complete(&mut self, done: Done, token: SlotToken, out: &mut Vec<u8>) -> bool {
        self.shadows.queued_now = None;
        let RequestPath { clock, policies, versions, replicas, answer, cache, in_flight, shadows, telemetry, .. } =
            self;
        let parts =
            handoff::Parts { clock, policies, versions, feed: &replicas.feed, cache, shadows, answer, telemetry };
        let slot = done.slot;
        let answered = in_flight.complete(done, token, parts, out);
        if answered {
            self.log_handed_off(slot);
        }
        answered
    }

    /// Logs the handed-off request in job slot `slot`, just answered, when
    /// its record was begun at the hand-off.
    fn log_handed_off(&mut self, slot: u32) {
        let RequestPath { versions, answer, in_flight, shadows, telemetry, log, .. } = self;
        let Some(log) = log.as_mut() else {
            return;
        };
        if let Some((staged, bytes, x)) = in_flight.take_staged(slot) {
            let (served, last, scores) = (&versions.served, &answer.last, &answer.logits);
            logged::log_completed(log, &staged, served, bytes, last, x, scores, shadows.holding());
            count_log(&mut telemetry.counters, log);
        }
    }

    /// Gives up on every handed-off request still waiting at its give-up
    /// time (its deadline less `ladder.reserve_us`), calling
    /// `route(connection, slot)` for each: that connection answers it from
    /// the lower rungs (`give_up`). The stage keeps the job slot until it
    /// finishes; its late result is then dropped.
    pub fn give_up_overdue(&mut self, now_ns: u64, route: &mut dyn FnMut(u32, u32)) {
        self.in_flight.give_up_overdue(now_ns, &mut self.policies, route);
    }

    /// Answers the request in job slot `slot`, given up on, from the lower
    /// rungs into `out`.
    pub fn give_up(&mut self, slot: u32, out: &mut Vec<u8>) {
        self.shadows.queued_now = None;
        let RequestPath { clock, policies, versions, replicas, answer, cache, in_flight, shadows, telemetry, .. } =
            self;
        let parts =
            handoff::Parts { clock, policies, versions, feed: &replicas.feed, cache, shadows, answer, telemetry };
        in_flight.give_up(slot, parts, out);
        self.log_handed_off(slot);
    }

    /// Sampled requests waiting for their shadow versions.
    pub fn shadows_pending(&self) -> bool {
        !self.shadows.items.is_empty()
    }

    /// Scores the queued shadow requests with their candidate versions and
    /// records how far the candidate's scores are from what was returned.
    /// The connection calls this after writing a round's responses, when no
    /// further frame is waiting: off the critical path, and only with time
    /// to spare.
    pub fn run_shadows(&mut self) {
        self.shadows.run(&self.clock, &mut self.versions.served, &mut self.telemetry, self.log.as_mut());
        if let Some(log) = &self.log {
            count_log(&mut self.telemetry.counters, log);
        }
    }
}

/// Copies the log's counts into the shard's counters, for publication.
fn count_log(c: &mut Counters, log: &ShardLog) {
    (c.log_records, c.log_dropped_ring_full, c.log_dropped_too_large) =
        (log.records, log.dropped_ring_full, log.dropped_too_large);
}

#[cfg(test)]
mod tests;
