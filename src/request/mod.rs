//! The request path, top to bottom in one place:
//! decode → check → lookup → check → kernel → check → respond.
//!
//! The shard reads frames off a socket and hands each payload here with the
//! time it was read; everything from there to the encoded response happens
//! in [`RequestPath::handle`], whose stages are in `stages.rs`; the lower
//! rungs' answers are here. One [`Deadline`] is derived from the request's
//! budget at read time and checked at every stage boundary. A request that
//! can no longer be answered in time gets `DeadlineExceeded` at once.
//!
//! A `RequestPath` belongs to one shard: it owns its scratch buffers, its
//! backend and its counters, and is `!Send` on purpose (the backend is a
//! `Box<dyn Backend>` without `Send`). What shards share is immutable: the
//! model and the feature replicas, behind `Arc`.

use std::sync::Arc;

use crate::deadline::{Clock, Deadline};
use crate::drift::DriftCounts;
use crate::features::feed::FeedStatus;
use crate::features::replica::ReplicaHandle;
use crate::infer::{Done, Outcome, ShardEnd, SlotToken};
use crate::metrics::{Readiness, Stage, StageTimes, VersionReport};
use crate::model::graph::embedding_index;
use crate::model::Model;
use crate::registry::{build_timed, Prebuilt, Registry};
use crate::request::admission::{Admission, AdmissionConfig, Admit, Peer};
use crate::request::cache::{hash_words, CacheConfig, Key, ScoreCache};
use crate::request::ladder::{Breaker, BreakerState, LadderConfig};
use crate::request::shed::{ShedConfig, Shedder};
use crate::score::{Backend, BackendKind};
use crate::wire::{self, Reason, RequestLimits, ResponseEncoder, ResponseFields, Status, Tier};
use handoff::{Pending, Turnaround};
use shadow::{ShadowQueue, SHADOW_SLOTS};

pub mod admission;
pub mod cache;
mod handoff;
pub mod ladder;
mod limits;
mod overload;
mod shadow;
pub mod shed;
mod stages;

/// The state every shard reads: the replica handles (tables the refresher
/// updates or swaps), and the registry through which new model versions arrive.
#[derive(Clone, Debug)]
pub struct Shared {
    pub registry: Arc<Registry>,
    pub user: Arc<ReplicaHandle>,
    pub item: Arc<ReplicaHandle>,
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
}

pub use crate::model::layout::{InputLayout, LayoutError};
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

/// A running estimate of the kernel's cost per candidate row, so the path
/// can refuse work that would finish past the deadline before starting it.
#[derive(Clone, Copy, Debug)]
struct KernelCost {
    ns_per_row: f64,
}

impl KernelCost {
    /// Exponentially weighted: recent batches dominate, one outlier does not.
    const WEIGHT_NEW: f64 = 0.05;

    fn expected_us(&self, rows: usize) -> u64 {
        (self.ns_per_row * rows as f64 / 1_000.0).ceil() as u64
    }

    fn observe(&mut self, rows: usize, elapsed_us: u64) {
        let sample = elapsed_us as f64 * 1_000.0 / rows.max(1) as f64;
        self.ns_per_row += (sample - self.ns_per_row) * Self::WEIGHT_NEW;
    }
}

/// One served model version on one shard: its own backend instance (with
/// its repacked weights and scratch) and its kernel cost estimate.
struct Served {
    model: Arc<Model>,
    backend: Box<dyn Backend>,
    layout: InputLayout,
    kernel_cost: KernelCost,
    /// Parts per million of users this version serves as a canary of the
    /// current version with the same name; 0 for a current version.
    canary_ppm: u32,
    /// Parts per million of requests this version also scores as a shadow
    /// of the current version with the same name; 0 otherwise.
    shadow_ppm: u32,
    /// Requests it answered, for per-version metrics.
    requests: u64,
    /// The model name hashed for score-cache keys.
    name_hash: u64,
    /// The static default for this model (`ladder.default_scores`).
    default_score: f32,
    /// The fallback model reads the same inputs as this one.
    fallback_fits: bool,
    /// Per context id, the rows of the embedding that reads it
    /// (`Model::context_id_rows`): an id beyond them counts as missing.
    id_rows: Vec<u64>,
    /// `Model::float_index_columns`, with whether each column is
    /// per-request (checked once) or per candidate.
    index_cols: Vec<(usize, usize, bool)>,
    /// Scores returned by the primary and context inputs received since the
    /// last publication; `None` for a version without calibration (no
    /// baseline to compare with) and for a shadow (its scores are not served).
    drift: Option<DriftCounts>,
}

