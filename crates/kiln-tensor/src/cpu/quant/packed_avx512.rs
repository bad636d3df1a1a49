//! AVX-512 (F, BW, VNNI) products with [`Packed`] weights and [`Limbs`]
//! activations, in the arithmetic [`super::packed`] defines: byte
//! products by `vpdpbusd` (four a lane, 64 an instruction) summed exactly
//! in i32, then the sub-block's f32 steps. A decode product unpacks codes
//! in registers; a GEMM unpacks a pair of groups' codes once into a byte
//! panel and reuses it for every row of `x`. Both give the portable
//! code's bits lane for lane.

use std::arch::x86_64::*;

use super::limbs::{Limbs, SubInfo};
use super::packed::{byte_line, nibble_line, plane_line, Lines, Packed, ScaleKind, LANES};

/// Elements of `k` a GEMM tile covers at a time (a whole number of
/// sub-blocks).
const KC: usize = 256;
/// Rows of `x` whose accumulators stay in L1 while they sweep `k`.
const RB: usize = 32;
/// Rows of `x` per GEMM register tile (2 groups × 3 rows × 3 limbs of
/// i32 accumulators and 6 of f32 fill the 32 registers).
const MAX_T: usize = 3;

/// How far ahead, in elements of `k`, the decode product asks for its
/// streams (codes, plane, scales). Measured on Zen 4 (2 threads, 8960 ×
/// 1536 from DRAM, alternated in one process): 256 ahead took Q4_K from
/// 26.5–28 to 31–33 GB/s, Q4_0 and Q5_0 +9–16 %, Q8_0 unchanged; 128
/// gained half as much on Q4_K, 1024 less than 256. Q6_K (a 2-bit plane,
/// 16-element sub-blocks) gained nothing at 256 and 2 % at 128, and its
/// prefetches cost 15 % in cache, so it asks for nothing.
const AHEAD: usize = 256;

/// Whether this CPU runs these kernels.
pub(crate) fn detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn factor(p: &Packed, d: &[u16], m: &[i8], g: usize, j: usize) -> __m512 {
    // SAFETY: d_index/m_index name 16 entries inside the buffers.
    unsafe {
        let dv = _mm512_cvtph_ps(_mm256_loadu_si256(
            d.as_ptr().add(p.d_index(g, j)) as *const __m256i
        ));
        match p.scheme.scales {
            ScaleKind::F16 => dv,
            ScaleKind::Super { .. } => {
                let mv = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                    m.as_ptr().add(p.m_index(g, j)) as *const __m128i
                ));
                _mm512_mul_ps(dv, _mm512_cvtepi32_ps(mv))
            }
        }
    }
}

/// The values of the codes of elements `k` (even) and `k + 1` of group
/// `g`, as f32 (for the bf16 panels of `--cpu-matmul fast`).
#[inline(always)]
pub(crate) unsafe fn pair(p: &Packed, g: usize, k: usize, table: __m512) -> (__m512, __m512) {
    // SAFETY: the caller's k lies inside the group's codes.
    unsafe {
        let base = p.codes.as_ptr().add(g * p.group_code_bytes());
        let count = |n: usize| _mm_cvtsi32_si128(n as i32);
        let ff = _mm512_set1_epi32(0xFF);
        let bias = _mm512_set1_epi32(p.scheme.bias);
        let value = |u: __m512i| _mm512_cvtepi32_ps(_mm512_sub_epi32(u, bias));
        if !p.scheme.nibble {
            let v = _mm512_loadu_si512(base.add(byte_line(k)) as *const __m512i);
            let c = _mm512_srl_epi32(v, count(8 * (k % 4)));
            return (
                value(_mm512_and_si512(c, ff)),
                value(_mm512_and_si512(_mm512_srli_epi32(c, 8), ff)),
            );
        }
        // Element 8m + t sits at bit 8·(t % 4) + 4·(t / 4) of its lane's
        // nibble word; k + 1 one byte above k (k is even).
        let v = _mm512_loadu_si512(base.add(nibble_line(k)) as *const __m512i);
        let t = k % 8;
        let c = _mm512_srl_epi32(v, count(8 * (t % 4) + 4 * (t / 4)));
        let high = p.scheme.high;
        if high == 0 {
            return (
                _mm512_permutexvar_ps(c, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32(c, 8), table),
            );
        }
        let r = k % (32 / high as usize);
        let w = _mm512_loadu_si512(base.add(plane_line(p.cols, high, k)) as *const __m512i);
        let h = _mm512_srl_epi32(w, count(8 * (r % 4) + high as usize * (r / 4)));
        let (lo, hm) = (_mm512_set1_epi32(0xF), _mm512_set1_epi32((1 << high) - 1));
        let code = |c: __m512i, h: __m512i| {
            _mm512_or_si512(
                _mm512_and_si512(c, lo),
                _mm512_slli_epi32(_mm512_and_si512(h, hm), 4),
            )
        };
        (
            value(code(c, h)),
            value(code(_mm512_srli_epi32(c, 8), _mm512_srli_epi32(h, 8))),
        )
    }
}

