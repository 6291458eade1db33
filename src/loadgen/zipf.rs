//! Zipf(s) over ranks 1..=n in constant memory, for load generation over
//! populations of any size a replica can hold (issue 19 asks for Zipf(1.1)
//! user ids over 50M users; a cumulative table of 8 bytes per rank does not
//! scale to that, and a table search costs a cache miss per draw).
//!
//! Rejection-inversion (Hörmann & Derflinger, "Rejection-inversion to
//! generate variates from monotone discrete distributions", 1996). With
//! h(x) = x^-s and H its antiderivative, rank k is given the interval
//! [H(k + 1/2) - h(k), H(k + 1/2)] of length exactly h(k). Because h is
//! convex and decreasing, h(k) <= H(k + 1/2) - H(k - 1/2), so these
//! intervals do not overlap and each fits inside the interval that H maps
//! [k - 1/2, k + 1/2] to (for k = 1 the interval starts below H(1/2), which
//! is why the domain starts at H(3/2) - 1). A draw takes u uniform over
//! [H(3/2) - 1, H(n + 1/2)], inverts it to x = H^-1(u), rounds x to the
//! nearest rank k and accepts k when u falls in k's interval; otherwise it
//! draws again. Each rank is then accepted with probability proportional to
//! h(k): the distribution is exact up to floating-point rounding, and the
//! acceptance rate is the ratio of the pmf's mass to the intervals' span
//! (above 0.98 for every exponent from 0.01 to 20, so a draw costs about
//! one exp and two logs, plus as many again for its interval's end).
//!
//! H and its inverse are written through expm1/ln_1p so that s = 1 (where
//! H is ln) and s near 1 need no special case and lose no precision.

use crate::seeded::SplitMix64;

/// Most ranks a sampler draws over. Each rank's interval ends are computed
/// to within an ulp of u's range, 2^-52 of it; over n ranks that misplaces
/// at most about n * 2^-52 of the mass, 2^-20 at this bound.
pub const RANKS_MAX: u64 = 1 << 32;
/// Largest exponent accepted: beyond it rank 1 has all but 2^-20 of the mass
/// and k^-s underflows for ranks that matter no more.
pub const EXPONENT_MAX: f64 = 20.0;
/// Rejections in a row after which the sampler is broken, not unlucky: with
/// an acceptance rate above 0.98, 64 rejections in a row have probability
/// below 10^-100.
const ATTEMPTS_MAX: usize = 64;

/// Why a sampler cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ZipfError {
    #[error("Zipf exponent {0} is outside (0, {EXPONENT_MAX}]")]
    Exponent(f64),
    #[error("Zipf over {0} ranks: must be 1..={RANKS_MAX}")]
    Ranks(u64),
}

/// Zipf(s) over ranks 1..=n: P(k) = k^-s / sum over j of j^-s.
/// A few floats, whatever n: building one allocates nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Zipf {
    n: u64,
    s: f64,
    /// H(3/2) - h(1): the low end of u's range, rank 1's interval's start.
    h_low: f64,
    /// H(n + 1/2): the high end of u's range.
    h_high: f64,
}

/// (e^t - 1) / t, continuous at 0.
fn expm1_over(t: f64) -> f64 {
    if t.abs() > 1e-8 {
        t.exp_m1() / t
    } else {
        1.0 + t / 2.0 + t * t / 6.0
    }
}

/// ln(1 + t) / t, continuous at 0.
fn ln1p_over(t: f64) -> f64 {
    if t.abs() > 1e-8 {
        t.ln_1p() / t
    } else {
        1.0 - t / 2.0 + t * t / 3.0
    }
}

impl Zipf {
    pub fn new(s: f64, n: u64) -> Result<Zipf, ZipfError> {
        if !(s > 0.0 && s <= EXPONENT_MAX) {
            return Err(ZipfError::Exponent(s));
        }
        if !(1..=RANKS_MAX).contains(&n) {
            return Err(ZipfError::Ranks(n));
        }
        let mut z = Zipf { n, s, h_low: 0.0, h_high: 0.0 };
        z.h_low = z.big_h(1.5) - 1.0;
        z.h_high = z.big_h(n as f64 + 0.5);
        Ok(z)
    }

    pub fn ranks(&self) -> u64 {
        self.n
    }

