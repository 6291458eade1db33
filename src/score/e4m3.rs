//! FP8 E4M3 conversion, the element type of the planned GPU FP8 backend.
//!
//! Written down here so host-side packing and tests agree bit for bit with
//! the device's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`.
//!
//! Format (the "fn" variant: finite values and NaN, no infinities): one sign
//! bit, four exponent bits with bias 7, three mantissa bits.
//! - Exponent field 1..=15: `(1 + m/8) · 2^(e - 7)`, except `0x7F` / `0xFF`
//!   (exponent 15, mantissa 7), which are NaN. The largest finite magnitude
//!   is `0x7E` = 448.
//! - Exponent field 0: subnormals `m · 2^-9`, so the smallest positive value
//!   is 2^-9 and the largest subnormal 7 · 2^-9; `0x08` is the smallest
//!   normal, 2^-6. `0x00` is +0 and `0x80` is -0.
//!
//! Encoding `f32 → u8` (`from_f32`):
//! - any NaN (either sign, any payload) becomes `0x7F`;
//! - magnitudes above 448, infinities included, saturate to ±448;
//! - everything else rounds to the nearest representable value, ties to the
//!   even code (even mantissa), subnormal range included; the sign is kept,
//!   so -0.0 and negative values that round to zero give `0x80`.
//!
//! Decoding `u8 → f32` (`to_f32`) is exact; both NaN codes give `f32::NAN`.
//!
//! Tests: `every_code_round_trips` (all 256 codes decode and re-encode to
//! themselves, NaN codes to `0x7F`); `boundaries` (saturation at 448, 464,
//! 480 and infinity, NaN, signed zero, ties to even between adjacent codes
//! in the normal and subnormal ranges and across a binade, the smallest
//! subnormal and half of it, the largest subnormal, the smallest normal);
//! `the_encoder_matches_a_nearest_code_search_for_every_f32` (release
//! builds only: every one of the 2³² f32 bit patterns against a slow
//! reference that binary-searches the sorted finite codes for the nearest).

/// The largest finite E4M3 magnitude.
pub const MAX: f32 = 448.0;
/// The NaN code every NaN input encodes to.
pub const NAN_CODE: u8 = 0x7F;

/// Encodes `x` with round-to-nearest-even and saturation to ±448.
pub fn from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_CODE;
    }
    let sign = ((x.to_bits() >> 31) as u8) << 7;
    let a = x.abs();
    if a > MAX {
        return sign | 0x7E;
    }
    let magnitude = if a < 2f32.powi(-6) {
        // One quantum is 2^-9 here, and scaling by 2^9 is exact, so
        // rounding the scaled value picks the code; 8 (a rounded-up
        // largest subnormal) is exactly the code of 2^-6.
        (a * 512.0).round_ties_even() as u8
    } else {
        // Round the f32 mantissa to 3 bits, ties to even, letting a carry
        // ripple into the exponent; then rebias the exponent from 127 to 7.
        // `a <= 448` keeps the result at or below 0x7E.
        let bits = a.to_bits();
        let rounded = (bits + 0x7_FFFF + ((bits >> 20) & 1)) >> 20;
        (rounded - (120 << 3)) as u8
    };
    sign | magnitude
}