/// Lanes of group `g` that are rows of the matrix.
pub(crate) fn lane_mask(p: &Packed, g: usize) -> __mmask16 {
    let valid = (p.rows - g * LANES).min(LANES);
    ((1u32 << valid) - 1) as __mmask16
}

/// The i32 word of four limb bytes at `p` broadcast to every lane.
#[inline(always)]
unsafe fn word(p: *const i8) -> __m512i {
    // SAFETY: the caller's four bytes are readable.
    unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}

/// The 16-entry operand table of a nibble format, in every 128-bit lane
/// (for `vpshufb`), if it has one.
#[inline(always)]
unsafe fn lut(p: &Packed) -> Option<__m512i> {
    // SAFETY: the table has 16 bytes.
    p.scheme
        .lut
        .map(|t| unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr() as *const __m128i)) })
}

/// A nibble line's low and high codes as operand bytes: elements
/// `8m..8m + 4` and `8m + 4..8m + 8` of each lane.
#[inline(always)]
unsafe fn nibbles(v: __m512i, lut: Option<__m512i>) -> (__m512i, __m512i) {
    // SAFETY: plain register ops (AVX-512BW, enabled by every caller).
    unsafe {
        let m = _mm512_set1_epi8(0x0F);
        let lo = _mm512_and_si512(v, m);
        let hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m);
        match lut {
            Some(t) => (_mm512_shuffle_epi8(t, lo), _mm512_shuffle_epi8(t, hi)),
            None => (lo, hi),
        }
    }
}

/// A sub-block's high-bit plane line rotated to the operand's bits 4..
/// (`H` bits a code; quad `q`'s bits then sit `H · q` further up; a
/// rotation, so the top byte's bits are not shifted out).
#[inline(always)]
unsafe fn plane(line: *const u8) -> __m512i {
    // SAFETY: the line's 64 bytes are readable; AVX-512F.
    unsafe { _mm512_rol_epi32::<4>(_mm512_loadu_si512(line as *const __m512i)) }
}

/// Operand bytes of one quad: its low nibbles `lo` with the high bits at
/// the bottom of `hs` (`lo | (hs & mask)`), and `hs` moved to the next
/// quad.
#[inline(always)]
unsafe fn with_high<const H: u32>(lo: __m512i, hs: &mut __m512i) -> __m512i {
    // SAFETY: plain register ops (AVX-512F).
    unsafe {
        let mask = _mm512_set1_epi8((((1u32 << H) - 1) << 4) as i8);
        let u = _mm512_ternarylogic_epi32::<0xF8>(lo, *hs, mask);
        *hs = _mm512_rorv_epi32(*hs, _mm512_set1_epi32(H as i32));
        u
    }
}

/// The exact limb sums of one sub-block, with the bias folded in.
struct Sums {
    a: __m512i,
    b: __m512i,
    c: __m512i,
}

impl Sums {
    /// Starting values: `−bias·T` and `−bias·C` (see the module docs).
    #[inline(always)]
    unsafe fn start(bias: i32, info: &SubInfo) -> Sums {
        // SAFETY: plain register ops.
        unsafe {
            Sums {
                a: _mm512_setzero_si512(),
                b: _mm512_set1_epi32(-bias * info.t),
                c: _mm512_set1_epi32(-bias * info.c),
            }
        }
    }

