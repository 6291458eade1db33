//! The AMX-INT8 GEMM: `tdpbusd` on tiles, the VNNI epilogue on the
//! stored sums.
//!
//! Rust has no stable AMX intrinsics, so the tile instructions are
//! inline assembly, one instruction per `asm!`. The tile registers are
//! not a register class the compiler knows or ever uses, so their
//! contents persist from one `asm!` to the next; every block that
//! touches memory says so (`readonly` for loads, nothing for the stores
//! the epilogue then reads), and blocks without `pure` stay in order.
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{mask16, PackedLayer, VnniOut};

/// Channels per tile (16 i32 columns of 64 bytes) and rows per tile.
const LANES: usize = 16;
const ROWS: usize = super::super::AMX_TILE_ROWS;
/// Bytes of K per tile step: one 64-byte tile row of activations,
/// 16 rows of 4 k of weights.
const K_STEP: usize = 64;

/// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits
/// 24 and 25; `is_x86_feature_detected!` names them only on nightly)
/// and the kernel granted this process the tile data state, which
/// Linux hands out on request only (`arch_prctl`). Asked once per
/// process; a refusal is logged once.
pub(in super::super) fn ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        if __cpuid(0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        if edx & (1 << 24) == 0 || edx & (1 << 25) == 0 {
            return false;
        }
        permitted()
    })
}

#[cfg(target_os = "linux")]
fn permitted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a system call with two integer arguments and no
    // memory; it changes only which state the kernel saves for
    // this process.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if r != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "the CPU has AMX but the kernel refused the tile data permission (arch_prctl); \
             the INT8 backend uses avx512-vnni instead"
        );
    }
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn permitted() -> bool {
    false
}

/// `ldtilecfg`'s 64-byte operand: palette 1, tiles 0 to 7 all 16
/// rows × 64 bytes. Ragged edges are handled outside the tiles
/// (padded rows, K and channels), so one configuration serves
/// every shape.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        // Bytes per row (u16 at 16 + 2t), then rows (u8 at 48 + t).
        c[16 + 2 * t] = K_STEP as u8;
        c[48 + t] = ROWS as u8;
        t += 1;
    }
    TileConfig(c)
};

/// The four accumulator tiles of a block, stored for the epilogue:
/// tile `2i + j` is rows `16i..` × channel block `j`.
#[repr(C, align(64))]
struct Sums([[i32; ROWS * LANES]; 4]);

/// `tileloadd tmm{T}` of 16 rows of 64 bytes, `stride` bytes apart.
///
/// # Safety
/// A tile configuration is loaded; 16 rows of 64 bytes at `p` with
/// this stride are readable.
#[inline(always)]
unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
    // SAFETY: forwarded to the caller.
    unsafe {
        asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) p, s = in(reg) stride,
            options(nostack, readonly, preserves_flags));
    }
}

/// `tilestored` of tile `T` (16 rows of 16 i32) at `p`, 64 bytes a row.
///
/// # Safety
/// A tile configuration is loaded; 1 KiB at `p` is writable.
#[inline(always)]
unsafe fn store<const T: u8>(p: *mut i32) {
    // SAFETY: forwarded to the caller.
    unsafe {
        asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) p, s = in(reg) K_STEP,
            options(nostack, preserves_flags));
    }
}

/// # Safety
/// A tile configuration is loaded.
#[inline(always)]
unsafe fn zero<const T: u8>() {
    // SAFETY: register-only; forwarded to the caller.
    unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags)) }
}

/// `tmm{C} += tmm{A} (u8) · tmm{B} (i8)`, 4 k per i32 lane.
///
/// # Safety
/// A tile configuration is loaded.
#[inline(always)]
unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: register-only; forwarded to the caller.
    unsafe {
        asm!("tdpbusd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
            options(nostack, nomem, preserves_flags));
    }
}

/// Sums of `MT` × 16 rows from `x` (row stride `k_pad`) against
/// `NT` channel blocks starting at `w` (block stride `groups` lines
/// of 64 bytes), over all of K, into `sums`.
///
/// # Safety
/// A tile configuration is loaded; `x` holds `MT · 16` rows of
/// `k_pad` bytes, `w` `NT` blocks of `k_pad / 4` lines.
#[inline(always)]
unsafe fn block<const MT: usize, const NT: usize>(x: *const u8, k_pad: usize, w: *const i8, sums: &mut Sums) {
    let block_bytes = k_pad * LANES;
    // SAFETY: every load stays inside the caller's rows and blocks:
    // activation tiles at k offsets below `k_pad`, rows below
    // `MT · 16`; weight tiles 16 lines of 64 bytes inside a block.
    unsafe {
        zero::<0>();
        if NT == 2 {
            zero::<1>();
        }
        if MT == 2 {
            zero::<2>();
            if NT == 2 {
                zero::<3>();
            }
        }
        for kc in (0..k_pad).step_by(K_STEP) {
            let w0 = w.add(kc * LANES).cast::<u8>();
            load::<4>(x.add(kc), k_pad);
            load::<6>(w0, K_STEP);
            if NT == 2 {
                load::<7>(w0.add(block_bytes), K_STEP);
            }
            dpbusd::<0, 4, 6>();
            if NT == 2 {
                dpbusd::<1, 4, 7>();
            }
            if MT == 2 {
                load::<5>(x.add(ROWS * k_pad + kc), k_pad);
                dpbusd::<2, 5, 6>();
                if NT == 2 {
                    dpbusd::<3, 5, 7>();
                }
            }
        }
        store::<0>(sums.0[0].as_mut_ptr());
        if NT == 2 {
            store::<1>(sums.0[1].as_mut_ptr());
        }
        if MT == 2 {
            store::<2>(sums.0[2].as_mut_ptr());
            if NT == 2 {
                store::<3>(sums.0[3].as_mut_ptr());
            }
        }
    }
}

