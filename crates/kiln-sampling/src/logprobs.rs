//! Log-probabilities of processed logits: the normalizer and the top alternatives.
//!
//! Both work on logits that have already been cleaned by the sampler (no NaN, no
//! `+inf`), so every comparison below is a total order.

use crate::TokenId;

/// `log Σ exp(l_i)` over all `logits`, computed as `max + ln Σ exp(l_i - max)` with the
/// exponentials in `f32` and the sum in `f64`. `-inf` logits contribute nothing.
pub(crate) fn log_normalizer(logits: &[f32], max: f32) -> f64 {
    // Masked (`-inf`) logits add nothing: skipping them makes a row that
    // an output format narrowed to a few tokens cheap.
    let sum: f64 = logits
        .iter()
        .filter(|&&l| l > f32::NEG_INFINITY)
        .map(|&l| f64::from((l - max).exp()))
        .sum();
    f64::from(max) + sum.ln()
}

/// The `k` highest logits as `(token, logprob)`, best first; equal logits are ordered
/// by lower token id first. Tokens whose logit is `-inf` (banned or masked) are left
/// out, so fewer than `k` entries come back when fewer than `k` tokens are possible.
///
/// Runs in one pass with a `k`-entry insertion list, so it never sorts the vocabulary.
pub(crate) fn top_logprobs(logits: &[f32], k: usize, log_z: f64) -> Vec<(TokenId, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return Vec::new();
    }
    for (id, &logit) in (0u32..).zip(logits) {
        if logit == f32::NEG_INFINITY {
            continue;
        }
        let beats_last = top.last().is_none_or(|&(_, last)| logit > last);
        if top.len() < k || beats_last {
            // Scanning in id order, an equal logit goes after those already present,
            // which keeps ties ordered by lower id first.
            let pos = top.partition_point(|&(_, l)| l >= logit);
            top.insert(pos, (id, logit));
            top.truncate(k);
        }
    }
    top.into_iter()
        .map(|(id, logit)| (TokenId(id), (f64::from(logit) - log_z) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizer_matches_f64_reference() {
        let logits = [1.0f32, 2.0, -3.0, f32::NEG_INFINITY, 0.5];
        let expected = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        assert!((log_normalizer(&logits, 2.0) - expected).abs() < 1e-6);
    }

    #[test]
    fn top_orders_by_logit_then_id_and_skips_banned() {
        let logits = [0.5f32, 2.0, f32::NEG_INFINITY, 2.0, 1.0, 0.5];
        let ids = |k| -> Vec<u32> {
            top_logprobs(&logits, k, 0.0)
                .iter()
                .map(|(t, _)| t.0)
                .collect()
        };
        assert_eq!(ids(0), Vec::<u32>::new());
        assert_eq!(ids(1), [1]);
        assert_eq!(ids(3), [1, 3, 4]);
        assert_eq!(ids(4), [1, 3, 4, 0]);
        assert_eq!(ids(20), [1, 3, 4, 0, 5]);
        let top = top_logprobs(&logits, 1, 3.0);
        assert_eq!(top, [(TokenId(1), -1.0)]);
    }
}
