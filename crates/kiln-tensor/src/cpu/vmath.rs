//! Vector math shared by the CPU kernels: `exp` on 16 lanes and the gated
//! activations built on it.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// `exp` of 16 lanes: `2^n · p(f)` with `x = n ln 2 + f`, `|f| ≤ ln2/2`,
    /// `p` the degree-6 Taylor polynomial (relative error ≈ 1e-7). Below
    /// −103 the result is 0; past 89 it is +∞.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn exp16(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-103.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
        let f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), f);
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// `x / (1 + exp(−x))`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn silu16(x: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        _mm512_div_ps(
            x,
            _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))),
        )
    }

    /// `0.5·x·(1 + tanh(y))`, `y = √(2/π)·(x + 0.044715·x³)`, as
    /// `x / (1 + exp(−2y))` (the same function; no cancellation where
    /// `tanh(y)` nears −1).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn gelu_tanh16(x: __m512) -> __m512 {
        let x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        let minus_2y = _mm512_mul_ps(
            _mm512_set1_ps(-2.0 * 0.797_884_6),
            _mm512_fmadd_ps(_mm512_set1_ps(0.044715), x3, x),
        );
        let one = _mm512_set1_ps(1.0);
        _mm512_div_ps(x, _mm512_add_ps(one, exp16(minus_2y)))
    }
}