impl Served {
    fn is_current(&self) -> bool {
        self.canary_ppm == 0 && self.shadow_ppm == 0
    }
}

/// A user's fixed position in 0..1_000_000, the same on every shard and
/// process, so a canary keeps each user on one side.
fn user_bucket(user_id: u64) -> u32 {
    let mut z = user_id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) % 1_000_000) as u32
}

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
    /// Every candidate's score is in the cache (and in `RequestPath::cached`
    /// until the next request).
    cached: bool,
    default_score: f32,
}

/// One shard's request path: scratch memory, backends, encoder, counters.
pub struct RequestPath<C: Clock> {
    clock: C,
    shared: Shared,
    /// Which shard this is: the one whose prebuilt backends it takes.
    shard: usize,
    request_limits: RequestLimits,
    served: Vec<Served>,
    default_model: usize,
    /// The registry generation `served` reflects.
    generation: u64,
    /// A registry generation whose versions could not all be built here:
    /// the served set stayed as it was, and it is not retried.
    failed_generation: Option<u64>,
    /// The inference stage, when scoring is handed off instead of inline.
    stage: Option<ShardEnd>,
    /// Requests in the stage, by slot.
    pending: Vec<Option<Pending>>,
    shadow_queue: ShadowQueue,
    /// Model input rows of handed-off requests, by slot, for a give-up.
    shadow: Vec<f32>,
    next_give_up_ns: u64,
    give_up_bytes: Vec<u8>,
    turnaround: Turnaround,
    /// The fallback rung: a small model run inline.
    fallback: Option<Served>,
    /// The primary's breaker (the stage, or the inline kernel).
    breaker: Breaker,
    cache: ScoreCache,
    /// Cached scores of the current request's candidates.
    cached: Vec<f32>,
    admission: Admission,
    shedder: Shedder,
    /// Item ids of handed-off requests, by slot (`candidates_max` each), so
    /// their scores can be cached and a give-up can look the cache up.
    pending_items: Vec<u64>,
    /// Model input rows, `candidates_max × row_dim`, reused per request.
    x: Vec<f32>,
    /// Item vectors as the batched lookup returns them, `candidates_max × item dim`.
    item_vectors: Vec<f32>,
    /// Row index per item from the batched lookup.
    item_rows: Vec<u32>,
    /// Item ids copied out of the request, for the batched lookup.
    item_ids: Vec<u64>,
    logits: Vec<f32>,
    encoder: ResponseEncoder,
    pub counters: Counters,
    times: StageTimes,
}

/// Largest size of one encoded response frame, for output buffer sizing.
pub fn response_frame_bytes_max(candidates_max: usize) -> usize {
    wire::FRAME_PREFIX_BYTES + 256 + wire::ERROR_BYTES_MAX + candidates_max * 4
}

impl<C: Clock> RequestPath<C> {
    /// Allocates every buffer the path will use and builds a backend for
    /// every served model, measuring each once at full batch size so the
    /// first request's cost check is informed.
    pub fn new(shared: Shared, clock: C) -> Result<RequestPath<C>, LayoutError> {
        let rows_max = shared.limits.candidates_max;
        let mut path = RequestPath {
            request_limits: RequestLimits {
                frame_bytes_max: shared.limits.frame_bytes_max,
                candidates_max: shared.limits.candidates_max,
                context_len_max: shared.limits.context_len_max,
            },
            served: Vec::new(),
            shard: 0,
            default_model: 0,
            generation: 0,
            failed_generation: None,
            stage: None,
            pending: Vec::new(),
            shadow_queue: ShadowQueue::default(),
            cache: ScoreCache::new(&shared.cache),
            cached: vec![0.0; rows_max],
            shadow: Vec::new(),
            next_give_up_ns: u64::MAX,
            give_up_bytes: Vec::with_capacity(response_frame_bytes_max(rows_max)),
            turnaround: Turnaround::default(),
            fallback: None,
            breaker: Breaker::new(shared.ladder.breaker),
            admission: Admission::new(shared.admission.clone(), shared.shards, shared.client_usage.clone()),
            shedder: Shedder::new(shared.shed.clone()),
            pending_items: Vec::new(),
            x: Vec::new(),
            item_vectors: vec![0.0; rows_max * shared.item.dim()],
            item_rows: vec![0; rows_max],
            item_ids: Vec::with_capacity(rows_max),
            logits: vec![0.0; rows_max],
            encoder: ResponseEncoder::new(rows_max),
            counters: Counters::default(),
            times: StageTimes::default(),
            clock,
            shared,
        };
        // The fallback first: served versions record whether it fits them.
        if let Some(model) = path.shared.fallback.clone() {
            path.fallback = Some(path.build_served(model, 0, 0)?);
        }
        path.refresh_models()?;
        Ok(path)
    }

