//! The rules one shard judges each request by, and their state: the limits
//! a frame is decoded under, readiness, the per-client rates (admission),
//! load shedding, the primary's breaker and the ladder's settings.

use std::sync::Arc;

use crate::metrics::{Counters, Readiness};
use crate::request::admission::Admission;
use crate::request::ladder::{Breaker, LadderConfig};
use crate::request::shed::Shedder;
use crate::request::{Limits, Shared};
use crate::wire::RequestLimits;

pub(super) struct Policies {
    pub(super) limits: Limits,
    /// `limits` as the decoder takes them.
    pub(super) request_limits: RequestLimits,
    /// Benchmark floor: verify, then answer `Ok` with no scores.
    pub(super) floor: bool,
    pub(super) readiness: Arc<Readiness>,
    pub(super) ladder: LadderConfig,
    /// Answer from the score cache before the primary when every candidate
    /// is cached (`cache.before_primary`).
    pub(super) cache_before_primary: bool,
    pub(super) admission: Admission,
    pub(super) shedder: Shedder,
    /// The primary's breaker (the stage, or the inline kernel).
    pub(super) breaker: Breaker,
    /// The group whose key keeps the canary choice sticky.
    pub(super) canary_group: Box<str>,
}

impl Policies {
    pub(super) fn new(shared: &Shared) -> Policies {
        let limits = shared.limits.clone();
        Policies {
            request_limits: RequestLimits {
                frame_bytes_max: limits.frame_bytes_max,
                candidates_max: limits.candidates_max,
                context_len_max: limits.context_len_max,
            },
            limits,
            floor: shared.floor,
            readiness: shared.readiness.clone(),
            ladder: shared.ladder.clone(),
            cache_before_primary: shared.cache.before_primary,
            admission: Admission::new(shared.admission.clone(), shared.shards, shared.client_usage.clone()),
            shedder: Shedder::new(shared.shed.clone()),
            breaker: Breaker::new(shared.ladder.breaker),
            canary_group: shared.canary_group.as_str().into(),
        }
    }

    /// Whether a request of `priority` read at `read_at_ns` is shed at
    /// `now_ns`, from this shard's queue: the request's wait in its read
    /// buffer and, handing off, the job-slot fill (`slot_fill`, 0..1).
    pub(super) fn shed_now(
        &mut self,
        priority: u8,
        read_at_ns: u64,
        now_ns: u64,
        slot_fill: f64,
        counters: &mut Counters,
    ) -> bool {
        let load = self.shedder.load(now_ns.saturating_sub(read_at_ns) / 1_000, slot_fill);
        let shed = self.shedder.shed(priority, load, now_ns);
        counters.shed_level_milli = (self.shedder.level() * 1_000.0) as u64;
        if shed {
            counters.shed_by_band = self.shedder.shed_by_band;
        }
        shed
    }
}