    /// Four elements a lane: operand bytes `u` times the limb words.
    #[inline(always)]
    unsafe fn add(&mut self, u: __m512i, a: __m512i, b: __m512i, c: __m512i) {
        // SAFETY: AVX-512 VNNI, enabled by every caller.
        unsafe {
            self.a = _mm512_dpbusd_epi32(self.a, u, a);
            self.b = _mm512_dpbusd_epi32(self.b, u, b);
            self.c = _mm512_dpbusd_epi32(self.c, u, c);
        }
    }

    /// `fma(scale · 2^e, fma(f32(256·A + B), 256, f32(C)), acc)`, then
    /// the offset's term when `of` is given.
    #[inline(always)]
    unsafe fn finish(&self, acc: __m512, sc: __m512, info: &SubInfo, of: Option<__m512>) -> __m512 {
        // SAFETY: plain register ops.
        unsafe {
            let big = _mm512_add_epi32(_mm512_slli_epi32(self.a, 8), self.b);
            let sum = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(big),
                _mm512_set1_ps(256.0),
                _mm512_cvtepi32_ps(self.c),
            );
            let w = _mm512_mul_ps(sc, _mm512_set1_ps(info.scale));
            let acc = _mm512_fmadd_ps(w, sum, acc);
            match of {
                Some(of) => _mm512_fmadd_ps(of, _mm512_set1_ps(info.sum), acc),
                None => acc,
            }
        }
    }
}

/// Asks for sub-block `j + AHEAD / s` of group `g` (codes at `codes`):
/// its code lines, plane line and scales. Past the group's end the
/// addresses run into the next group's (which the same task reads next)
/// or past the buffers, where a prefetch does nothing.
#[inline(always)]
unsafe fn prefetch_ahead<const NIB: bool, const H: u32>(
    p: &Packed,
    codes: *const u8,
    g: usize,
    j: usize,
) {
    // SAFETY: prefetches do not fault; the addresses are only computed.
    unsafe {
        let s = p.scheme.sub;
        let k = j * s + AHEAD;
        let at = |ptr: *const u8| _mm_prefetch::<_MM_HINT_T1>(ptr as *const i8);
        if NIB {
            for m in 0..s / 8 {
                at(codes.wrapping_add(nibble_line(k + 8 * m)));
            }
            if H > 0 {
                at(codes.wrapping_add(plane_line(p.cols, H, k)));
            }
        } else {
            for q in 0..s / 4 {
                at(codes.wrapping_add(byte_line(k + 4 * q)));
            }
        }
        // Scales: once per 64-byte line of them (16 bytes of sub-scales a
        // sub-block; 32 of f16 a sub-block or super-block).
        let jj = j + AHEAD / s;
        let (d_every, m_every) = match p.scheme.scales {
            ScaleKind::F16 => (2, 0),
            ScaleKind::Super { subs_per_super } => (2 * subs_per_super, 4),
        };
        if jj % d_every == 0 {
            at(p.scale_d.as_ptr().wrapping_add(p.d_index(g, jj)) as *const u8);
            if p.scheme.offsets {
                at(p.offs_d.as_ptr().wrapping_add(p.d_index(g, jj)) as *const u8);
            }
        }
        if m_every > 0 && jj % m_every == 0 {
            at(p.scale_m.as_ptr().wrapping_add(p.m_index(g, jj)) as *const u8);
            if p.scheme.offsets {
                at(p.offs_m.as_ptr().wrapping_add(p.m_index(g, jj)) as *const u8);
            }
        }
    }
}