    /// A backend for `model` with everything the request path derives from
    /// the version once, measured on a full batch so the first request's
    /// cost check is informed.
    fn build_served(&mut self, model: Arc<Model>, canary_ppm: u32, shadow_ppm: u32) -> Result<Served, LayoutError> {
        let rows_max = self.shared.limits.candidates_max;
        let context_len_max = self.shared.limits.context_len_max;
        let layout = InputLayout::new(&model, self.shared.user.dim(), self.shared.item.dim(), context_len_max)?;
        // Built ahead by the admin side when it was published through the
        // registry; built here (milliseconds on the reactor) only otherwise.
        let Prebuilt { backend, ns_per_row } = match self.shared.registry.take_prebuilt(&model, self.shard) {
            Some(built) => {
                self.counters.backends_prebuilt += 1;
                built
            }
            None => {
                self.counters.backends_built_on_shard += 1;
                let clock = &self.clock;
                let (kind, row_dim) = (self.shared.backend, layout.row_dim);
                build_timed(kind, &model, rows_max, row_dim, &mut self.logits, || clock.now_ns())
            }
        };
        let ladder = &self.shared.ladder;
        let context_features_max = self.shared.registry.drift().context_features_max;
        let drift = model.calibration.as_ref().filter(|_| shadow_ppm == 0);
        Ok(Served {
            drift: drift.map(|c| DriftCounts::new(c, context_features_max)),
            backend,
            layout,
            kernel_cost: KernelCost { ns_per_row },
            canary_ppm,
            shadow_ppm,
            requests: 0,
            name_hash: hash_words(model.name.bytes().map(u64::from)),
            default_score: ladder.default_scores.get(&model.name).copied().unwrap_or(ladder.default_score),
            fallback_fits: self.fallback.as_ref().is_some_and(|f| f.model.inputs == model.inputs),
            id_rows: model.context_id_rows(),
            index_cols: {
                let per_request = model.request_columns();
                model.float_index_columns().into_iter().map(|(c, rows)| (c, rows, per_request[c])).collect()
            },
            model,
        })
    }

    /// Makes this the path of shard `shard` (0 until set), whose backends
    /// the registry builds ahead of each swap.
    pub fn set_shard(&mut self, shard: usize) {
        self.shard = shard;
    }

    /// Trades configured clients' demand with the other shards so each
    /// client's rate holds across them (`Admission::exchange`); the shard's
    /// watcher calls it every few milliseconds, between requests.
    pub fn exchange_admission(&mut self, now_ns: u64) {
        self.admission.exchange(now_ns);
    }