/// Decodes an E4M3 code exactly.
pub fn to_f32(code: u8) -> f32 {
    let e = u32::from((code >> 3) & 0xF);
    let m = u32::from(code & 7);
    let magnitude = match (e, m) {
        (15, 7) => return f32::NAN,
        (0, _) => m as f32 / 512.0,
        _ => f32::from_bits(((e + 120) << 23) | (m << 20)),
    };
    if code & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for code in 0..=255u8 {
            let v = to_f32(code);
            let want = if code & 0x7F == 0x7F { NAN_CODE } else { code };
            assert_eq!(from_f32(v), want, "code {code:#04x} decodes to {v:e}");
            assert_eq!(v.is_nan(), code & 0x7F == 0x7F, "code {code:#04x}");
        }
    }

    #[test]
    fn boundaries() {
        let p = |e: i32| 2f32.powi(e);
        let cases: &[(f32, u8)] = &[
            (448.0, 0x7E),
            (-448.0, 0xFE),
            (416.0, 0x7D),
            // Halfway between 416 (0x7D) and 448 (0x7E): the even code.
            (432.0, 0x7E),
            (432.0 - p(-10), 0x7D),
            // Above the largest finite value: saturate, never NaN.
            (449.0, 0x7E),
            (464.0, 0x7E),
            (-464.0, 0xFE),
            (480.0, 0x7E),
            (1e30, 0x7E),
            (f32::MAX, 0x7E),
            (f32::INFINITY, 0x7E),
            (f32::NEG_INFINITY, 0xFE),
            (f32::NAN, 0x7F),
            (-f32::NAN, 0x7F),
            (f32::from_bits(0x7F80_0001), 0x7F),
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            // Halfway between 1.0 (0x38) and 1.125 (0x39), and between 1.125
            // and 1.25 (0x3A): ties go to the even code either way.
            (1.0625, 0x38),
            (1.1875, 0x3A),
            (-1.1875, 0xBA),
            (1.0625 + p(-20), 0x39),
            // Halfway between 1.875 (0x3F) and 2.0 (0x40), across a binade.
            (1.9375, 0x40),
            // Smallest subnormal, half of it (a tie with 0: even is 0), and
            // a little more than half.
            (p(-9), 0x01),
            (p(-10), 0x00),
            (-p(-10), 0x80),
            (p(-10) + p(-30), 0x01),
            (p(-10) - p(-30), 0x00),
            // Halfway between subnormals 1 and 2 and between 2 and 3.
            (3.0 * p(-10), 0x02),
            (5.0 * p(-10), 0x02),
            // Largest subnormal, smallest normal, and the tie between them.
            (7.0 * p(-9), 0x07),
            (p(-6), 0x08),
            (7.5 * p(-9), 0x08),
            (f32::from_bits(1), 0x00),
            (-f32::from_bits(1), 0x80),
        ];
        for &(x, want) in cases {
            assert_eq!(from_f32(x), want, "{x:e} ({:#x})", x.to_bits());
        }
        assert_eq!(to_f32(0x7E), 448.0);
        assert_eq!(to_f32(0x08), p(-6));
        assert_eq!(to_f32(0x07), 7.0 * p(-9));
        assert_eq!(to_f32(0x01), p(-9));
        assert_eq!(to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(to_f32(0x7F).is_nan() && to_f32(0xFF).is_nan());
    }

    /// The slow, obviously correct encoder: the nearest of the sorted finite
    /// magnitudes, found by binary search, ties to the even code.
    #[cfg(not(debug_assertions))]
    fn reference(x: f32, magnitudes: &[f32]) -> u8 {
        if x.is_nan() {
            return NAN_CODE;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        let top = magnitudes.len() - 1;
        if a >= magnitudes[top] {
            return sign | top as u8;
        }
        let lo = magnitudes.partition_point(|&v| v <= a) - 1;
        let hi = lo + 1;
        // Adjacent codes' midpoint has one more mantissa bit than either
        // code, so it is exact in f32 and the comparisons are exact.
        let mid = (magnitudes[lo] + magnitudes[hi]) / 2.0;
        let code = if a < mid || (a == mid && lo % 2 == 0) { lo } else { hi };
        sign | code as u8
    }

    #[cfg(not(debug_assertions))]
    #[test]
    fn the_encoder_matches_a_nearest_code_search_for_every_f32() {
        let magnitudes: Vec<f32> = (0..=0x7Eu8).map(to_f32).collect();
        assert!(magnitudes.windows(2).all(|w| w[0] < w[1]));
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
        let chunk = (1u64 << 32).div_ceil(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                let magnitudes = &magnitudes;
                s.spawn(move || {
                    for bits in (t * chunk)..((t + 1) * chunk).min(1 << 32) {
                        let x = f32::from_bits(bits as u32);
                        assert_eq!(from_f32(x), reference(x, magnitudes), "{x:e} ({bits:#x})");
                    }
                });
            }
        });
    }
}
