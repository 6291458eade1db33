//! [`RequestPath::handle`] as its stages, read top to bottom:
//!
//! admit (decode, budget, readiness, rate, model, canary, shed)
//! → assemble (input shape, lookup, drift)
//! → plan (cache, budget, breaker: which rung answers, hand-off or inline)
//! → run (the inline kernel and the check after it) or hand off
//! → finish (respond, drift, cache fill, shadow sample, timings).
//!
//! Each stage returns the next one's input or a [`Rejection`], which names
//! the answer the request gets instead; [`RequestPath::answer`] is the one
//! place that turns a rejection into a response. Stages pass indices into
//! `served` rather than borrows, so every stage borrows only what it needs.

use std::borrow::Cow;

use super::*;

/// How a request that leaves the primary path is answered.
pub(super) enum Rejection {
    /// A response without scores.
    Fail { request_id: u64, status: Status, why: Cow<'static, str> },
    /// The protocol floor (benchmark mode): `Ok`, no scores.
    Floor { request_id: u64, read_at_ns: u64 },
    /// Shed by priority before any lookup.
    Shed { request_id: u64, chosen: usize, rows: usize, read_at_ns: u64, deadline: Deadline },
    /// Every candidate is cached, and the cache answers before the primary.
    Cached { step: StepDown, version: u32, now_ns: u64 },
    /// A lower rung answers.
    StepDown { step: StepDown, reason: Reason },
}

impl Rejection {
    fn fail(request_id: u64, status: Status, why: impl Into<Cow<'static, str>>) -> Rejection {
        Rejection::Fail { request_id, status, why: why.into() }
    }
}

/// A decoded request that may be served, and by which version.
pub(super) struct Admitted<'p> {
    request: wire::Request<'p>,
    read_at_ns: u64,
    decoded_ns: u64,
    deadline: Deadline,
    /// Index in `served`: the named or default model, or its canary.
    chosen: usize,
}

/// A request whose model input rows are in `RequestPath::x`.
pub(super) struct Assembled {
    step: StepDown,
    /// Its score-cache key, item left 0.
    cache_key: Key,
    chosen: usize,
    user_id: u64,
    /// When the lookup finished.
    at_ns: u64,
}

/// Where the primary rung runs.
pub(super) enum Route {
    /// On the inference stage; the response follows from `complete`.
    HandOff,
    /// On the shard, now.
    Inline,
}

/// A request the primary scored inline, in time; scores in `RequestPath::logits`.
pub(super) struct Ran {
    assembled: Assembled,
    version: u32,
    after_kernel_ns: u64,
}

impl<C: Clock> RequestPath<C> {
    /// Handles one request payload read at `read_at_ns` on connection `conn`,
    /// whose peer is `source` (what admission binds client ids to).
    /// Appends exactly one response frame to `out`, or, when the request went
    /// to the inference stage, returns `Pending`: its response comes later
    /// from [`RequestPath::complete`].
    pub fn handle(&mut self, payload: &[u8], read_at_ns: u64, conn: u32, peer: Peer<'_>, out: &mut Vec<u8>) -> Handled {
        match self.primary(payload, read_at_ns, conn, peer) {
            Ok(Some(ran)) => self.finish(ran, out),
            Ok(None) => Handled::Pending,
            Err(rejection) => self.answer(rejection, out),
        }
    }

    /// The primary path: `Some` when scored inline, `None` when handed off.
    fn primary(
        &mut self,
        payload: &[u8],
        read_at_ns: u64,
        conn: u32,
        peer: Peer<'_>,
    ) -> Result<Option<Ran>, Rejection> {
        let admitted = self.admit(payload, read_at_ns, peer)?;
        let mut assembled = self.assemble(admitted)?;
        match self.plan(&mut assembled)? {
            Route::HandOff => self.hand_off(assembled, conn).map(|()| None),
            Route::Inline => self.run(assembled).map(Some),
        }
    }