    pub fn exponent(&self) -> f64 {
        self.s
    }

    /// h(x) = x^-s.
    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    /// H(x) = (x^(1-s) - 1) / (1-s), or ln x at s = 1; increasing in x.
    fn big_h(&self, x: f64) -> f64 {
        let ln_x = x.ln();
        ln_x * expm1_over((1.0 - self.s) * ln_x)
    }

    /// H^-1(y) = (1 + (1-s) y)^(1/(1-s)), or e^y at s = 1.
    fn big_h_inv(&self, y: f64) -> f64 {
        (y * ln1p_over((1.0 - self.s) * y)).exp()
    }

    /// The next rank, 1..=n.
    pub fn sample(&self, rng: &mut SplitMix64) -> u64 {
        for _ in 0..ATTEMPTS_MAX {
            // unit() is in [0, 1), so u is in (h_low, h_high].
            let u = self.h_high + rng.unit() * (self.h_low - self.h_high);
            let x = self.big_h_inv(u);
            // The float-to-int cast saturates, so an x a rounding error past
            // either end still lands on a rank.
            let k = ((x + 0.5) as u64).clamp(1, self.n);
            if u >= self.big_h(k as f64 + 0.5) - self.h(k as f64) {
                return k;
            }
        }
        panic!("Zipf({}, {}) rejected {ATTEMPTS_MAX} draws in a row: the sampler is broken", self.s, self.n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact pmf over 1..=n.
    fn pmf(s: f64, n: u64) -> Vec<f64> {
        let w: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
        let total: f64 = w.iter().sum();
        w.into_iter().map(|x| x / total).collect()
    }

    /// Draw counts of ranks 1..=n from `draws` samples with a fixed seed.
    fn counts(z: &Zipf, draws: usize, seed: u64) -> Vec<u64> {
        let mut rng = SplitMix64::new(seed);
        let mut c = vec![0u64; z.ranks() as usize];
        for _ in 0..draws {
            let k = z.sample(&mut rng);
            assert!((1..=z.ranks()).contains(&k), "rank {k} outside 1..={}", z.ranks());
            c[k as usize - 1] += 1;
        }
        c
    }

    /// Whether the counts of the top `top` ranks are each within 5 standard
    /// deviations of what `pmf` expects, and the rest within 5 together.
    fn fits(c: &[u64], pmf: &[f64], top: usize) -> Result<(), String> {
        let draws: u64 = c.iter().sum();
        let within = |observed: u64, p: f64, what: &str| {
            let expected = draws as f64 * p;
            let sd = (draws as f64 * p * (1.0 - p)).sqrt().max(1.0);
            let z = (observed as f64 - expected) / sd;
            if z.abs() <= 5.0 {
                Ok(())
            } else {
                Err(format!("{what}: {observed} drawn, {expected:.0} expected ({z:+.1} sd)"))
            }
        };
        for k in 0..top.min(c.len()) {
            within(c[k], pmf[k], &format!("rank {}", k + 1))?;
        }
        let rest: u64 = c[top.min(c.len())..].iter().sum();
        within(rest, pmf[top.min(c.len())..].iter().sum(), "the other ranks")
    }

    #[test]
    fn small_populations_follow_the_exact_pmf() {
        for (s, n) in [(1.1, 100), (1.0, 1000), (0.5, 50), (2.5, 20), (0.99, 7), (1.01, 300)] {
            let z = Zipf::new(s, n).unwrap();
            let c = counts(&z, 400_000, 11);
            fits(&c, &pmf(s, n), 10).unwrap_or_else(|e| panic!("Zipf({s}, {n}): {e}"));
        }
    }

    /// The same check has the power to tell neighbouring exponents apart:
    /// a sampler off by 0.05 in s would fail the test above.
    #[test]
    fn the_check_rejects_a_wrong_exponent() {
        let c = counts(&Zipf::new(1.1, 100).unwrap(), 400_000, 11);
        for wrong in [1.05, 1.15, 1.0] {
            assert!(fits(&c, &pmf(wrong, 100), 10).is_err(), "Zipf(1.1) draws passed as Zipf({wrong})");
        }
    }

    #[test]
    fn one_and_two_ranks() {
        let mut rng = SplitMix64::new(3);
        let one = Zipf::new(1.1, 1).unwrap();
        assert!((0..1000).all(|_| one.sample(&mut rng) == 1));
        let c = counts(&Zipf::new(1.0, 2).unwrap(), 300_000, 5);
        fits(&c, &[2.0 / 3.0, 1.0 / 3.0], 2).unwrap();
    }

    #[test]
    fn seeded_draws_repeat() {
        let z = Zipf::new(1.1, 50_000_000).unwrap();
        let draw = |seed| {
            let mut rng = SplitMix64::new(seed);
            (0..1000).map(|_| z.sample(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(9), draw(9));
        assert_ne!(draw(9), draw(10));
    }

    /// sum of k^-s for k in 1..=n, by Euler–Maclaurin past the first 10,000
    /// terms (error far below 1e-12 there).
    fn harmonic(s: f64, n: u64) -> f64 {
        let m = 10_000u64.min(n);
        let head: f64 = (1..m).map(|k| (k as f64).powf(-s)).sum();
        if m == n {
            return head + (n as f64).powf(-s);
        }
        let f = |x: f64| x.powf(-s);
        let integral = ((n as f64).powf(1.0 - s) - (m as f64).powf(1.0 - s)) / (1.0 - s);
        head + integral
            + (f(m as f64) + f(n as f64)) / 2.0
            + s / 12.0 * ((m as f64).powf(-s - 1.0) - (n as f64).powf(-s - 1.0))
    }

    /// At 2^30 ranks the top ranks and the far tail get their exact shares.
    #[test]
    fn a_billion_ranks_follow_the_pmf() {
        let (s, n) = (1.1, 1u64 << 30);
        let z = Zipf::new(s, n).unwrap();
        let total = harmonic(s, n);
        let mut rng = SplitMix64::new(17);
        let draws = 400_000;
        let (mut top, mut tail) = ([0u64; 5], 0u64);
        for _ in 0..draws {
            let k = z.sample(&mut rng);
            assert!((1..=n).contains(&k));
            if k <= 5 {
                top[k as usize - 1] += 1;
            }
            tail += u64::from(k > 1 << 20);
        }
        let mut c: Vec<u64> = top.to_vec();
        c.push(draws - top.iter().sum::<u64>() - tail);
        c.push(tail);
        let mut p: Vec<f64> = (1..=5).map(|k| (k as f64).powf(-s) / total).collect();
        let p_tail = 1.0 - harmonic(s, 1 << 20) / total;
        p.push(1.0 - p.iter().sum::<f64>() - p_tail);
        p.push(p_tail);
        fits(&c, &p, 7).unwrap();
        // Zipf(1.1) over 2^30 ranks still sends about an eighth of its draws
        // beyond the first million ranks: a table of them would not do.
        assert!((0.12..0.15).contains(&p_tail), "{p_tail}");
    }

    /// A `Copy` type cannot own heap memory (it has no `Drop`), so a sampler
    /// over 2^32 ranks is the same four words as one over ten.
    #[test]
    fn a_sampler_is_four_words_whatever_n() {
        fn copy<T: Copy>(t: T) -> T {
            t
        }
        let big = copy(Zipf::new(1.1, RANKS_MAX).unwrap());
        assert_eq!(std::mem::size_of_val(&big), 32);
        assert_eq!(big.ranks(), RANKS_MAX);
    }

    #[test]
    fn limits_are_typed_errors() {
        assert_eq!(Zipf::new(0.0, 10), Err(ZipfError::Exponent(0.0)));
        assert!(Zipf::new(f64::NAN, 10).is_err());
        assert_eq!(Zipf::new(21.0, 10), Err(ZipfError::Exponent(21.0)));
        assert_eq!(Zipf::new(1.1, 0), Err(ZipfError::Ranks(0)));
        assert_eq!(Zipf::new(1.1, RANKS_MAX + 1), Err(ZipfError::Ranks(RANKS_MAX + 1)));
        let z = Zipf::new(EXPONENT_MAX, RANKS_MAX).unwrap();
        let mut rng = SplitMix64::new(1);
        assert!((0..1000).all(|_| (1..=RANKS_MAX).contains(&z.sample(&mut rng))));
        let z = Zipf::new(0.01, RANKS_MAX).unwrap();
        assert!((0..1000).all(|_| (1..=RANKS_MAX).contains(&z.sample(&mut rng))));
    }
}
