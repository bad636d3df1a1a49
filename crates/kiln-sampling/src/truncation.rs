//! Truncation of the candidate set: top_k, top_p (nucleus) and min_p.
//!
//! The exact rules are stated in the [`crate::sampler`] documentation, steps 6.1, 6.3
//! and 6.4. Each function keeps the top candidate, so the set never becomes empty.

use std::cmp::Ordering;

/// A candidate token: its id and, depending on the stage, its processed logit or its
/// unnormalized probability weight. Values are never NaN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    pub(crate) id: u32,
    pub(crate) value: f32,
}

/// Highest value first, ties by lower id.
fn by_value_desc(a: &Candidate, b: &Candidate) -> Ordering {
    b.value
        .partial_cmp(&a.value)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// Keeps exactly the `top_k` highest values, ties at the boundary to lower ids, in
/// linear time (no sort). Does nothing when `top_k` is 0 or covers every candidate.
pub(crate) fn apply_top_k(candidates: &mut Vec<Candidate>, top_k: usize) {
    if top_k > 0 && top_k < candidates.len() {
        candidates.select_nth_unstable_by(top_k - 1, by_value_desc);
        candidates.truncate(top_k);
    }
}

/// Keeps candidates whose weight is at least `min_p` times the largest weight.
pub(crate) fn apply_min_p(candidates: &mut Vec<Candidate>, min_p: f32) {
    let max_weight = candidates.iter().fold(0.0f32, |m, c| m.max(c.value));
    let threshold = min_p * max_weight;
    candidates.retain(|c| c.value >= threshold);
}

/// Keeps the nucleus of `candidates` (weights, not logits), sorted by weight.
///
/// Sorting all of a 150k vocabulary is the expensive part, so the heaviest tokens are
/// first gathered at the front with a falling cutoff until they hold at least `top_p`
/// of the mass. Every token at the front outweighs every token behind it, so the
/// nucleus lies inside the front, and only the front is sorted. If rounding leaves the
/// front short of the target, everything is sorted.
pub(crate) fn apply_top_p(candidates: &mut Vec<Candidate>, top_p: f32) {
    let total: f64 = candidates.iter().map(|c| f64::from(c.value)).sum();
    let target = f64::from(top_p) * total;
    let max_weight = candidates.iter().fold(0.0f32, |m, c| m.max(c.value));
    let mut num_front = 0;
    let mut front_mass = 0.0f64;
    for cutoff_exp in [-8, -16, -32] {
        let cutoff = max_weight * 2f32.powi(cutoff_exp);
        let num_moved = move_to_front(&mut candidates[num_front..], |c| c.value >= cutoff);
        let moved = &candidates[num_front..num_front + num_moved];
        front_mass += moved.iter().map(|c| f64::from(c.value)).sum::<f64>();
        num_front += num_moved;
        if front_mass >= target {
            break;
        }
    }
    let num_kept = if front_mass >= target {
        keep_nucleus(&mut candidates[..num_front], target)
    } else {
        None
    };
    // The whole set falls short of the target only through rounding: keep it all.
    let num_kept = num_kept
        .or_else(|| keep_nucleus(candidates, target))
        .unwrap_or(candidates.len());
    candidates.truncate(num_kept);
}

/// Moves the items satisfying `pred` to the front, in linear time and without
/// keeping order, and returns how many there are.
fn move_to_front(items: &mut [Candidate], pred: impl Fn(&Candidate) -> bool) -> usize {
    let mut num_front = 0;
    for i in 0..items.len() {
        if pred(&items[i]) {
            items.swap(num_front, i);
            num_front += 1;
        }
    }
    num_front
}

/// Sorts `front` by weight and returns how many of its tokens form the nucleus (a
/// token stays iff the weight before it is below `target`), or `None` if all of
/// `front` is kept and still falls short of `target`.
fn keep_nucleus(front: &mut [Candidate], target: f64) -> Option<usize> {
    front.sort_unstable_by(by_value_desc);
    let mut mass_before = 0.0f64;
    for (idx, c) in front.iter().enumerate() {
        if mass_before >= target {
            return Some(idx);
        }
        mass_before += f64::from(c.value);
    }
    (mass_before >= target).then_some(front.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn candidates(values: &[f32]) -> Vec<Candidate> {
        (0u32..)
            .zip(values)
            .map(|(id, &value)| Candidate { id, value })
            .collect()
    }

    fn sorted_ids(v: &[Candidate]) -> Vec<u32> {
        let mut ids: Vec<u32> = v.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn top_k_keeps_exactly_k_with_ties_to_lower_ids() {
        let mut c = candidates(&[1.0, 3.0, 2.0, 3.0, 2.0, 2.0]);
        apply_top_k(&mut c, 3);
        assert_eq!(sorted_ids(&c), [1, 2, 3]);
        let mut c = candidates(&[1.0, 3.0]);
        apply_top_k(&mut c, 5);
        assert_eq!(sorted_ids(&c), [0, 1]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // Probabilities 1/2, 1/4, 1/8, 1/8: exact in binary, so reaching `top_p`
        // exactly is tested without rounding.
        let values = [2.0, 4.0, 1.0, 1.0];
        let cases = [
            (0.3, vec![1]),
            (0.5, vec![1]),
            (0.75, vec![0, 1]),
            (0.76, vec![0, 1, 2]),
        ];
        for (top_p, expected) in cases {
            let mut c = candidates(&values);
            apply_top_p(&mut c, top_p);
            assert_eq!(sorted_ids(&c), expected, "top_p {top_p}");
        }
        let mut c = candidates(&values);
        apply_top_p(&mut c, 0.95);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), [1, 0, 2, 3]);
    }

    #[test]
    fn min_p_is_inclusive_and_relative_to_the_max() {
        let mut c = candidates(&[1.0, 0.5, 0.25, 0.0]);
        apply_min_p(&mut c, 0.5);
        assert_eq!(sorted_ids(&c), [0, 1]);
    }

    #[test]
    fn top_p_fast_path_matches_a_full_sort() {
        let mut rng = Rng::from_seed(77);
        let cases = [0.1f32, 0.5, 0.9, 0.99, 0.999_9, 1.0 - 1e-7];
        for (case_idx, top_p) in cases.into_iter().enumerate() {
            // Weights spanning about 2^-40..1, so every cutoff pass and the fallback run.
            let spread = 40.0 * (1.0 + case_idx as f64 / 10.0);
            let weights: Vec<Candidate> = (0..5000u32)
                .map(|id| {
                    let value = if id == 17 {
                        1.0
                    } else {
                        2f64.powf(-spread * rng.next_f64()) as f32
                    };
                    Candidate { id, value }
                })
                .collect();
            let mut fast = weights.clone();
            apply_top_p(&mut fast, top_p);
            let mut full = weights;
            let total: f64 = full.iter().map(|c| f64::from(c.value)).sum();
            let num_kept = keep_nucleus(&mut full, f64::from(top_p) * total);
            full.truncate(num_kept.unwrap_or(full.len()));
            assert_eq!(fast, full, "top_p {top_p}");
        }
    }
}
