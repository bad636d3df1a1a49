//! The inner loops of one (row, head) over a run of keys: scores, the
//! softmax's exponentials, the weighted sum of values — portable, and
//! AVX-512 where the head size is a multiple of 16.

use super::KvElem;

/// The softmax weights of a run of keys for each head of a group: head
/// `h`'s weight of the run's key `t` is `w[h·nk + j + t] · inv[h]`.
#[derive(Clone, Copy)]
pub(crate) struct Weights<'a> {
    pub(super) w: &'a [f32],
    pub(super) nk: usize,
    pub(super) j: usize,
    pub(super) inv: &'a [f32],
}

/// The inner loops of one (row, head), chosen once per CPU, element and
/// head size.
pub(crate) struct Kernels<E> {
    /// `s[t] = (q · k[t]) * scale` for the rows `k[t]` of `k`.
    pub(super) scores: fn(&[f32], &[E], f32, &mut [f32]),
    /// `s[t] = exp(s[t] - max)`, returning their sum.
    pub(super) exp_sum: fn(&mut [f32], f32) -> f32,
    /// For each head `h` of a group (`o` holds them, `head_dim` each):
    /// `o_h += (w_h[t] · inv_h) · v[t]` in ascending `t` (the run's rows
    /// `v[t]`), each head's sums as if it were alone.
    pub(super) weighted_sum: fn(Weights, &[E], &mut [f32]),
}

pub(super) mod portable {
    use super::{Kernels, KvElem, Weights};

    pub fn kernels<E: KvElem>() -> Kernels<E> {
        Kernels {
            scores: scores::<E>,
            exp_sum,
            weighted_sum: weighted_sum::<E>,
        }
    }

    /// By the dense product's dot (f16 keys widened into a row first).
    pub fn scores<E: KvElem>(q: &[f32], k: &[E], scale: f32, s: &mut [f32]) {
        let dot = crate::cpu::matmul::dot_fn();
        if std::any::TypeId::of::<E>() == std::any::TypeId::of::<f32>() {
            // SAFETY: E is f32, so the slice is one of f32s.
            let k = unsafe { std::slice::from_raw_parts(k.as_ptr() as *const f32, k.len()) };
            for (s, kr) in s.iter_mut().zip(k.chunks_exact(q.len())) {
                *s = dot(q, kr) * scale;
            }
            return;
        }
        let mut row = vec![0f32; q.len()];
        for (s, kr) in s.iter_mut().zip(k.chunks_exact(q.len())) {
            for (r, &x) in row.iter_mut().zip(kr) {
                *r = x.to_f32();
            }
            *s = dot(q, &row) * scale;
        }
    }

    pub fn exp_sum(s: &mut [f32], max: f32) -> f32 {
        let mut sum = 0f32;
        for s in s.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        sum
    }