/// Rows in blocks of 32 (two A tiles), channels in blocks of 32 (two
/// B tiles): four accumulator tiles, so each tile load feeds two
/// `tdpbusd`. Each block's sums are stored to the stack and each row
/// of 16 channels goes through `out.finish`, the VNNI epilogue, so
/// every output is bit for bit the VNNI one. Rows past `rows` in the
/// last tile are computed from whatever the activation matrix holds
/// there and never stored. A call of fewer than `p.amx_rows_min`
/// rows, or that many left after whole tiles, has those rows done
/// by `gemm_vnni_rows` instead (the same sums, the same epilogue).
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI and AMX-INT8, and this
/// process must hold the tile permission (`ready()`); `p` must be
/// packed for `Amx`; `xa` must hold `rows` rows of `p.k_pad` bytes
/// (checked: and be readable up to the next multiple of 16 rows);
/// `out` must be valid for `rows` rows of `p.n` channels.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(in super::super) unsafe fn gemm<O: VnniOut>(p: &PackedLayer, xa: &[u8], rows: usize, out: &O) {
    assert!(p.k_pad.is_multiple_of(K_STEP) && p.n_pad.is_multiple_of(LANES));
    assert!(xa.len() >= rows.next_multiple_of(ROWS) * p.k_pad);
    assert!(p.w_i8.as_slice().len() == p.n_pad * p.k_pad);
    let left = rows % ROWS;
    let tiled = match rows {
        _ if rows < p.amx_rows_min => 0,
        _ if left < p.amx_rows_min => rows - left,
        _ => rows,
    };
    if tiled < rows {
        // SAFETY: the caller's contract covers `gemm_vnni`'s.
        unsafe { super::gemm_vnni_rows(p, xa, tiled, rows, out) };
    }
    if tiled == 0 {
        return;
    }
    let blocks = p.n_pad / LANES;
    let w = p.w_i8.as_slice().as_ptr();
    let mut sums = Sums([[0; ROWS * LANES]; 4]);
    load_config();
    let rows = tiled;
    for r0 in (0..rows).step_by(2 * ROWS) {
        let row_tiles = if rows - r0 > ROWS { 2 } else { 1 };
        let x = xa[r0 * p.k_pad..].as_ptr();
        for b0 in (0..blocks).step_by(2) {
            let wb = w.wrapping_add(b0 * p.k_pad * LANES);
            // SAFETY: the configuration is loaded; `row_tiles` tiles
            // of rows from `r0` end at or below `rows` rounded up to
            // 16, inside `xa` (asserted); `b0` and the next block
            // are below `blocks` when two are used.
            unsafe {
                match (row_tiles, blocks - b0 > 1) {
                    (2, true) => block::<2, 2>(x, p.k_pad, wb, &mut sums),
                    (2, false) => block::<2, 1>(x, p.k_pad, wb, &mut sums),
                    (_, true) => block::<1, 2>(x, p.k_pad, wb, &mut sums),
                    (_, false) => block::<1, 1>(x, p.k_pad, wb, &mut sums),
                }
            }
            for j in 0..(blocks - b0).min(2) {
                let o0 = (b0 + j) * LANES;
                let mask = mask16(p.n - o0.min(p.n));
                for i in 0..row_tiles {
                    let tile = &sums.0[2 * i + j];
                    for r in 0..(rows - r0 - i * ROWS).min(ROWS) {
                        // SAFETY: an aligned load of one stored row
                        // of 16 sums; the row is below `rows` and the
                        // block below `n_pad`, as `finish` needs.
                        unsafe {
                            let acc = _mm512_load_si512(tile[r * LANES..].as_ptr().cast());
                            out.finish(p, r0 + i * ROWS + r, o0, mask, acc);
                        }
                    }
                }
            }
        }
    }
}

/// Releases this thread's tiles (`tilerelease`: configuration and
/// data back to their initial state), as other AMX code may between
/// two calls, so a test can check that the next call configures
/// them again.
///
/// # Safety
/// The tile permission is held (`ready()`).
#[cfg(test)]
pub(in super::super) unsafe fn release() {
    // SAFETY: no operands; forwarded to the caller.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

/// Makes `CONFIG` this thread's tile configuration. `ldtilecfg`
/// costs about 150 ns here (it also zeroes every tile), several
/// times a small layer's tiles, so the current one is read back
/// first (`sttilecfg`, about 25 ns) and loaded only when it differs:
/// on a thread's first call, or after other code on the thread
/// configured the tiles its own way or released them. The tiles are
/// not released after a call: the state stays in use, which costs
/// only the 8 KiB the kernel saves at a context switch.
#[inline(always)]
fn load_config() {
    let mut current = TileConfig([0; 64]);
    // SAFETY: `sttilecfg` writes the 64 bytes of `current` (all zero
    // when the tiles are not configured).
    unsafe { asm!("sttilecfg [{}]", in(reg) &mut current, options(nostack, preserves_flags)) };
    if current.0 != CONFIG.0 {
        // SAFETY: the configuration is a 64-byte aligned constant
        // that the CPU accepts (palette 1, 8 tiles within its
        // limits of 16 rows × 64 bytes).
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags)) };
    }
}
