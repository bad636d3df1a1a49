//! LoRA adapters as a backend sees them: per adapted projection two small
//! matrices and a scale, and per step which rows run with which adapter.
//!
//! A projection `y = x · Wᵀ` adapted by `(A, B, s)` gives
//! `y + s · (x · Aᵀ) · Bᵀ` (`A` is `[r, in]`, `B` `[out, r]`), PEFT's
//! order: the low-rank product, scaled, then added. A step may mix rows of
//! several adapters and of none ([`LoraBatch`]); [`crate::Ops::lora_add`]
//! adds each group's delta to its own rows only, so a row's result is what
//! it would be in a batch of its adapter alone.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use crate::tensor::Tensor;

/// One adapted projection.
#[derive(Debug)]
pub struct LoraProj {
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    /// `lora_alpha / r` (or `/ √r` with rsLoRA).
    pub scale: f32,
}

/// A loaded adapter: its projections by the module they adapt, named as
/// the base model's Hugging Face weights name them without `.weight`
/// (`model.layers.3.self_attn.q_proj`).
#[derive(Debug)]
pub struct LoraAdapter {
    pub name: String,
    /// Unique to this load: part of every prefix-cache key of its requests,
    /// so a reloaded adapter never hits blocks its predecessor computed.
    pub id: u32,
    pub projs: HashMap<String, LoraProj>,
    /// Bytes its matrices take on the backend.
    pub num_bytes: u64,
}

/// The rows of a step (token rows of the batch) one adapter runs with.
#[derive(Debug, Clone)]
pub struct LoraGroup {
    pub adapter: Arc<LoraAdapter>,
    pub rows: Vec<Range<usize>>,
}

/// Which rows of a step run with which adapter; rows in no group run with
/// the base model.
#[derive(Debug, Clone, Default)]
pub struct LoraBatch {
    pub groups: Vec<LoraGroup>,
}

impl PartialEq for LoraBatch {
    fn eq(&self, other: &Self) -> bool {
        self.groups.len() == other.groups.len()
            && self
                .groups
                .iter()
                .zip(&other.groups)
                .all(|(a, b)| a.adapter.id == b.adapter.id && a.rows == b.rows)
    }
}

impl Eq for LoraBatch {}

impl LoraBatch {
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Rows `rows` run with `adapter`: appended to its group (a run that
    /// continues the group's last one extends it, so rows laid side by side
    /// make one run), or a new group.
    pub fn push(&mut self, adapter: &Arc<LoraAdapter>, rows: Range<usize>) {
        if rows.is_empty() {
            return;
        }
        match self.groups.iter_mut().find(|g| g.adapter.id == adapter.id) {
            Some(g) => match g.rows.last_mut() {
                Some(last) if last.end == rows.start => last.end = rows.end,
                _ => g.rows.push(rows),
            },
            None => self.groups.push(LoraGroup {
                adapter: adapter.clone(),
                rows: vec![rows],
            }),
        }
    }

    /// Whether any adapter of the step adapts `module`.
    pub fn touches(&self, module: &str) -> bool {
        self.groups
            .iter()
            .any(|g| g.adapter.projs.contains_key(module))
    }
}

/// One group's delta for [`crate::Ops::lora_add`]: `proj`'s low-rank
/// product of `x`'s rows `rows`, added to columns `cols` of those rows of
/// `y` (a packed projection's part).
pub struct LoraDelta<'a> {
    pub rows: &'a [Range<usize>],
    pub proj: &'a LoraProj,
    pub cols: Range<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(id: u32) -> Arc<LoraAdapter> {
        Arc::new(LoraAdapter {
            name: format!("a{id}"),
            id,
            projs: HashMap::new(),
            num_bytes: 0,
        })
    }

    #[test]
    fn push_joins_runs_that_continue_and_keeps_the_rest_apart() {
        let (a, b) = (adapter(1), adapter(2));
        let mut batch = LoraBatch::default();
        batch.push(&a, 0..1);
        batch.push(&a, 1..5); // continues a's run
        batch.push(&b, 5..6);
        batch.push(&a, 7..8); // a gap: a second run
        batch.push(&a, 8..9);
        batch.push(&b, 6..6); // no rows: nothing
        assert_eq!(batch.groups.len(), 2);
        assert_eq!(batch.groups[0].adapter.id, 1);
        assert_eq!(batch.groups[0].rows, vec![0..5, 7..9]);
        assert_eq!(batch.groups[1].rows, vec![5..6]);
    }
}