    /// Head by head, element by element, no fused multiply-add.
    pub fn weighted_sum<E: KvElem>(ws: Weights, v: &[E], o: &mut [f32]) {
        let hd = o.len() / ws.inv.len();
        let n = v.len() / hd;
        for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
            let w = &ws.w[h * ws.nk + ws.j..h * ws.nk + ws.j + n];
            for (&w, vr) in w.iter().zip(v.chunks_exact(hd)) {
                let a = w * ws.inv[h];
                for (o, &x) in oh.iter_mut().zip(vr) {
                    *o += a * x.to_f32();
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    use super::{Kernels, KvElem, Weights};
    use crate::cpu::vmath::avx512::exp16;

    pub fn detected() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Only handed out after [`detected`], for head sizes that are
    /// multiples of 16.
    pub const fn kernels<E: KvElem>() -> Kernels<E> {
        Kernels {
            scores: scores::<E>,
            exp_sum,
            weighted_sum: weighted_sum::<E>,
        }
    }

    /// Sixteen keys or values of `p` as f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<E: KvElem>(p: *const E) -> __m512 {
        // SAFETY: the caller's 16 elements are readable.
        unsafe {
            if E::F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
            } else {
                _mm512_loadu_ps(p as *const f32)
            }
        }
    }

    fn scores<E: KvElem>(q: &[f32], k: &[E], scale: f32, s: &mut [f32]) {
        // SAFETY: selected only after detecting avx512f; hd % 16 == 0.
        unsafe { scores_inner(q, k, scale, s) }
    }

    /// Sixteen keys at a time (independent accumulators, rows past the
    /// run clamped to its last and their scores dropped), each dot in 16
    /// lanes over ascending `d`, then the 16 accumulators reduced together
    /// by [`reduce16`] (every key's lanes summed by the same tree).
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_inner<E: KvElem>(q: &[f32], k: &[E], scale: f32, s: &mut [f32]) {
        let hd = q.len();
        let n = s.len();
        assert!(k.len() >= n * hd && hd % 16 == 0);
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        for t0 in (0..n).step_by(16) {
            let m = (n - t0).min(16);
            let rows: [*const E; 16] = std::array::from_fn(|r| {
                // SAFETY: row t0 + min(r, m − 1) < n is inside k.
                unsafe { kp.add((t0 + r.min(m - 1)) * hd) }
            });
            let mut acc = [_mm512_setzero_ps(); 16];
            let mut d = 0;
            while d < hd {
                // SAFETY: d + 16 <= hd, inside q and every row.
                unsafe {
                    let qv = _mm512_loadu_ps(qp.add(d));
                    for (a, row) in acc.iter_mut().zip(rows) {
                        *a = _mm512_fmadd_ps(qv, load16(row.add(d)), *a);
                    }
                }
                d += 16;
            }
            let v = _mm512_mul_ps(reduce16(&acc), _mm512_set1_ps(scale));
            // SAFETY: the mask covers the m scores of this chunk.
            unsafe {
                _mm512_mask_storeu_ps(s.as_mut_ptr().add(t0), ((1u32 << m) - 1) as __mmask16, v)
            };
        }
    }

    /// Lane `i` of the result is the sum of the lanes of `v[i]`, each by
    /// the same tree: `(((0+8)+(4+12))+((2+10)+(6+14)))+(((1+9)+(5+13))+((3+11)+(7+15)))`
    /// (a 16 × 16 transpose folded into the additions: 45 instructions for
    /// 16 dots instead of a reduction each).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce16(v: &[__m512; 16]) -> __m512 {
        let x: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        let y: [__m512; 4] = std::array::from_fn(|i| {
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        });
        let z: [__m512; 2] = std::array::from_fn(|i| {
            let (a, b) = (y[2 * i], y[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        let r = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(z[0], z[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(z[0], z[1]),
        );
        // Lane l holds key (l % 4)·4 + l / 4: a 4 × 4 transpose back.
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(idx, r)
    }

    fn exp_sum(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: selected only after detecting avx512f.
        unsafe { exp_sum_inner(s, max) }
    }

    /// Lane `l` sums the exponentials at `t ≡ l (mod 16)` in ascending `t`
    /// (the tail masked in), then the lanes by the fixed shuffle order.
    #[target_feature(enable = "avx512f")]
    unsafe fn exp_sum_inner(s: &mut [f32], max: f32) -> f32 {
        let m = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        for c in s.chunks_mut(16) {
            let mask: __mmask16 = if c.len() == 16 {
                !0
            } else {
                (1u16 << c.len()) - 1
            };
            // SAFETY: the mask covers only the chunk's elements.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, c.as_ptr());
                let e = exp16(_mm512_sub_ps(x, m));
                let e = _mm512_maskz_mov_ps(mask, e);
                _mm512_mask_storeu_ps(c.as_mut_ptr(), mask, e);
                acc = _mm512_add_ps(acc, e);
            }
        }
        _mm512_reduce_add_ps(acc)
    }

    fn weighted_sum<E: KvElem>(ws: Weights, v: &[E], o: &mut [f32]) {
        // SAFETY: selected only after detecting avx512f; hd % 16 == 0.
        unsafe { weighted_sum_inner(ws, v, o) }
    }

    /// Up to six heads and 64 dims at a time: each run row `v[t]` is
    /// loaded once for them, each head's columns accumulate
    /// `fma(w_h[t] · inv_h, v[t], o_h)` in ascending `t` (its own sums,
    /// as alone).
    #[target_feature(enable = "avx512f")]
    unsafe fn weighted_sum_inner<E: KvElem>(ws: Weights, v: &[E], o: &mut [f32]) {
        let heads = ws.inv.len();
        let hd = o.len() / heads.max(1);
        let n = v.len() / hd.max(1);
        assert!(hd % 16 == 0 && o.len() == heads * hd);
        assert!(heads == 0 || ws.w.len() >= (heads - 1) * ws.nk + ws.j + n);
        let mut h = 0;
        while h < heads {
            let nh = (heads - h).min(6);
            let mut d = 0;
            while d < hd {
                // SAFETY: heads h..h + nh and columns d.. are inside o, the
                // weights inside w.
                d += unsafe {
                    let c = (hd - d) / 16;
                    match nh {
                        6 => columns_dyn::<E, 6>(ws, v, o, h, d, c),
                        5 => columns_dyn::<E, 5>(ws, v, o, h, d, c),
                        4 => columns_dyn::<E, 4>(ws, v, o, h, d, c),
                        3 => columns_dyn::<E, 3>(ws, v, o, h, d, c),
                        2 => columns_dyn::<E, 2>(ws, v, o, h, d, c),
                        _ => columns_dyn::<E, 1>(ws, v, o, h, d, c),
                    }
                };
            }
            h += nh;
        }
    }

    /// [`columns`] for the columns left (four at most).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn columns_dyn<E: KvElem, const H: usize>(
        ws: Weights,
        v: &[E],
        o: &mut [f32],
        h: usize,
        d: usize,
        c: usize,
    ) -> usize {
        // SAFETY: as the caller's.
        unsafe {
            match c {
                4.. => columns::<E, H, 4>(ws, v, o, h, d),
                3 => columns::<E, H, 3>(ws, v, o, h, d),
                2 => columns::<E, H, 2>(ws, v, o, h, d),
                _ => columns::<E, H, 1>(ws, v, o, h, d),
            }
        }
    }

    /// Heads `h..h + H`, columns `d..d + 16·C`; returns `16·C`.
    ///
    /// # Safety
    /// AVX-512F; the heads and columns are inside `o`, their weights
    /// inside `ws.w`, and `v` holds the run's rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn columns<E: KvElem, const H: usize, const C: usize>(
        ws: Weights,
        v: &[E],
        o: &mut [f32],
        h: usize,
        d: usize,
    ) -> usize {
        let heads = ws.inv.len();
        let hd = o.len() / heads;
        let n = v.len() / hd;
        let (vp, op, wp) = (v.as_ptr(), o.as_mut_ptr(), ws.w.as_ptr());
        // SAFETY: as the function's contract.
        unsafe {
            let at = |hh: usize, c: usize| op.add((h + hh) * hd + d + 16 * c);
            let mut acc: [[__m512; C]; H] =
                std::array::from_fn(|hh| std::array::from_fn(|c| _mm512_loadu_ps(at(hh, c))));
            let inv: [f32; H] = std::array::from_fn(|hh| ws.inv[h + hh]);
            let wrow: [*const f32; H] = std::array::from_fn(|hh| wp.add((h + hh) * ws.nk + ws.j));
            for t in 0..n {
                let row = vp.add(t * hd + d);
                let x: [__m512; C] = std::array::from_fn(|c| load16(row.add(16 * c)));
                for hh in 0..H {
                    let a = _mm512_set1_ps(*wrow[hh].add(t) * inv[hh]);
                    for c in 0..C {
                        acc[hh][c] = _mm512_fmadd_ps(a, x[c], acc[hh][c]);
                    }
                }
            }
            for (hh, acc) in acc.iter().enumerate() {
                for (c, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(at(hh, c), *a);
                }
            }
        }
        16 * C
    }
}
