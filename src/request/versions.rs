//! The model versions one shard serves: each with its own backend instance
//! (repacked weights, scratch), its layout and kernel cost estimate, and
//! the fallback model of the lower rung. Swapped between read rounds from
//! the registry's published set (`Versions::refresh`), never mid-request.

use std::sync::Arc;

use crate::deadline::Clock;
use crate::drift::DriftCounts;
use crate::metrics::{Counters, VersionReport};
use crate::model::Model;
use crate::registry::{build_timed, Inbox, Prebuilt, Registry};
use crate::request::cache::hash_words;
use crate::request::ladder::LadderConfig;
use crate::request::{GroupFit, InputLayout, LayoutError};
use crate::score::explaining::Explaining;
use crate::score::{Backend, BackendKind};

/// A running estimate of the kernel's cost per candidate row, so the path
/// can refuse work that would finish past the deadline before starting it.
#[derive(Clone, Copy, Debug)]
pub(super) struct KernelCost {
    pub(super) ns_per_row: f64,
}

impl KernelCost {
    /// Exponentially weighted: recent batches dominate, one outlier does not.
    const WEIGHT_NEW: f64 = 0.05;

    pub(super) fn expected_us(&self, rows: usize) -> u64 {
        (self.ns_per_row * rows as f64 / 1_000.0).ceil() as u64
    }

    pub(super) fn observe(&mut self, rows: usize, elapsed_us: u64) {
        let sample = elapsed_us as f64 * 1_000.0 / rows.max(1) as f64;
        self.ns_per_row += (sample - self.ns_per_row) * Self::WEIGHT_NEW;
    }
}

/// One served model version on one shard: its own backend instance (with
/// its repacked weights and scratch) and its kernel cost estimate.
pub(super) struct Served {
    pub(super) model: Arc<Model>,
    pub(super) backend: Box<dyn Backend>,
    pub(super) layout: InputLayout,
    pub(super) kernel_cost: KernelCost,
    /// Parts per million of users this version serves as a canary of the
    /// current version with the same name; 0 for a current version.
    pub(super) canary_ppm: u32,
    /// Parts per million of requests this version also scores as a shadow
    /// of the current version with the same name; 0 otherwise.
    pub(super) shadow_ppm: u32,
    /// Requests it answered, for per-version metrics.
    pub(super) requests: u64,
    /// The model name hashed for score-cache keys.
    pub(super) name_hash: u64,
    /// The static default for this model (`ladder.default_scores`).
    pub(super) default_score: f32,
    /// The fallback model reads the same inputs as this one.
    pub(super) fallback_fits: bool,
    /// Per context id, the rows of the embedding that reads it
    /// (`Model::context_id_rows`): an id beyond them counts as missing.
    pub(super) id_rows: Vec<u64>,
    /// `Model::float_index_columns`, with whether each column is
    /// per-request (checked once) or per candidate.
    pub(super) index_cols: Vec<(usize, usize, bool)>,
    /// Scores returned by the primary and context inputs received since the
    /// last publication; `None` for a version without calibration (no
    /// baseline to compare with) and for a shadow (its scores are not served).
    pub(super) drift: Option<DriftCounts>,
    /// Where the inputs drift follows are in a row (`Model::drift_columns`).
    pub(super) drift_columns: Vec<(usize, usize)>,
    /// How many of `drift_columns` hold a per-request value; the rest, one
    /// per candidate (`Model::drift_request_segments`).
    pub(super) drift_request_segments: usize,
    /// The version's explainer (shared with the other shards) with this
    /// shard's scratch and cost estimate, or why the model cannot be
    /// explained, or `Unused` for the fallback and a shadow
    /// (`score::explaining`).
    pub(super) explaining: Explaining,
}

impl Served {
    pub(super) fn is_current(&self) -> bool {
        self.canary_ppm == 0 && self.shadow_ppm == 0
    }
}

/// A user's fixed position in 0..1_000_000, the same on every shard and
/// process, so a canary keeps each user on one side.
pub(super) fn user_bucket(user_id: u64) -> u32 {
    let mut z = user_id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) % 1_000_000) as u32
}

/// What a version's backend and layout are built for: fixed at start-up.
pub(super) struct Fit {
    pub(super) kind: BackendKind,
    pub(super) rows_max: usize,
    pub(super) context_len_max: usize,
    /// The served feature groups a layout is checked against.
    pub(super) groups: Vec<GroupFit>,
    pub(super) ladder: LadderConfig,
}

/// The served set and where it comes from.
pub(super) struct Versions {
    pub(super) registry: Arc<Registry>,
    fit: Fit,
    /// This shard's inbox of backends the admin side built ahead of a swap
    /// (`RequestPath::set_shard` takes it).
    pub(super) inbox: Option<Inbox>,
    pub(super) served: Vec<Served>,
    pub(super) default_model: usize,
    /// The registry generation `served` reflects.
    pub(super) generation: u64,
    /// A registry generation whose versions could not all be built here:
    /// the served set stayed as it was, and it is not retried.
    failed_generation: Option<u64>,
    /// The fallback rung: a small model run inline.
    pub(super) fallback: Option<Served>,
}

/// What a version is built for: a served version (current, canary or
/// shadow) or the fallback rung.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Served,
    Fallback,
}

/// Where `Versions` builds a backend: the shard's clock, counters and a
/// logits buffer for the measuring run.
pub(super) struct BuildPlace<'a, C: Clock> {
    pub(super) clock: &'a C,
    pub(super) counters: &'a mut Counters,
    pub(super) logits: &'a mut [f32],
}

