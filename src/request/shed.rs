//! Load shedding by priority: when a shard is over capacity, requests of the
//! lowest priorities are answered at once (`Overloaded`, or the static
//! default with reason `overload`, by config), before any lookup or kernel,
//! so that the capacity left goes to higher priorities and their latency
//! holds. Nothing is retried inside the server: retries amplify load.
//!
//! Load is read from the shard's own queue, per request and at no cost: how
//! long the request waited in its connection's read buffer behind the frames
//! read with it (from the read to its decode), over `queue_delay_max_us`;
//! with `inference = "thread"` also the fill of the shard's job slots
//! (requests handed to the stage and not yet answered). Either reaching 1
//! means the shard is full. The wait, not the number of frames waiting, is
//! the measure because a shed frame costs next to nothing: a buffer full of
//! frames that will be shed is no backlog, a buffer of frames that will be
//! scored is, and the time the frames ahead took tells the two apart.
//!
//! Priorities (higher = more important) fall into bands by bit length: 0, 1,
//! 2–3, 4–7, … 64–127, 128–255, so a few widely spaced levels land in
//! different bands whatever numbers clients choose. The shed level counts
//! bands and is fractional: bands below its integer part are shed whole, the
//! next one in part (deterministically, by credit), band 128–255 never. While
//! requests see load at or above `high_watermark` the level rises by a
//! quarter band, at most once per `queue_delay_max_us` (about the time the
//! queue takes to show a step's effect, so it does not overshoot on the
//! frames already read); it falls by one band per `release_ms` spent at or
//! below `low_watermark`; between the two it holds. That asymmetry is the
//! hysteresis: a burst sheds a band within a few milliseconds, a lull must
//! last before shed bands come back, and the sawtooth of each read round
//! (a full buffer draining to empty) does not make it flap.

use serde::{Deserialize, Serialize};

pub use crate::metrics::{band, band_name, BANDS};

/// What a shed request is answered with.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ShedAnswer {
    /// `Overloaded`, no scores: the client may go elsewhere.
    #[default]
    Overloaded,
    /// `Ok` with the model's static default scores, tier `default`, reason
    /// `overload`: for callers that must get scores.
    Default,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ShedConfig {
    /// Off unless set: with it on, a client that pipelines deeply at the
    /// lowest priority (0, the wire default) is shed by design.
    pub enabled: bool,
    /// Time a request waits in its connection's read buffer, behind the
    /// frames read with it, that counts as full load.
    pub queue_delay_max_us: u64,
    /// Load (fraction of `queue_delay_max_us`, or of the job slots) at or
    /// above which the shed level rises.
    pub high_watermark: f64,
    /// Load at or below which the shed level falls; between the two it holds.
    pub low_watermark: f64,
    /// Time at low load for the shed level to fall by one band.
    pub release_ms: u64,
    pub answer: ShedAnswer,
}

impl Default for ShedConfig {
    fn default() -> Self {
        ShedConfig {
            enabled: false,
            queue_delay_max_us: 1_000,
            high_watermark: 0.5,
            low_watermark: 0.25,
            release_ms: 50,
            answer: ShedAnswer::Overloaded,
        }
    }
}

impl ShedConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=10_000_000).contains(&self.queue_delay_max_us) {
            return Err("shed.queue_delay_max_us must be within 1..=10000000".into());
        }
        let (lo, hi) = (self.low_watermark, self.high_watermark);
        if !(lo.is_finite() && hi.is_finite() && 0.0 <= lo && lo < hi && hi <= 64.0) {
            return Err("shed: need 0 <= low_watermark < high_watermark <= 64".into());
        }
        if !(1..=600_000).contains(&self.release_ms) {
            return Err("shed.release_ms must be within 1..=600000".into());
        }
        Ok(())
    }
}

/// One shard's shed controller: shard-local, no locks, nothing allocated.
#[derive(Debug)]
pub struct Shedder {
    config: ShedConfig,
    /// Bands shed, fractional (see the module header); 0 sheds nothing.
    level: f64,
    /// The marginal band's running share of shed requests.
    credit: f64,
    last_ns: u64,
    /// The level may rise again from this time.
    next_rise_ns: u64,
    /// Requests shed, by band.
    pub shed_by_band: [u64; BANDS],
}

impl Shedder {
    /// One rise at high load: four shed one more band.
    const RISE_STEP: f64 = 0.25;
    /// The top band is never shed.
    const LEVEL_MAX: f64 = (BANDS - 1) as f64;

    /// `config` must have passed `validate` (the config loader checks it).
    pub fn new(config: ShedConfig) -> Shedder {
        config.validate().expect("shed config was validated at load");
        Shedder { config, level: 0.0, credit: 0.0, last_ns: 0, next_rise_ns: 0, shed_by_band: [0; BANDS] }
    }

    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    pub fn answer(&self) -> ShedAnswer {
        self.config.answer
    }

    /// The current shed level in bands, for metrics.
    pub fn level(&self) -> f64 {
        self.level
    }

    /// Load from a request's wait since its read and the job-slot fill (0..=1).
    pub fn load(&self, waited_us: u64, fill: f64) -> f64 {
        (waited_us as f64 / self.config.queue_delay_max_us as f64).max(fill)
    }