    /// Decode, then check the request itself: budget, readiness, rate,
    /// model (and its canary), shedding.
    fn admit<'p>(&mut self, payload: &'p [u8], read_at_ns: u64, peer: Peer<'_>) -> Result<Admitted<'p>, Rejection> {
        // Verify the FlatBuffer with limits before reading any field.
        let request = wire::decode_request(payload, &self.request_limits).map_err(|e| {
            let id = wire::salvage_request_id(payload, &self.request_limits);
            Rejection::fail(id, Status::BadRequest, e.to_string())
        })?;
        let request_id = request.request_id();
        if self.shared.floor {
            return Err(Rejection::Floor { request_id, read_at_ns });
        }
        let limits = &self.shared.limits;
        let budget_us = match request.budget_us() {
            0 => limits.budget_us_default,
            b => b.min(limits.budget_us_max),
        };
        let deadline = Deadline::from_budget(read_at_ns / 1_000, budget_us);
        let decoded_ns = self.clock.now_ns();
        self.times.record_ns(Stage::Decode, decoded_ns.saturating_sub(read_at_ns));
        if deadline.cannot_fit(decoded_ns / 1_000, 0) {
            return Err(Rejection::fail(request_id, Status::DeadlineExceeded, "budget spent before decode finished"));
        }
        if !self.shared.readiness.is_ready() {
            return Err(Rejection::fail(request_id, Status::Overloaded, "server is not ready"));
        }
        let priority = match self.admission.admit_from(request.raw.client_id(), peer, decoded_ns) {
            // A client asking for more than its cap is shed as the cap.
            Admit::Admitted { priority_max } => request.raw.priority().min(priority_max),
            Admit::OverRate => {
                return Err(Rejection::fail(request_id, Status::RateLimited, "client over its rate limit"));
            }
            Admit::WrongSource => {
                self.counters.admission_wrong_source += 1;
                let why = "client_id is bound to other source networks or certificate names than this connection's";
                return Err(Rejection::fail(request_id, Status::RateLimited, why));
            }
        };
        let model_name = request.model();
        let chosen = if model_name.is_empty() {
            Some(self.default_model)
        } else {
            self.served.iter().position(|s| s.is_current() && s.model.name == model_name)
        };
        let Some(mut chosen) = chosen else {
            return Err(Rejection::fail(request_id, Status::ModelNotFound, "unknown model"));
        };
        let name = &self.served[chosen].model.name;
        if let Some(c) = self.served.iter().position(|s| s.canary_ppm > 0 && s.model.name == *name) {
            if user_bucket(request.user_id()) < self.served[c].canary_ppm {
                chosen = c;
            }
        }
        if self.shedder.enabled() && self.shed_now(priority, read_at_ns, decoded_ns) {
            let rows = request.item_ids().len();
            return Err(Rejection::Shed { request_id, chosen, rows, read_at_ns, deadline });
        }
        self.served[chosen].requests += 1;
        Ok(Admitted { request, read_at_ns, decoded_ns, deadline, chosen })
    }