impl Versions {
    /// No version served yet (`refresh` serves the registry's), the
    /// fallback built.
    pub(super) fn new<C: Clock>(
        registry: Arc<Registry>,
        fit: Fit,
        fallback: Option<Arc<Model>>,
        at: BuildPlace<'_, C>,
    ) -> Result<Versions, LayoutError> {
        let mut versions = Versions {
            registry,
            fit,
            inbox: None,
            served: Vec::new(),
            default_model: 0,
            generation: 0,
            failed_generation: None,
            fallback: None,
        };
        // The fallback first: served versions record whether it fits them.
        if let Some(model) = fallback {
            versions.fallback = Some(versions.build_served(model, 0, 0, Role::Fallback, at)?);
        }
        Ok(versions)
    }

    /// A backend for `model` with everything the request path derives from
    /// the version once, measured on a full batch so the first request's
    /// cost check is informed.
    fn build_served<C: Clock>(
        &mut self,
        model: Arc<Model>,
        canary_ppm: u32,
        shadow_ppm: u32,
        role: Role,
        at: BuildPlace<'_, C>,
    ) -> Result<Served, LayoutError> {
        let fit = &self.fit;
        let layout = InputLayout::new(&model, &fit.groups, fit.context_len_max)?;
        // Built ahead by the admin side when it was published through the
        // registry; built here (milliseconds on the reactor) only otherwise.
        let Prebuilt { backend, ns_per_row, explainer } = match self.inbox.as_mut().and_then(|i| i.take(&model)) {
            Some(built) => {
                at.counters.backends_prebuilt += 1;
                built
            }
            None => {
                at.counters.backends_built_on_shard += 1;
                let clock = at.clock;
                build_timed(fit.kind, &model, fit.rows_max, layout.row_dim, at.logits, || clock.now_ns())
            }
        };
        // The version's one explainer: the admin side's, sent with the
        // backend, or the shared table's (built by the first shard here).
        let explaining = match (role, explainer) {
            (Role::Fallback, _) => Explaining::Unused,
            (Role::Served, _) if shadow_ppm > 0 => Explaining::Unused,
            (Role::Served, Some(built)) => Explaining::for_shard(&built),
            (Role::Served, None) => {
                let clock = at.clock;
                Explaining::for_shard(&self.registry.explainer(&model, || clock.now_ns()))
            }
        };
        let ladder = &fit.ladder;
        let context_features_max = self.registry.drift().context_features_max;
        let drift = model.calibration.as_ref().filter(|_| shadow_ppm == 0);
        Ok(Served {
            drift: drift.map(|c| DriftCounts::new(c, context_features_max)),
            drift_columns: model.drift_columns(),
            drift_request_segments: model.drift_request_segments(),
            backend,
            explaining,
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

    /// Picks up model versions the registry published since the last call.
    /// One atomic load when nothing changed. Returns whether the served set
    /// changed.
    pub(super) fn refresh<C: Clock>(&mut self, at: BuildPlace<'_, C>) -> Result<bool, LayoutError> {
        let generation = self.registry.generation();
        // A generation that could not be served is not retried on every
        // round (a layout check, or a build, runs on the reactor); the next
        // one is.
        if generation == self.generation || Some(generation) == self.failed_generation {
            return Ok(false);
        }
        let snapshot = self.registry.snapshot();
        let wanted: Vec<(Arc<Model>, u32, u32)> = snapshot
            .models
            .iter()
            .map(|m| (m.clone(), 0, 0))
            .chain(snapshot.canaries.iter().map(|(m, ppm)| (m.clone(), *ppm, 0)))
            .chain(snapshot.shadows.iter().map(|(m, ppm)| (m.clone(), 0, *ppm)))
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
            let at = BuildPlace { clock: at.clock, counters: &mut *at.counters, logits: &mut *at.logits };
            match self.build_served(model, canary_ppm, shadow_ppm, Role::Served, at) {
                Ok(served) => plan.push(Next::Built(Box::new(served))),
                Err(e) => {
                    self.failed_generation = Some(snapshot.generation);
                    return Err(e);
                }
            }
        }
        self.generation = snapshot.generation;
        self.failed_generation = None;
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
        if let Some(inbox) = &mut self.inbox {
            inbox.trim(snapshot.generation);
        }
        Ok(true)
    }

    /// The widest model input row of the served set.
    pub(super) fn row_dim_max(&self) -> usize {
        self.served.iter().map(|s| s.layout.row_dim).max().unwrap_or(0)
    }

    /// Whether any served version shadows another.
    pub(super) fn shadowing(&self) -> bool {
        self.served.iter().any(|s| s.shadow_ppm > 0)
    }

    /// The version that answers a request for `model_name` (empty: the
    /// default) from `user_id`: the current version, or its canary for the
    /// canary's share of users. `None` for a model not served.
    pub(super) fn choose(&self, model_name: &str, user_id: u64) -> Option<usize> {
        let mut chosen = if model_name.is_empty() {
            self.default_model
        } else {
            self.served.iter().position(|s| s.is_current() && s.model.name == model_name)?
        };
        let name = &self.served[chosen].model.name;
        if let Some(c) = self.served.iter().position(|s| s.canary_ppm > 0 && s.model.name == *name) {
            if user_bucket(user_id) < self.served[c].canary_ppm {
                chosen = c;
            }
        }
        Some(chosen)
    }

    /// Requests answered per served version, and the drift counts of the
    /// interval (which start again from zero), for publication.
    pub(super) fn report(&mut self) -> VersionReport {
        VersionReport {
            counts: self
                .served
                .iter()
                .map(|s| (s.model.name.clone(), s.model.version, s.canary_ppm > 0, s.requests, s.backend.name()))
                .collect(),
            drift: self.served.iter_mut().filter_map(|s| Some((s.model.clone(), s.drift.as_mut()?.take()))).collect(),
            drift_intervals: self.registry.drift().window_intervals(crate::metrics::PUBLISH_INTERVAL),
        }
    }
}