/// `G` groups from `g0` times one row of `x` (its limbs `xl`, its
/// sub-blocks' `info`), written to `out` (row `g0 · 16` first).
///
/// # Safety
/// AVX-512 F/BW/VNNI; groups `g0..g0 + G` exist; `xl` and `info` are a
/// row of [`Limbs`] of `p`'s sub-block; `out` is writable for the groups'
/// matrix rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn gemv<const G: usize, const NIB: bool, const H: u32>(
    p: &Packed,
    g0: usize,
    xl: *const i8,
    info: *const SubInfo,
    out: *mut f32,
) {
    // SAFETY: as the function's contract; every index stays inside the
    // groups' codes and scales and the row's limbs.
    unsafe {
        let gcb = p.group_code_bytes();
        let codes = p.codes.as_ptr().add(g0 * gcb);
        let s = p.scheme.sub;
        let bias = p.scheme.bias;
        let table = lut(p);
        let mut acc = [_mm512_setzero_ps(); G];
        for j in 0..p.subs {
            let inf = &*info.add(j);
            let xb = xl.add(j * 3 * s);
            if H < 2 {
                for gi in 0..G {
                    prefetch_ahead::<NIB, H>(p, codes.add(gi * gcb), g0 + gi, j);
                }
            }
            let mut sums: [Sums; G] = std::array::from_fn(|_| Sums::start(bias, inf));
            let limb = |q: usize| {
                (
                    word(xb.add(4 * q)),
                    word(xb.add(s + 4 * q)),
                    word(xb.add(2 * s + 4 * q)),
                )
            };
            if NIB {
                // The sub-block's high-bit plane (one line: a sub-block is
                // the plane's run of 32 / H elements).
                let mut hs: [__m512i; G] = std::array::from_fn(|gi| {
                    if H > 0 {
                        plane(codes.add(gi * gcb + plane_line(p.cols, H, j * s)))
                    } else {
                        _mm512_setzero_si512()
                    }
                });
                for m in 0..s / 8 {
                    let (la, lb, lc) = limb(2 * m);
                    let (ha, hb, hc) = limb(2 * m + 1);
                    for (gi, sums) in sums.iter_mut().enumerate() {
                        let line = codes.add(gi * gcb + nibble_line(j * s + 8 * m));
                        let v = _mm512_loadu_si512(line as *const __m512i);
                        let (mut lo, mut hi) = nibbles(v, table);
                        if H > 0 {
                            lo = with_high::<H>(lo, &mut hs[gi]);
                            hi = with_high::<H>(hi, &mut hs[gi]);
                        }
                        sums.add(lo, la, lb, lc);
                        sums.add(hi, ha, hb, hc);
                    }
                }
            } else {
                for q in 0..s / 4 {
                    let (la, lb, lc) = limb(q);
                    for (gi, sums) in sums.iter_mut().enumerate() {
                        let line = codes.add(gi * gcb + byte_line(j * s + 4 * q));
                        sums.add(_mm512_loadu_si512(line as *const __m512i), la, lb, lc);
                    }
                }
            }
            for (gi, sums) in sums.iter().enumerate() {
                let sc = factor(p, &p.scale_d, &p.scale_m, g0 + gi, j);
                let of = p
                    .scheme
                    .offsets
                    .then(|| factor(p, &p.offs_d, &p.offs_m, g0 + gi, j));
                acc[gi] = sums.finish(acc[gi], sc, inf, of);
            }
        }
        for (gi, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(gi * LANES), lane_mask(p, g0 + gi), *a);
        }
    }
}

/// Groups `groups` times row `t` of `x`, four groups at a time.
///
/// # Safety
/// As [`gemv`] for every group of the range; `x` has `p`'s sub-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(crate) unsafe fn gemv_groups(
    p: &Packed,
    groups: std::ops::Range<usize>,
    x: &Limbs,
    t: usize,
    out: *mut f32,
) {
    // SAFETY: passed through; each call covers groups inside the range.
    unsafe {
        let (xl, info) = (x.row(t), x.infos(t));
        let mut g = groups.start;
        while g < groups.end {
            let o = out.add((g - groups.start) * LANES);
            let left = groups.end - g;
            macro_rules! run {
                ($g:literal) => {
                    match (p.scheme.nibble, p.scheme.high) {
                        (true, 0) => gemv::<$g, true, 0>(p, g, xl, info, o),
                        (true, 1) => gemv::<$g, true, 1>(p, g, xl, info, o),
                        (true, _) => gemv::<$g, true, 2>(p, g, xl, info, o),
                        (false, _) => gemv::<$g, false, 0>(p, g, xl, info, o),
                    }
                };
            }
            match left {
                4.. => run!(4),
                3 => run!(3),
                2 => run!(2),
                _ => run!(1),
            }
            g += left.min(4);
        }
    }
}

/// Operand bytes of a pair of groups, `k · 16` a group: per run of 4
/// elements one 64-byte line, lane `l`'s four bytes at `4l` (the byte
/// codes' own layout; nibbles unpacked, through the table if any).
struct Panel(Vec<Chunk>);

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Chunk([u8; 64]);