    /// Picks up model versions the registry published since the last call.
    /// One atomic load when nothing changed; the shard calls it between
    /// read rounds, never in the middle of a request. Returns whether the
    /// served set changed.
    pub fn refresh_models(&mut self) -> Result<bool, LayoutError> {
        let registry = self.shared.registry.clone();
        let generation = registry.generation();
        // A generation that could not be served is not retried on every
        // round (a layout check, or a build, runs on the reactor); the next
        // one is.
        if generation == self.generation || Some(generation) == self.failed_generation {
            return Ok(false);
        }
        let snapshot = registry.snapshot();
        let rows_max = self.shared.limits.candidates_max;
        let wanted: Vec<(Arc<Model>, u32, u32)> = snapshot
            .models
            .into_iter()
            .map(|m| (m, 0, 0))
            .chain(snapshot.canaries.into_iter().map(|(m, ppm)| (m, ppm, 0)))
            .chain(snapshot.shadows.into_iter().map(|(m, ppm)| (m, 0, ppm)))
            .collect();
        // The next set is built aside: an entry kept from the current set
        // (by index) or a new one. Nothing served changes until every new
        // version has been built, so a failure leaves the old set intact.
        enum Next {
            Kept(usize, u32, u32),
            Built(Box<Served>),
        }
        let mut taken = vec![false; self.served.len()];
        let mut plan = Vec::with_capacity(wanted.len());
        for (model, canary_ppm, shadow_ppm) in wanted {
            let same_role =
                |s: &Served| (s.canary_ppm > 0) == (canary_ppm > 0) && (s.shadow_ppm > 0) == (shadow_ppm > 0);
            let found = self
                .served
                .iter()
                .enumerate()
                .position(|(i, s)| !taken[i] && Arc::ptr_eq(&s.model, &model) && same_role(s));
            if let Some(i) = found {
                taken[i] = true;
                plan.push(Next::Kept(i, canary_ppm, shadow_ppm));
                continue;
            }
            match self.build_served(model, canary_ppm, shadow_ppm) {
                Ok(served) => plan.push(Next::Built(Box::new(served))),
                Err(e) => {
                    self.failed_generation = Some(snapshot.generation);
                    return Err(e);
                }
            }
        }
        // Commit: queued shadow work names served entries by position.
        self.generation = snapshot.generation;
        self.failed_generation = None;
        self.shadow_queue.items.clear();
        let mut old: Vec<Option<Served>> = std::mem::take(&mut self.served).into_iter().map(Some).collect();
        self.served = plan
            .into_iter()
            .map(|n| match n {
                Next::Kept(i, canary_ppm, shadow_ppm) => {
                    let mut kept = old[i].take().expect("each entry is kept once");
                    kept.canary_ppm = canary_ppm;
                    kept.shadow_ppm = shadow_ppm;
                    kept
                }
                Next::Built(served) => {
                    tracing::debug!(model = %served.model.name, version = served.model.version, "serving");
                    *served
                }
            })
            .collect();
        self.default_model =
            self.served.iter().position(|s| s.is_current() && s.model.name == snapshot.default).unwrap_or(0);
        let row_dim_max = self.served.iter().map(|s| s.layout.row_dim).max().unwrap_or(0);
        if self.x.len() < rows_max * row_dim_max {
            self.x = vec![0.0; rows_max * row_dim_max];
        }
        let q = &mut self.shadow_queue;
        if self.served.iter().any(|s| s.shadow_ppm > 0) && q.slot_floats < rows_max * row_dim_max {
            q.slot_floats = rows_max * row_dim_max;
            q.rows_max = rows_max;
            q.x = vec![0.0; SHADOW_SLOTS * q.slot_floats];
            q.returned = vec![0.0; SHADOW_SLOTS * rows_max];
            q.scores = vec![0.0; rows_max];
            q.ranks = Vec::with_capacity(rows_max);
            q.rank_a = Vec::with_capacity(rows_max);
            q.items = Vec::with_capacity(SHADOW_SLOTS);
        }
        Ok(true)
    }

    pub fn clock(&self) -> &C {
        &self.clock
    }