    /// Checks the inputs against the chosen model's layout, then writes the
    /// model input rows: the user vector once, one item vector per candidate,
    /// the context; counts what is missing and records drift.
    fn assemble(&mut self, a: Admitted<'_>) -> Result<Assembled, Rejection> {
        let request = &a.request;
        let request_id = request.request_id();
        let s = &mut self.served[a.chosen];
        let layout = &s.layout;
        let context = request.context();
        let context_dim = layout.context.map_or(0, |(_, d)| d);
        if !context.is_empty() && context.len() != context_dim {
            let why = format!("context has {} floats, the model takes {context_dim}", context.len());
            return Err(Rejection::fail(request_id, Status::BadRequest, why));
        }
        let context_ids = request.context_ids();
        let ids_dim = layout.context_ids.map_or(0, |(_, d)| d);
        if !context_ids.is_empty() && context_ids.len() != ids_dim {
            let why = format!("context_ids has {} ids, the model takes {ids_dim}", context_ids.len());
            return Err(Rejection::fail(request_id, Status::BadRequest, why));
        }

        let items = request.item_ids();
        let rows = items.len();
        let row_dim = layout.row_dim;
        self.item_ids.clear();
        self.item_ids.extend(items.iter());
        let x = &mut self.x[..rows * row_dim];
        let mut missing = 0u32;
        if let Some(off) = layout.user {
            let dim = self.shared.user.dim();
            let (first, rest) = x.split_at_mut(row_dim);
            missing += u32::from(!self.shared.user.read_into(request.user_id(), &mut first[off..off + dim]));
            for row in rest.chunks_exact_mut(row_dim) {
                row[off..off + dim].copy_from_slice(&first[off..off + dim]);
            }
        }
        if let Some(off) = layout.item {
            // Batched so the candidates' memory loads overlap (prefetch).
            let dim = self.shared.item.dim();
            let vectors = &mut self.item_vectors[..rows * dim];
            missing += self.shared.item.read_many_into(&self.item_ids, &mut self.item_rows, vectors) as u32;
            for (row, v) in x.chunks_exact_mut(row_dim).zip(vectors.chunks_exact(dim)) {
                row[off..off + dim].copy_from_slice(v);
            }
        }
        if let Some((off, dim)) = layout.context {
            for row in x.chunks_exact_mut(row_dim) {
                let dst = &mut row[off..off + dim];
                if context.is_empty() {
                    dst.fill(0.0);
                } else {
                    for (d, c) in dst.iter_mut().zip(context.iter()) {
                        *d = c;
                    }
                }
            }
            if let Some(d) = &mut s.drift {
                if context.is_empty() {
                    d.record_context(std::iter::repeat(0.0), rows);
                } else {
                    d.record_context(context.iter(), rows);
                }
            }
        }
        if let Some((off, dim)) = layout.context_ids {
            missing += if context_ids.is_empty() {
                dim as u32
            } else {
                let id_rows = s.id_rows.iter();
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
        // Categorical ids in float columns that no embedding row matches
        // read the default row: missing, like an unknown key.
        for &(c, table_rows, per_request) in s.index_cols.iter() {
            let bad = |row: &[f32]| embedding_index(row[c], table_rows).is_none();
            missing += if per_request {
                u32::from(bad(&x[..row_dim]))
            } else {
                x.chunks_exact(row_dim).filter(|r| bad(r)).count() as u32
            };
        }

        let at_ns = self.clock.now_ns();
        self.times.record_ns(Stage::Lookup, at_ns.saturating_sub(a.decoded_ns));
        let cache_key = Key {
            model: s.name_hash,
            version: s.model.version,
            user: request.user_id(),
            item: 0,
            context: hash_words(context.iter().map(|c| u64::from(c.to_bits())).chain(context_ids.iter())),
        };
        let step = StepDown {
            request_id,
            rows,
            row_dim,
            read_at_ns: a.read_at_ns,
            deadline: a.deadline,
            missing,
            fallback: s.fallback_fits,
            cached: false,
            default_score: s.default_score,
        };
        Ok(Assembled { step, cache_key, chosen: a.chosen, user_id: request.user_id(), at_ns })
    }

    /// Checks the time left and picks the rung: the cache when it answers
    /// first, a lower rung when the primary cannot fit or its breaker is
    /// open, else the primary on the stage (when attached and the rows fit
    /// a job slot) or inline. Looks the cache up (`a.step.cached`).
    fn plan(&mut self, a: &mut Assembled) -> Result<Route, Rejection> {
        let (now_ns, rows) = (a.at_ns, a.step.rows);
        let now_us = now_ns / 1_000;
        let deadline = a.step.deadline;
        if deadline.cannot_fit(now_us, 0) {
            return Err(Rejection::fail(a.step.request_id, Status::DeadlineExceeded, "budget spent during lookup"));
        }
        let mut cached = self.cache.enabled();
        if cached {
            for (slot, &item) in self.cached.iter_mut().zip(&self.item_ids) {
                match self.cache.get(&Key { item, ..a.cache_key }, now_ns) {
                    Some(score) => *slot = score,
                    None => {
                        cached = false;
                        break;
                    }
                }
            }
            self.counters.cache_hits = self.cache.hits;
            self.counters.cache_misses = self.cache.misses;
        }
        a.step.cached = cached;
        if cached && self.shared.cache.before_primary {
            let version = self.served[a.chosen].model.version;
            return Err(Rejection::Cached { step: a.step, version, now_ns });
        }
        let handoff = self.stage.as_ref().is_some_and(|s| s.fits(rows * a.step.row_dim));
        let primary_us = if handoff {
            self.turnaround.expected_us(now_ns) + self.shared.ladder.reserve_us
        } else {
            self.served[a.chosen].kernel_cost.expected_us(rows)
        };
        // Budget first: a half-open breaker's probe is spent only on a
        // request that can use it.
        if self.breaker.state() == BreakerState::Closed && deadline.cannot_fit(now_us, primary_us) {
            return Err(Rejection::StepDown { step: a.step, reason: Reason::Budget });
        }
        if !self.breaker.allow(now_ns) {
            return Err(Rejection::StepDown { step: a.step, reason: Reason::BreakerOpen });
        }
        Ok(if handoff { Route::HandOff } else { Route::Inline })
    }

    /// Gives the rows to the inference stage; the response follows from
    /// `complete`, or from `give_up_overdue` at the give-up time.
    fn hand_off(&mut self, a: Assembled, conn: u32) -> Result<(), Rejection> {
        let step = a.step;
        let (rows, row_dim, now_ns) = (step.rows, step.row_dim, a.at_ns);
        let stage = self.stage.as_mut().expect("plan hands off only to an attached stage");
        let Some(token) = stage.acquire() else {
            self.breaker.record(true, now_ns);
            return Err(Rejection::StepDown { step, reason: Reason::Overload });
        };
        let slot = token.index() as usize;
        let model = &self.served[a.chosen].model;
        let data = stage.slot_mut(&token);
        data.x[..rows * row_dim].copy_from_slice(&self.x[..rows * row_dim]);
        data.rows = rows;
        data.model = Some(model.clone());
        if let Err(token) = stage.submit(token, step.deadline.at_us() * 1_000, now_ns) {
            stage.release(token);
            self.breaker.record(true, now_ns);
            return Err(Rejection::StepDown { step, reason: Reason::Overload });
        }
        if step.fallback {
            // The stage owns the slot now; keep the rows for a give-up.
            let at = slot * stage.slot_floats();
            self.shadow[at..at + rows * row_dim].copy_from_slice(&self.x[..rows * row_dim]);
        }
        let give_up_ns = (step.deadline.at_us().saturating_sub(self.shared.ladder.reserve_us)) * 1_000;
        self.next_give_up_ns = self.next_give_up_ns.min(give_up_ns);
        if self.cache.enabled() {
            let at = slot * self.shared.limits.candidates_max;
            self.pending_items[at..at + rows].copy_from_slice(&self.item_ids);
        }
        self.pending[slot] = Some(Pending {
            conn,
            step,
            cache_key: a.cache_key,
            model_version: model.version,
            served: a.chosen,
            generation: self.generation,
            user_id: a.user_id,
            submitted_ns: now_ns,
            give_up_ns,
            answered: false,
        });
        Ok(())
    }

    /// Runs the primary on the shard, then checks it finished in time. A
    /// backend that fails (onnxruntime's error, or one that could not be
    /// built) steps down with reason `model_error`.
    fn run(&mut self, a: Assembled) -> Result<Ran, Rejection> {
        let (rows, row_dim) = (a.step.rows, a.step.row_dim);
        let s = &mut self.served[a.chosen];
        let logits = &mut self.logits[..rows];
        let scored = s.backend.score(&self.x[..rows * row_dim], rows, logits);
        let after_kernel_ns = self.clock.now_ns();
        if scored.is_err() {
            self.breaker.record(true, after_kernel_ns);
            return Err(Rejection::StepDown { step: a.step, reason: Reason::ModelError });
        }
        let kernel_ns = after_kernel_ns.saturating_sub(a.at_ns);
        self.times.record_ns(Stage::Kernel, kernel_ns);
        s.kernel_cost.observe(rows, kernel_ns / 1_000);
        for l in logits.iter_mut() {
            *l = s.model.score(*l);
        }
        let version = s.model.version;
        let late = a.step.deadline.cannot_fit(after_kernel_ns / 1_000, 0);
        self.breaker.record(late, after_kernel_ns);
        if late {
            let id = a.step.request_id;
            return Err(Rejection::fail(id, Status::DeadlineExceeded, "kernel finished past the deadline"));
        }
        Ok(Ran { assembled: a, version, after_kernel_ns })
    }

    /// Answers the primary's scores, then what follows from them: drift
    /// counts, the cache fill, the shadow sample and the stage timings.
    fn finish(&mut self, ran: Ran, out: &mut Vec<u8>) -> Handled {
        let Ran { assembled: a, version, after_kernel_ns } = ran;
        let (rows, row_dim) = (a.step.rows, a.step.row_dim);
        self.respond_ok(&a.step, Tier::Primary, Reason::None, version, after_kernel_ns, out);
        if let Some(d) = &mut self.served[a.chosen].drift {
            d.record_scores(&self.logits[..rows]);
        }
        self.cache.put_all(&a.cache_key, &self.item_ids[..rows], &self.logits[..rows], after_kernel_ns);
        let (x, returned) = (&self.x[..rows * row_dim], &self.logits[..rows]);
        self.shadow_queue.sample(&self.served, a.chosen, a.user_id, x, returned, row_dim);
        let done_ns = self.clock.now_ns();
        self.times.record_ns(Stage::Respond, done_ns.saturating_sub(after_kernel_ns));
        self.times.record_ns(Stage::EndToEnd, done_ns.saturating_sub(a.step.read_at_ns));
        Handled::Answered
    }

    /// The one place a rejection becomes a response.
    fn answer(&mut self, rejection: Rejection, out: &mut Vec<u8>) -> Handled {
        match rejection {
            Rejection::Fail { request_id, status, why } => self.fail(request_id, status, &why, out),
            Rejection::Floor { request_id, read_at_ns } => self.respond_floor(request_id, read_at_ns, out),
            Rejection::Shed { request_id, chosen, rows, read_at_ns, deadline } => {
                self.answer_shed(request_id, chosen, rows, read_at_ns, deadline, out)
            }
            Rejection::Cached { step, version, now_ns } => {
                self.logits[..step.rows].copy_from_slice(&self.cached[..step.rows]);
                self.respond_ok(&step, Tier::Cached, Reason::None, version, now_ns, out);
                self.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(step.read_at_ns));
                Handled::Answered
            }
            Rejection::StepDown { step, reason } => self.step_down(&step, reason, 0, out),
        }
    }
}