/// One register tile: `T` rows of `x` against `G` adjacent groups'
/// operand panels (`ps` bytes apart, their scales and offsets `ss` floats
/// apart) over sub-blocks `j0..j0 + nj`, accumulated into `out` (loaded
/// first unless `first`).
///
/// # Safety
/// AVX-512 F/BW/VNNI; each panel holds the sub-blocks' `nj · s · 16`
/// bytes from `panel`, its `sc` (and `of` when not null) `nj · 16` floats;
/// `x` holds rows `t0..t0 + T` of its limbs; `out` row `t` at `out + t·os`
/// is writable for group `gi`'s lanes from `gi · 16`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const G: usize, const T: usize>(
    (panel, ps): (*const u8, usize),
    (sc, of, ss): (*const f32, *const f32, usize),
    (j0, nj): (usize, usize),
    bias: i32,
    (x, t0): (&Limbs, usize),
    (out, os): (*mut f32, usize),
    first: bool,
) {
    // SAFETY: as the function's contract.
    unsafe {
        let s = x.sub;
        let mut acc = [[_mm512_setzero_ps(); T]; G];
        if !first {
            for (gi, a) in acc.iter_mut().enumerate() {
                for (t, a) in a.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(out.add(t * os + gi * LANES));
                }
            }
        }
        let rows: [*const i8; T] = std::array::from_fn(|t| x.row(t0 + t));
        let infos: [*const SubInfo; T] = std::array::from_fn(|t| x.infos(t0 + t));
        for jj in 0..nj {
            let j = j0 + jj;
            let mut sums: [[Sums; T]; G] = std::array::from_fn(|_| {
                std::array::from_fn(|t| Sums::start(bias, &*infos[t].add(j)))
            });
            for q in 0..s / 4 {
                let u: [__m512i; G] = std::array::from_fn(|gi| {
                    _mm512_load_si512(
                        panel.add(gi * ps + (jj * s + 4 * q) * LANES) as *const __m512i
                    )
                });
                for t in 0..T {
                    let xb = rows[t].add(j * 3 * s + 4 * q);
                    let (a, b, c) = (word(xb), word(xb.add(s)), word(xb.add(2 * s)));
                    for gi in 0..G {
                        sums[gi][t].add(u[gi], a, b, c);
                    }
                }
            }
            for gi in 0..G {
                let scv = _mm512_loadu_ps(sc.add(gi * ss + jj * LANES));
                let ofv = (!of.is_null()).then(|| _mm512_loadu_ps(of.add(gi * ss + jj * LANES)));
                for t in 0..T {
                    acc[gi][t] = sums[gi][t].finish(acc[gi][t], scv, &*infos[t].add(j), ofv);
                }
            }
        }
        for (gi, a) in acc.iter().enumerate() {
            for (t, a) in a.iter().enumerate() {
                _mm512_storeu_ps(out.add(t * os + gi * LANES), *a);
            }
        }
    }
}