    pub fn backend_name(&self) -> &'static str {
        self.served.first().map_or("none", |s| s.backend.name())
    }

    /// Expected kernel time of the default model for `rows` candidates.
    pub fn expected_kernel_us(&self, rows: usize) -> u64 {
        self.served[self.default_model].kernel_cost.expected_us(rows)
    }

    /// Counts and encodes a response without scores.
    fn fail(&mut self, request_id: u64, status: Status, error: &str, out: &mut Vec<u8>) -> Handled {
        self.counters.requests += 1;
        self.counters.by_status[usize::from(status.0).min(7)] += 1;
        self.encoder.encode(&ResponseFields::failure(request_id, status, error), out);
        Handled::Answered
    }

    /// Encodes an `Ok` response with the scores in `self.logits`.
    fn respond_ok(
        &mut self,
        step: &StepDown,
        tier: Tier,
        reason: Reason,
        version: u32,
        now_ns: u64,
        out: &mut Vec<u8>,
    ) {
        self.counters.requests += 1;
        self.counters.by_status[usize::from(Status::Ok.0)] += 1;
        self.counters.by_tier[usize::from(tier.0).min(3)] += 1;
        self.counters.by_reason[usize::from(reason.0).min(REASONS - 1)] += 1;
        self.counters.features_missing += u64::from(step.missing);
        self.counters.candidates_scored += step.rows as u64;
        let server_us = now_ns.saturating_sub(step.read_at_ns) / 1_000;
        let features_stale = self.features_stale(now_ns);
        self.encoder.encode(
            &ResponseFields {
                request_id: step.request_id,
                status: Status::Ok,
                scores: &self.logits[..step.rows],
                tier,
                model_version: version,
                server_us: u32::try_from(server_us).unwrap_or(u32::MAX),
                features_missing: u16::try_from(step.missing).unwrap_or(u16::MAX),
                error: "",
                reason,
                features_stale,
            },
            out,
        );
    }

    /// Answers from the rungs below the primary: the cached scores when
    /// `step.cached` (they are in `self.cached`), the fallback model when it
    /// reads the same inputs and fits the time left, else the static default.
    /// The model input rows are in `self.x`, or in the shadow copy of job
    /// slot `shadow_slot` for a handed-off request given up on (`rows_in_x`
    /// false).
    fn step_down(&mut self, step: &StepDown, reason: Reason, shadow_slot: u32, out: &mut Vec<u8>) -> Handled {
        self.step_down_from(step, reason, shadow_slot, true, out)
    }

    fn step_down_from(
        &mut self,
        step: &StepDown,
        reason: Reason,
        shadow_slot: u32,
        rows_in_x: bool,
        out: &mut Vec<u8>,
    ) -> Handled {
        let now_ns = self.clock.now_ns();
        let rows = step.rows;
        let mut tier = Tier::Default;
        let mut version = 0;
        if step.cached {
            self.logits[..rows].copy_from_slice(&self.cached[..rows]);
            tier = Tier::Cached;
        }
        if let Some(fb) = self.fallback.as_mut().filter(|_| step.fallback && tier == Tier::Default) {
            if !step.deadline.cannot_fit(now_ns / 1_000, fb.kernel_cost.expected_us(rows)) {
                let x = if rows_in_x {
                    &self.x[..rows * step.row_dim]
                } else {
                    let at = shadow_slot as usize * self.stage.as_ref().map_or(0, ShardEnd::slot_floats);
                    &self.shadow[at..at + rows * step.row_dim]
                };
                let started_ns = self.clock.now_ns();
                let scored = fb.backend.score(x, rows, &mut self.logits[..rows]);
                fb.kernel_cost.observe(rows, self.clock.now_ns().saturating_sub(started_ns) / 1_000);
                // A fallback that cannot score leaves the static default.
                if scored.is_ok() {
                    for l in self.logits[..rows].iter_mut() {
                        *l = fb.model.score(*l);
                    }
                    tier = Tier::Fallback;
                    version = fb.model.version;
                }
            }
        }
        if tier == Tier::Default {
            self.logits[..rows].fill(step.default_score);
        }
        let now_ns = self.clock.now_ns();
        if step.deadline.cannot_fit(now_ns / 1_000, 0) {
            // No `Ok` once the deadline was seen to pass: the fallback model
            // finished late, or the step-down itself came late (a give-up
            // the shard reached after the deadline).
            self.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(step.read_at_ns));
            let why = if tier == Tier::Fallback {
                "the fallback model finished after the deadline"
            } else {
                "the deadline passed before a lower rung could answer"
            };
            return self.fail(step.request_id, Status::DeadlineExceeded, why, out);
        }
        self.respond_ok(step, tier, reason, version, now_ns, out);
        self.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(step.read_at_ns));
        Handled::Answered
    }

    /// The protocol floor's answer: `Ok`, no scores, no lookup, no model.
    fn respond_floor(&mut self, request_id: u64, read_at_ns: u64, out: &mut Vec<u8>) -> Handled {
        self.counters.requests += 1;
        self.counters.by_status[usize::from(Status::Ok.0)] += 1;
        self.counters.by_tier[usize::from(Tier::Primary.0)] += 1;
        let now_ns = self.clock.now_ns();
        let fields = ResponseFields {
            server_us: u32::try_from(now_ns.saturating_sub(read_at_ns) / 1_000).unwrap_or(u32::MAX),
            tier: Tier::Primary,
            ..ResponseFields::failure(request_id, Status::Ok, "")
        };
        self.encoder.encode(&fields, out);
        self.times.record_ns(Stage::EndToEnd, self.clock.now_ns().saturating_sub(read_at_ns));
        Handled::Answered
    }

    /// Whether the feed has gone past its staleness bound; responses say so.
    #[inline]
    fn features_stale(&mut self, now_ns: u64) -> bool {
        let stale = self.shared.feed.as_ref().is_some_and(|f| f.is_stale(now_ns));
        self.counters.stale_responses += u64::from(stale);
        stale
    }

    /// Stage timings of the current interval, for publication.
    pub fn times_mut(&mut self) -> &mut StageTimes {
        &mut self.times
    }

    /// Answers a frame the shard could not even split (bad length prefix).
    pub fn reject_stream(&mut self, error: &wire::FrameError, out: &mut Vec<u8>) {
        self.fail(0, Status::BadRequest, &error.to_string(), out);
    }

    /// Requests answered per served version, and the drift counts of the
    /// interval (which start again from zero), for publication.
    pub fn version_report(&mut self) -> VersionReport {
        VersionReport {
            counts: self
                .served
                .iter()
                .map(|s| (s.model.name.clone(), s.model.version, s.canary_ppm > 0, s.requests, s.backend.name()))
                .collect(),
            drift: self.served.iter_mut().filter_map(|s| Some((s.model.clone(), s.drift.as_mut()?.take()))).collect(),
            drift_intervals: self.shared.registry.drift().window_intervals(crate::metrics::PUBLISH_INTERVAL),
        }
    }

    /// The primary's breaker state, for metrics.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }
}

#[cfg(test)]
mod tests;
