//! `--cpu-matmul fast` in bf16: weights dequantized to bf16 panels and
//! activations rounded to bf16, products summed in f32. Two kernels share
//! the panels: AMX tiles ([`super::amx`], Intel) and, where a CPU has no
//! AMX but has AVX512-BF16 (AMD Zen 4 and later), `vdpbf16ps` register
//! tiles here: 16 lanes × a pair of bf16 products per instruction, twice
//! the multiply-adds of an f32 FMA at the same issue rate (measured on
//! Zen 4: one 512-bit `vdpbf16ps` or `vfmadd231ps` a cycle; on Sapphire
//! Rapids `vdpbf16ps` issues at half the FMA rate, so there AMX runs).
//!
//! A pair of groups' weights are dequantized once per task into the panel
//! layout (each value `scale · code + offset` rounded to nearest even): per
//! pair of elements `2i, 2i + 1` one 64-byte line of 16 lanes × two bf16 —
//! the AMX B-tile layout, and the layout `vdpbf16ps` wants with one row of
//! `x`'s pair broadcast to every lane. Each output is then the f32 sum of
//! the bf16 products, pair by pair in `k` order (within 2 · 2⁻⁹ of Σ|w·x|
//! of the exact product); a row's result depends on the batch only through
//! which path runs (decode rows stay exact).

use std::arch::x86_64::*;

use super::packed::{Lines, Packed, LANES};
use super::packed_avx512::{factor, lane_mask, pair};

/// Whether this CPU runs the `vdpbf16ps` kernel.
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// bf16 bits of `v` in the low half of each lane (round to nearest even;
/// the values are finite).
#[inline(always)]
unsafe fn bf16_bits(v: __m512) -> __m512i {
    // SAFETY: AVX-512F, which the caller has.
    unsafe {
        let b = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
        _mm512_srli_epi32(r, 16)
    }
}

/// `x` rounded to bf16 (nearest even, as [`bf16_panel`] rounds weights)
/// into `out`, as long.
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn round_to_bf16(x: &[f32], out: &mut [u16]) {
    let n = x.len().min(out.len());
    let whole = n / LANES * LANES;
    // SAFETY: every access is inside the first `n` elements of both.
    unsafe {
        for i in (0..whole).step_by(LANES) {
            let b = bf16_bits(_mm512_loadu_ps(x.as_ptr().add(i)));
            _mm256_storeu_si256(
                out.as_mut_ptr().add(i) as *mut __m256i,
                _mm512_cvtepi32_epi16(b),
            );
        }
    }
    for i in whole..n {
        out[i] = half::bf16::from_f32(x[i]).to_bits();
    }
}

/// Group `g`'s weights as bf16 pairs in the panel layout, `cols / 2`
/// lines of 16 × u32, into `dst`.
///
/// # Safety
/// AVX-512F; `dst` holds `cols / 2 · 16` u32.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn bf16_panel(p: &Packed, g: usize, dst: *mut u32) {
    let s = p.scheme.sub;
    // SAFETY: as the function's contract; k runs over the group's codes.
    unsafe {
        let table = _mm512_loadu_ps(p.scheme.table.as_ptr());
        for j in 0..p.subs {
            let sc = factor(p, &p.scale_d, &p.scale_m, g, j);
            let of = if p.scheme.offsets {
                factor(p, &p.offs_d, &p.offs_m, g, j)
            } else {
                _mm512_setzero_ps()
            };
            for kk in (j * s..(j + 1) * s).step_by(2) {
                let (lo, hi) = pair(p, g, kk, table);
                let (lo, hi) = (_mm512_fmadd_ps(lo, sc, of), _mm512_fmadd_ps(hi, sc, of));
                let v = _mm512_or_si512(_mm512_slli_epi32(bf16_bits(hi), 16), bf16_bits(lo));
                _mm512_storeu_si512(dst.add(kk / 2 * LANES) as *mut __m512i, v);
            }
        }
    }
}

/// Rows of `x` per register tile: 12 rows × 2 groups of accumulators
/// leave room for the two weight lines and a broadcast.
const TILE_ROWS: usize = 12;

/// `T` rows of bf16 `x` (pairs as u32, `xs` apart) times `G` panels of
/// `kp` lines, into `out` (`os` apart) for each group's lanes in `masks`.
///
/// # Safety
/// AVX-512F and AVX512-BF16; the panels hold `kp` lines, each row of `x`
/// `kp` pairs; `out` is writable there.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile<const T: usize, const G: usize>(
    panels: [*const u32; 2],
    kp: usize,
    (x, xs): (*const u32, usize),
    (out, os): (*mut f32, usize),
    masks: [__mmask16; 2],
) {
    // SAFETY: as the function's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); G]; T];
        for i in 0..kp {
            let mut w = [_mm512_setzero_si512(); G];
            for (gi, w) in w.iter_mut().enumerate() {
                *w = _mm512_loadu_si512(panels[gi].add(i * LANES) as *const __m512i);
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_epi32(*x.add(t * xs + i) as i32);
                for gi in 0..G {
                    acc[gi] = _mm512_dpbf16_ps(acc[gi], to_bh(xv), to_bh(w[gi]));
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            for gi in 0..G {
                _mm512_mask_storeu_ps(out.add(t * os + gi * LANES), masks[gi], acc[gi]);
            }
        }
    }
}

#[inline(always)]
fn to_bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 512 bits of plain data.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Groups `groups` (at most two) times rows `rows` of `xb` (bf16 rows of
/// `cols`), into `out` (`out_stride` apart, column 0 = the first row of
/// `groups.start`).
///
/// # Safety
/// [`available`] returned true; `xb` holds the rows; `out` is writable at
/// those rows for the groups' matrix rows and nobody else writes there
/// meanwhile.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn gemm_block(
    p: &Packed,
    groups: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    xb: *const u16,
    out: *mut f32,
    out_stride: usize,
) {
    let k = p.cols;
    let kp = k / 2;
    let ng = groups.len();
    debug_assert!((1..=2).contains(&ng) && k % 2 == 0);
    let mut panel = Lines::new(ng * kp);
    // SAFETY: as the function's contract: every read is inside `xb`'s
    // rows or the panels, every write inside `out`'s rows.
    unsafe {
        let pp = panel.as_mut_ptr() as *mut u32;
        for gi in 0..ng {
            bf16_panel(p, groups.start + gi, pp.add(gi * kp * LANES));
        }
        let panels = [
            pp as *const u32,
            pp.add((ng - 1) * kp * LANES) as *const u32,
        ];
        let masks = [
            lane_mask(p, groups.start),
            lane_mask(p, groups.start + (ng - 1)),
        ];
        let mut t = rows.start;
        while t < rows.end {
            let h = (rows.end - t).min(TILE_ROWS);
            let x = (xb.add(t * k) as *const u32, kp);
            let o = (out.add(t * out_stride), out_stride);
            macro_rules! go {
                ($($n:literal)*) => {
                    match (h, ng) {
                        $(($n, 2) => tile::<$n, 2>(panels, kp, x, o, masks),
                          ($n, _) => tile::<$n, 1>(panels, kp, x, o, masks),)*
                        _ => unreachable!("a tile has 1 to {TILE_ROWS} rows"),
                    }
                };
            }
            go!(1 2 3 4 5 6 7 8 9 10 11 12);
            t += h;
        }
    }
}
