//! The stage's kernel cost model: per batch-size bucket, a running
//! high-percentile estimate of kernel time, which the stage reads to decide
//! when a batch must launch and to drop a job that cannot finish by its
//! deadline. Plain arithmetic over samples, apart from the thread and slot
//! code it serves.

/// A running high-percentile estimate of kernel time for one batch-size
/// bucket: it rises fast on slow samples and falls slowly on fast ones, so
/// one fast run does not make the stage optimistic. Without samples its
/// excess over the fastest run seen halves every 100 ms: a bucket that
/// became too expensive to launch does not stay that way for ever.
#[derive(Clone, Copy, Debug)]
struct CostBucket {
    ns: f64,
    floor_ns: f64,
    at_ns: u64,
}

impl Default for CostBucket {
    fn default() -> Self {
        CostBucket { ns: 0.0, floor_ns: f64::INFINITY, at_ns: 0 }
    }
}

impl CostBucket {
    const HALF_LIFE_NS: f64 = 100e6;

    fn current(&self, now_ns: u64) -> f64 {
        if self.ns <= 0.0 {
            return 0.0;
        }
        let decay = 0.5f64.powf(now_ns.saturating_sub(self.at_ns) as f64 / Self::HALF_LIFE_NS);
        self.floor_ns + (self.ns - self.floor_ns) * decay
    }

    fn observe(&mut self, sample_ns: u64, now_ns: u64) {
        let s = sample_ns as f64;
        self.floor_ns = self.floor_ns.min(s);
        let cur = self.current(now_ns).max(self.floor_ns);
        self.ns = if s > cur { cur + (s - cur) * 0.5 } else { cur + (s - cur) * 0.02 };
        self.at_ns = now_ns;
    }
}

/// Kernel cost by batch size, bucketed by powers of two.
#[derive(Debug)]
pub struct CostTable {
    buckets: Vec<CostBucket>,
}

impl CostTable {
    pub(super) fn new(batch_rows_max: usize) -> CostTable {
        CostTable { buckets: vec![CostBucket::default(); Self::bucket(batch_rows_max) + 1] }
    }

    fn bucket(rows: usize) -> usize {
        rows.max(1).next_power_of_two().trailing_zeros() as usize
    }

    /// Expected kernel time for `rows` at `now_ns`, from the nearest measured bucket.
    pub fn expected_ns(&self, rows: usize, now_ns: u64) -> u64 {
        let b = Self::bucket(rows).min(self.buckets.len() - 1);
        let known = self.buckets[b..].iter().chain(self.buckets[..b].iter().rev()).find(|c| c.ns > 0.0);
        known.map_or(0, |c| c.current(now_ns) as u64)
    }

    pub(super) fn observe(&mut self, rows: usize, ns: u64, now_ns: u64) {
        let b = Self::bucket(rows).min(self.buckets.len() - 1);
        self.buckets[b].observe(ns, now_ns);
    }
}
