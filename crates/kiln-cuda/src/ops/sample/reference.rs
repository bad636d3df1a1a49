//! The host reference of the device sampler (`sample.cu`), which
//! `check.rs` holds the device to.
//!
//! The reference follows the host sampler's rules as written in
//! kiln-sampling's `sampler` documentation, with sorts instead of the
//! kernel's bisections, and draws in the device order (the first survivor
//! by id whose running weight exceeds `u · Σw`). The CPU tests in
//! `check.rs` hold it to `kiln_sampling::Sampler`.

use kiln_tensor::SampleRow;

/// The reference's answer for one row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reference {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
    /// The survivors of truncation, by id (empty when greedy).
    pub kept: Vec<u32>,
    /// Whether float rounding may pick another token: `u · Σw` within
    /// 1e-4 · Σw of a boundary of the draw, or a top_p or min_p cut within
    /// 1e-5 relative of flipping.
    pub fragile: bool,
}

/// Highest first, ties to the lower id.
fn by_value_desc(values: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    move |&a, &b| {
        let (x, y) = (values[a as usize], values[b as usize]);
        y.partial_cmp(&x)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    }
}

/// The processed logits of `row` under `p`: mask, bias, penalties, cleaning.
pub(crate) fn processed(row: &[f32], p: &SampleRow<'_>) -> Vec<f32> {
    let mut l = row.to_vec();
    if let Some(m) = p.mask {
        for (i, x) in l.iter_mut().enumerate() {
            if m.get(i / 32).is_none_or(|w| (w >> (i % 32)) & 1 == 0) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    for &(t, b) in p.logit_bias {
        if let Some(x) = l.get_mut(t as usize) {
            *x = if b <= -100.0 {
                f32::NEG_INFINITY
            } else {
                *x + b
            };
        }
    }
    let (r, f, pr) = (
        p.repetition_penalty,
        p.frequency_penalty,
        p.presence_penalty,
    );
    for &(t, count, in_prompt) in p.penalties {
        let Some(x) = l.get_mut(t as usize) else {
            continue;
        };
        if r != 1.0 && (in_prompt || count > 0) {
            *x = if *x > 0.0 { *x / r } else { *x * r };
        }
        if (f != 0.0 || pr != 0.0) && count > 0 {
            *x -= f * count as f32;
            *x -= pr;
        }
    }
    for x in &mut l {
        if x.is_nan() {
            *x = f32::NEG_INFINITY;
        } else if *x == f32::INFINITY {
            *x = f32::MAX;
        }
    }
    l
}

/// The reference sample of `row` under `p`; `None` when every processed
/// logit is `-inf`.
pub(crate) fn reference(row: &[f32], p: &SampleRow<'_>) -> Option<Reference> {
    let l = processed(row, p);
    let mut order: Vec<u32> = (0..l.len() as u32)
        .filter(|&i| l[i as usize] > f32::NEG_INFINITY)
        .collect();
    order.sort_by(by_value_desc(&l));
    let &best = order.first()?;
    let max = l[best as usize];
    let sum: f64 = order
        .iter()
        .map(|&i| f64::from((l[i as usize] - max).exp()))
        .sum();
    let log_z = f64::from(max) + sum.ln();
    let lp = |i: u32| (f64::from(l[i as usize]) - log_z) as f32;
    let top = order
        .iter()
        .take(p.top_logprobs.min(super::MAX_TOP) as usize)
        .map(|&i| (i, lp(i)))
        .collect();
    if p.temperature == 0.0 {
        return Some(Reference {
            token: best,
            logprob: lp(best),
            top,
            kept: Vec::new(),
            fragile: false,
        });
    }
    let mut kept = order;
    if p.top_k > 0 {
        kept.truncate(p.top_k as usize);
    }
    let w: Vec<f32> = l
        .iter()
        .map(|&x| ((x - max) / p.temperature).exp())
        .collect();
    let mut fragile = false;
    if p.top_p < 1.0 {
        kept.sort_by(by_value_desc(&w));
        let total: f64 = kept.iter().map(|&i| f64::from(w[i as usize])).sum();
        let target = f64::from(p.top_p) * total;
        let mut mass = 0.0f64;
        let mut num_kept = kept.len();
        for (idx, &i) in kept.iter().enumerate() {
            fragile |= (mass - target).abs() < 1e-5 * total;
            if mass >= target {
                num_kept = idx;
                break;
            }
            mass += f64::from(w[i as usize]);
        }
        kept.truncate(num_kept);
    }
    if p.min_p > 0.0 {
        let max_w = kept.iter().fold(0f32, |m, &i| m.max(w[i as usize]));
        let threshold = p.min_p * max_w;
        fragile |= kept
            .iter()
            .any(|&i| (w[i as usize] - threshold).abs() < 1e-5 * threshold);
        kept.retain(|&i| w[i as usize] >= threshold);
    }
    kept.sort_unstable();
    let total: f64 = kept.iter().map(|&i| f64::from(w[i as usize])).sum();
    let target = p.u * total;
    let mut run = 0.0f64;
    let mut token = None;
    for &i in &kept {
        let wi = f64::from(w[i as usize]);
        run += wi;
        fragile |= (run - target).abs() < 1e-4 * total;
        if token.is_none() && wi > 0.0 && run > target {
            token = Some(i);
        }
    }
    let token = token.or_else(|| kept.iter().rev().copied().find(|&i| w[i as usize] > 0.0))?;
    Some(Reference {
        token,
        logprob: lp(token),
        top,
        kept,
        fragile,
    })
}