/// Groups `groups` (at most two) times rows `rows` of `x`, into `out`
/// (`out_stride` apart, column 0 = the first row of `groups.start`).
///
/// The groups' codes are unpacked to operand bytes once, for all of `k`
/// (a pair's panel stays in L2); then blocks of [`RB`] rows of `x` run over
/// it [`KC`] elements at a time, accumulating in a buffer that stays in L1
/// (storing partial sums to `out` itself, whose lines are not cached, ran
/// at half the speed), and the buffer is copied out once per block.
///
/// # Safety
/// AVX-512 F/BW/VNNI; `x` has `p`'s sub-block and holds those rows; `out`
/// is writable at rows `rows` for the groups' matrix rows and nobody else
/// writes there meanwhile.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(crate) unsafe fn gemm_block(
    p: &Packed,
    groups: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    x: &Limbs,
    out: *mut f32,
    out_stride: usize,
) {
    let ng = groups.len();
    debug_assert!((1..=2).contains(&ng));
    let s = p.scheme.sub;
    let k = p.cols;
    let ss = p.subs * LANES;
    let ps = k * LANES;
    let mut panel = Panel(vec![Chunk([0; 64]); ng * k / 4]);
    let mut scales = Lines::new(ng * p.subs);
    let mut offs = Lines::new(if p.scheme.offsets { ng * p.subs } else { 0 });
    let mut acc = Lines::new(RB * ng);
    // SAFETY: as the function's contract; the panel, scales and offsets
    // are filled for exactly the elements the tiles read, and the tiles
    // write only the accumulator buffer.
    unsafe {
        let table = lut(p);
        let gcb = p.group_code_bytes();
        let pp = panel.0.as_mut_ptr() as *mut u8;
        for (gi, g) in groups.clone().enumerate() {
            let base = p.codes.as_ptr().add(g * gcb);
            let dst = pp.add(gi * ps);
            if p.scheme.nibble {
                let high = p.scheme.high;
                for kk in (0..k).step_by(8) {
                    let v = _mm512_loadu_si512(base.add(nibble_line(kk)) as *const __m512i);
                    let (mut lo, mut hi) = nibbles(v, table);
                    if high > 0 {
                        // This run's place in its plane line: 2 quads a run.
                        let run = kk % (32 / high as usize) / 8;
                        let mut hs = plane(base.add(plane_line(k, high, kk)));
                        hs = _mm512_rorv_epi32(
                            hs,
                            _mm512_set1_epi32((2 * run) as i32 * high as i32),
                        );
                        if high == 1 {
                            lo = with_high::<1>(lo, &mut hs);
                            hi = with_high::<1>(hi, &mut hs);
                        } else {
                            lo = with_high::<2>(lo, &mut hs);
                            hi = with_high::<2>(hi, &mut hs);
                        }
                    }
                    _mm512_store_si512(dst.add(kk * LANES) as *mut __m512i, lo);
                    _mm512_store_si512(dst.add((kk + 4) * LANES) as *mut __m512i, hi);
                }
            } else {
                std::ptr::copy_nonoverlapping(base, dst, ps);
            }
            for j in 0..p.subs {
                let at = gi * ss + j * LANES;
                let v = factor(p, &p.scale_d, &p.scale_m, g, j);
                _mm512_storeu_ps(scales.as_mut_ptr().add(at), v);
                if p.scheme.offsets {
                    let v = factor(p, &p.offs_d, &p.offs_m, g, j);
                    _mm512_storeu_ps(offs.as_mut_ptr().add(at), v);
                }
            }
        }
        let masks: [__mmask16; 2] = std::array::from_fn(|i| {
            if i < ng {
                lane_mask(p, groups.start + i)
            } else {
                0
            }
        });
        let bias = p.scheme.bias;
        for r0 in rows.clone().step_by(RB) {
            let r1 = (r0 + RB).min(rows.end);
            for k0 in (0..k).step_by(KC) {
                let (j0, nj) = (k0 / s, (KC.min(k - k0)) / s);
                for t0 in (r0..r1).step_by(MAX_T) {
                    let nt = (r1 - t0).min(MAX_T);
                    let of = if p.scheme.offsets {
                        offs.as_ptr().add(j0 * LANES)
                    } else {
                        std::ptr::null()
                    };
                    let args = (
                        (pp.add(k0 * LANES) as *const u8, ps),
                        (scales.as_ptr().add(j0 * LANES), of, ss),
                        (j0, nj),
                        bias,
                        (x, t0),
                        (acc.as_mut_ptr().add((t0 - r0) * ng * LANES), ng * LANES),
                        k0 == 0,
                    );
                    macro_rules! run {
                        ($g:literal, $t:literal) => {
                            tile::<$g, $t>(args.0, args.1, args.2, args.3, args.4, args.5, args.6)
                        };
                    }
                    match (ng, nt) {
                        (2, 3..) => run!(2, 3),
                        (2, 2) => run!(2, 2),
                        (2, _) => run!(2, 1),
                        (_, 3..) => run!(1, 3),
                        (_, 2) => run!(1, 2),
                        (_, _) => run!(1, 1),
                    }
                }
            }
            for t in r0..r1 {
                for (gi, &mask) in masks.iter().enumerate().take(ng) {
                    let v = _mm512_loadu_ps(acc.as_ptr().add(((t - r0) * ng + gi) * LANES));
                    _mm512_mask_storeu_ps(out.add(t * out_stride + gi * LANES), mask, v);
                }
            }
        }
    }
}
