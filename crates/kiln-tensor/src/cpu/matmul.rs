//! Dense f32 matrix products for the CPU backend: `gemm` for several rows,
//! a multithreaded dot-product GEMV (memory-bound) for one row.

use std::sync::OnceLock;

use rayon::prelude::*;

/// `out[n, m] = x[n, k] · w[m, k]ᵀ`.
pub fn matmul_t(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f32> {
    debug_assert_eq!(x.len(), n * k);
    debug_assert_eq!(w.len(), m * k);
    let mut out = vec![0f32; n * m];
    if n == 0 || m == 0 {
        return out;
    }
    if n == 1 {
        gemv_t(x, w, k, &mut out);
        return out;
    }
    let threads = rayon::current_num_threads();
    let par = if threads > 1 && n * m * k > 64 * 64 * 64 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the strides describe `out` [n, m] row-major, `x` [n, k] row-major and
    // `w`ᵀ (w is [m, k] row-major, so wᵀ[kk, j] = w[j * k + kk]); all three buffers
    // have exactly the sizes asserted above.
    unsafe {
        gemm::gemm(
            n,
            m,
            k,
            out.as_mut_ptr(),
            1,
            m as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    out
}

/// `out[j] = dot(x, w[j])` for each row `j` of `w`, rows split across threads.
fn gemv_t(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
    let dot = dot_fn();
    const ROWS_PER_TASK: usize = 32;
    out.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(chunk_idx, o)| {
            let base = chunk_idx * ROWS_PER_TASK;
            for (r, slot) in o.iter_mut().enumerate() {
                let row = &w[(base + r) * k..(base + r + 1) * k];
                *slot = dot(x, row);
            }
        });
}

type DotFn = fn(&[f32], &[f32]) -> f32;

/// The fastest dot product this CPU supports, chosen once at run time.
pub fn dot_fn() -> DotFn {
    static DOT: OnceLock<DotFn> = OnceLock::new();
    *DOT.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return dot_avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return dot_avx2;
            }
        }
        dot_portable
    })
}

#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 32;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; L];
    let ca = a.chunks_exact(L);
    let cb = b.chunks_exact(L);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for i in 0..L {
            acc[i] = xa[i].mul_add(xb[i], acc[i]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail = x.mul_add(*y, tail);
    }
    // Pairwise reduction keeps the rounding error small.
    let mut width = L;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0] + tail
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

#[cfg(target_arch = "x86_64")]
fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn inner(a: &[f32], b: &[f32]) -> f32 {
        dot_lanes(a, b)
    }
    // SAFETY: only selected by dot_fn() after detecting avx512f.
    unsafe { inner(a, b) }
}

#[cfg(target_arch = "x86_64")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    #[target_feature(enable = "avx2,fma")]
    unsafe fn inner(a: &[f32], b: &[f32]) -> f32 {
        dot_lanes(a, b)
    }
    // SAFETY: only selected by dot_fn() after detecting avx2 and fma.
    unsafe { inner(a, b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f64> {
        let mut out = vec![0f64; n * m];
        for i in 0..n {
            for j in 0..m {
                out[i * m + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
            }
        }
        out
    }

    fn pseudo(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matmul_matches_naive_for_gemv_and_gemm_shapes() {
        for &(n, k, m) in &[
            (1, 67, 45),
            (1, 576, 1536),
            (3, 33, 17),
            (17, 128, 96),
            (64, 64, 64),
        ] {
            let x = pseudo(n * k, 1);
            let w = pseudo(m * k, 2);
            let got = matmul_t(&x, n, k, &w, m);
            let want = naive(&x, n, k, &w, m);
            for (g, e) in got.iter().zip(&want) {
                assert!(
                    (*g as f64 - e).abs() < 1e-3 * (1.0 + e.abs()),
                    "{n}x{k}x{m}: {g} vs {e}"
                );
            }
        }
    }

    #[test]
    fn dot_variants_agree() {
        let a = pseudo(1000, 3);
        let b = pseudo(1000, 4);
        let p = dot_portable(&a, &b);
        let f = dot_fn()(&a, &b);
        assert!((p - f).abs() < 1e-3, "{p} vs {f}");
    }
}
