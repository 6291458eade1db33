//! The portable INT8 GEMM: plain Rust on i16 activations, for CPUs without
//! AVX2, with its own requantization pass.

use super::{epilogue, PackedLayer};

const LANES: usize = 8;
const MR: usize = 4;

pub(super) fn gemm<const RAW: bool>(
    p: &PackedLayer,
    xa: &[i16],
    rows: usize,
    sx: &[f32],
    y: &mut [f32],
    acc_out: &mut [i32],
) {
    let mut r = 0;
    while r + MR <= rows {
        for b in 0..p.n_pad / LANES {
            tile::<MR, RAW>(p, xa, r, b, sx, y, acc_out);
        }
        r += MR;
    }
    for r in r..rows {
        for b in 0..p.n_pad / LANES {
            tile::<1, RAW>(p, xa, r, b, sx, y, acc_out);
        }
    }
}

/// The tile's sums, kept out of line so that both epilogues get the
/// same vectorised loop (inlined into the raw one, the compiler left it
/// scalar).
#[inline(never)]
fn sums<const M: usize>(p: &PackedLayer, xa: &[i16], r0: usize, b: usize) -> [[i32; LANES]; M] {
    let w = &p.w_i16.as_slice()[b * p.k_pad * LANES..(b + 1) * p.k_pad * LANES];
    let xs: [&[i16]; M] = std::array::from_fn(|r| &xa[(r0 + r) * p.k_pad..][..p.k_pad]);
    let mut acc = [[0i32; LANES]; M];
    // Products of two sign-extended i16 become `pmaddwd` on plain SSE2.
    for (kk, wl) in w.chunks_exact(LANES).enumerate() {
        for (acc_r, x_r) in acc.iter_mut().zip(&xs) {
            let x = i32::from(x_r[kk]);
            for (a, &wv) in acc_r.iter_mut().zip(wl) {
                *a += x * i32::from(wv);
            }
        }
    }
    acc
}

#[inline(always)]
fn tile<const M: usize, const RAW: bool>(
    p: &PackedLayer,
    xa: &[i16],
    r0: usize,
    b: usize,
    sx: &[f32],
    y: &mut [f32],
    acc_out: &mut [i32],
) {
    let acc = sums::<M>(p, xa, r0, b);
    let o0 = b * LANES;
    let lanes = (p.n - o0).min(LANES);
    for (r, acc_r) in acc.iter().enumerate() {
        let row = r0 + r;
        for (j, &a) in acc_r[..lanes].iter().enumerate() {
            let o = o0 + j;
            if RAW {
                acc_out[row * p.n + o] = a;
            } else {
                y[row * p.n + o] = epilogue(a, p.scales.as_slice()[o], sx[row], p.bias.as_slice()[o], p.relu);
            }
        }
    }
}