    /// Updates the level with the `load` a request of `priority` sees at
    /// `now_ns` and says whether to shed it.
    pub fn shed(&mut self, priority: u8, load: f64, now_ns: u64) -> bool {
        if !self.config.enabled {
            return false;
        }
        let elapsed_ns = now_ns.saturating_sub(self.last_ns);
        self.last_ns = self.last_ns.max(now_ns);
        if load >= self.config.high_watermark {
            if now_ns >= self.next_rise_ns {
                self.level = (self.level + Self::RISE_STEP).min(Self::LEVEL_MAX);
                self.next_rise_ns = now_ns + self.config.queue_delay_max_us * 1_000;
            }
        } else if load <= self.config.low_watermark && self.level > 0.0 {
            let fall = elapsed_ns as f64 / (self.config.release_ms as f64 * 1e6);
            self.level = (self.level - fall).max(0.0);
        }
        let b = band(priority);
        let whole = self.level.floor() as usize;
        let shed = match b.cmp(&whole) {
            std::cmp::Ordering::Less => true,
            std::cmp::Ordering::Greater => false,
            std::cmp::Ordering::Equal => {
                self.credit += self.level - whole as f64;
                let shed = self.credit >= 1.0;
                if shed {
                    self.credit -= 1.0;
                }
                shed
            }
        };
        self.shed_by_band[b] += u64::from(shed);
        shed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn shedder() -> Shedder {
        Shedder::new(ShedConfig { enabled: true, ..ShedConfig::default() })
    }

    #[test]
    fn bands_follow_bit_length() {
        let bands: Vec<usize> = [0u8, 1, 2, 3, 4, 7, 8, 9, 15, 16, 127, 128, 255].iter().map(|&p| band(p)).collect();
        assert_eq!(bands, [0, 1, 2, 2, 3, 3, 4, 4, 4, 5, 7, 8, 8]);
        assert_eq!(band_name(band(9)), "8-15");
    }

    #[test]
    fn disabled_sheds_nothing() {
        let mut s = Shedder::new(ShedConfig::default());
        assert!((0..1_000).all(|i| !s.shed(0, 100.0, i)));
        assert_eq!(s.level(), 0.0);
    }

    #[test]
    fn high_load_sheds_the_lowest_band_first_and_never_the_top() {
        let mut s = shedder();
        // Below the high watermark nothing rises.
        assert!((0..100).all(|i| !s.shed(0, 0.49, i)));
        // High load: a quarter band per queue_delay_max_us (1 ms), no faster.
        for i in 0..20 {
            s.shed(9, 0.5, 100 + i);
        }
        assert_eq!(s.level(), 0.25);
        for i in 1..4 {
            s.shed(9, 0.5, 100 + i * MS);
        }
        assert_eq!(s.level(), 1.0, "band 0 shed whole; 9 (band 4) stays");
        assert!(s.shed(0, 0.3, 200));
        assert!(!s.shed(9, 0.3, 200), "load between the watermarks holds the level");
        // Sustained overload climbs to the top, which is never shed.
        for i in 0..100 {
            s.shed(200, 10.0, (10 + i) * MS);
        }
        assert_eq!(s.level(), 8.0);
        let t = 200 * MS;
        assert!(s.shed(127, 10.0, t) && !s.shed(128, 10.0, t) && !s.shed(255, 10.0, t));
        assert_eq!(s.shed_by_band[0], 1);
        assert_eq!(s.shed_by_band[7], 1);
        assert_eq!(s.shed_by_band[8], 0);
    }

    #[test]
    fn the_marginal_band_is_shed_in_part() {
        let mut s = shedder();
        s.shed(9, 1.0, 0);
        s.shed(9, 1.0, MS);
        assert_eq!(s.level(), 0.5);
        let shed = (0..1_000).filter(|&i| s.shed(0, 0.3, 2 * MS + i)).count();
        assert_eq!(shed, 500, "half of band 0");
    }

    #[test]
    fn the_level_falls_only_after_a_lull_and_one_band_per_release() {
        let mut s = shedder();
        for i in 0..8 {
            s.shed(9, 1.0, i * MS);
        }
        assert_eq!(s.level(), 2.0);
        // Low load for 25 ms: half a band.
        s.shed(9, 0.0, 32 * MS);
        assert!((s.level() - 1.5).abs() < 1e-9, "{}", s.level());
        // Time at load between the watermarks does not count.
        s.shed(9, 0.4, 200 * MS);
        assert!((s.level() - 1.5).abs() < 1e-9, "{}", s.level());
        s.shed(9, 0.1, 275 * MS);
        assert_eq!(s.level(), 0.0);
        assert!(!s.shed(0, 0.1, 276 * MS));
    }

    #[test]
    fn validation() {
        assert!(ShedConfig::default().validate().is_ok());
        let bad = |f: fn(&mut ShedConfig)| {
            let mut c = ShedConfig::default();
            f(&mut c);
            c.validate().is_err()
        };
        assert!(bad(|c| c.queue_delay_max_us = 0));
        assert!(bad(|c| c.low_watermark = 0.5));
        assert!(bad(|c| c.high_watermark = f64::NAN));
        assert!(bad(|c| c.release_ms = 0));
    }
}
