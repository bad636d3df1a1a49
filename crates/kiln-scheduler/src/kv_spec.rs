//! What a model's KV cache looks like: the block size and groups of layers that
//! attend alike, and the block arithmetic of each kind.
//!
//! Models whose layers differ (Gemma's alternating sliding-window and global layers,
//! hybrids with recurrent layers) are described as several [`LayerGroup`]s. Today every
//! group shares one block table per request, which is exact for full attention and
//! correct but not minimal for sliding windows (blocks that left the window are kept
//! until the request ends). The per-kind arithmetic below is what a manager with one
//! block table per group will use to free them; recurrent layers are refused when a
//! [`crate::KvManager`] is built.

use crate::error::ConfigError;

/// The default number of tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// How the layers of a group keep their past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention over every earlier token: a block per `block_size` tokens.
    FullAttention,
    /// Attention over the last `window` tokens including the query itself (a query at
    /// position `p` reads keys `p + 1 - window ..= p`, as Mistral and Gemma define it).
    /// Blocks wholly before every future query's window can be freed.
    SlidingWindow {
        /// Keys each query reads, itself included (at least 1).
        window: usize,
    },
    /// A fixed-size recurrent state per request instead of KV (Mamba, RWKV and the
    /// linear-attention layers of hybrids). Not supported yet: building a
    /// [`crate::KvManager`] for it fails with [`ConfigError::UnsupportedLayerKind`].
    Recurrent,
}

impl LayerKind {
    /// The kind in words, for messages.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::FullAttention => "full attention",
            LayerKind::SlidingWindow { .. } => "sliding-window attention",
            LayerKind::Recurrent => "recurrent state",
        }
    }

    /// The index of the first block that a query at position `num_computed_tokens`
    /// or later can read; blocks before it may be freed.
    pub fn first_needed_block_idx(self, block_size: usize, num_computed_tokens: usize) -> usize {
        match self {
            LayerKind::FullAttention => 0,
            LayerKind::SlidingWindow { window } => {
                (num_computed_tokens + 1).saturating_sub(window) / block_size
            }
            LayerKind::Recurrent => num_computed_tokens.div_ceil(block_size),
        }
    }

    /// Blocks this kind must hold to compute `num_new_tokens` tokens after the first
    /// `num_computed_tokens`: those holding any key one of the new queries reads.
    pub fn num_needed_blocks(
        self,
        block_size: usize,
        num_computed_tokens: usize,
        num_new_tokens: usize,
    ) -> usize {
        if matches!(self, LayerKind::Recurrent) {
            return 0;
        }
        let end = (num_computed_tokens + num_new_tokens).div_ceil(block_size);
        end.saturating_sub(self.first_needed_block_idx(block_size, num_computed_tokens))
    }

    /// The most blocks this kind holds at once for a sequence of up to
    /// `max_num_tokens` tokens computed in chunks of at most `max_chunk_tokens`.
    pub fn max_needed_blocks(
        self,
        block_size: usize,
        max_num_tokens: usize,
        max_chunk_tokens: usize,
    ) -> usize {
        let full = max_num_tokens.div_ceil(block_size);
        match self {
            LayerKind::FullAttention => full,
            LayerKind::SlidingWindow { window } => {
                // The keys of one chunk's queries are `window + chunk - 1` consecutive
                // tokens, and `n` consecutive tokens touch at most
                // `ceil((n - 1) / block_size) + 1` blocks.
                let span = window + max_chunk_tokens.max(1) - 1;
                full.min((span - 1).div_ceil(block_size) + 1)
            }
            LayerKind::Recurrent => 0,
        }
    }
}

/// Layers that share a [`LayerKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerGroup {
    /// How these layers keep their past.
    pub kind: LayerKind,
    /// How many layers the group has.
    pub num_layers: usize,
}

/// The KV cache layout of a model: the block size and its layer groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheSpec {
    /// Tokens per block (see [`DEFAULT_BLOCK_SIZE`]).
    pub block_size: usize,
    /// The layer groups; a uniform model has one.
    pub groups: Vec<LayerGroup>,
}

impl KvCacheSpec {
    /// A model whose `num_layers` layers all use full attention, with
    /// [`DEFAULT_BLOCK_SIZE`]-token blocks.
    pub fn uniform(num_layers: usize) -> Self {
        KvCacheSpec {
            block_size: DEFAULT_BLOCK_SIZE,
            groups: vec![LayerGroup {
                kind: LayerKind::FullAttention,
                num_layers,
            }],
        }
    }

    /// Checks that the spec can be served: a positive block size, at least one group,
    /// positive layer counts and windows, and no recurrent groups.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::MustBePositive { name: "block_size" });
        }
        if self.groups.is_empty() {
            return Err(ConfigError::NoLayerGroups);
        }
        for (group_idx, group) in self.groups.iter().enumerate() {
            if group.num_layers == 0 {
                return Err(ConfigError::MustBePositive { name: "num_layers" });
            }
            match group.kind {
                LayerKind::FullAttention => {}
                LayerKind::SlidingWindow { window: 0 } => {
                    return Err(ConfigError::MustBePositive { name: "window" });
                }
                LayerKind::SlidingWindow { .. } => {}
                LayerKind::Recurrent => {
                    return Err(ConfigError::UnsupportedLayerKind {
                        group_idx,
                        kind: group.kind.name(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Blocks in a block table covering `num_tokens` tokens (every group shares it).
    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: LayerKind = LayerKind::FullAttention;
    const fn sw(window: usize) -> LayerKind {
        LayerKind::SlidingWindow { window }
    }

    #[test]
    fn needed_blocks_table() {
        // (kind, block_size, num_computed, num_new, first needed block, needed blocks)
        let cases = [
            (FULL, 16, 0, 1, 0, 1),
            (FULL, 16, 16, 1, 0, 2),
            (FULL, 16, 100, 28, 0, 8),
            (sw(16), 16, 15, 1, 0, 1),
            (sw(16), 16, 16, 1, 0, 2),
            (sw(16), 16, 31, 1, 1, 1),
            (sw(16), 16, 32, 1, 1, 2),
            (sw(4), 4, 100, 1, 24, 2),
            (sw(4), 4, 103, 1, 25, 1),
            (sw(4), 4, 100, 10, 24, 4),
            (sw(1), 16, 40, 1, 2, 1),
            (sw(4096), 16, 100, 1, 0, 7),
            (LayerKind::Recurrent, 16, 100, 5, 7, 0),
        ];
        for (kind, bs, computed, new, first, needed) in cases {
            let case = format!("{kind:?} bs={bs} computed={computed} new={new}");
            assert_eq!(kind.first_needed_block_idx(bs, computed), first, "{case}");
            assert_eq!(kind.num_needed_blocks(bs, computed, new), needed, "{case}");
        }
    }

    /// Counts the blocks that hold a key some query in the chunk reads, one token at
    /// a time, to check the closed forms against.
    fn brute_force_needed(window: usize, bs: usize, computed: usize, new: usize) -> usize {
        let first_key = (computed + 1).saturating_sub(window);
        let last_key = computed + new - 1;
        (first_key / bs..=last_key / bs).count()
    }

    #[test]
    fn sliding_window_matches_brute_force_and_peak_is_tight() {
        for bs in [1, 2, 3, 4, 16] {
            for window in [1, 2, 5, 16, 17, 40] {
                for chunk in [1, 2, 7, 32] {
                    let max_tokens = 90;
                    let kind = sw(window);
                    let mut peak = 0;
                    for computed in 0..=max_tokens - chunk {
                        let needed = kind.num_needed_blocks(bs, computed, chunk);
                        assert_eq!(
                            needed,
                            brute_force_needed(window, bs, computed, chunk),
                            "bs={bs} window={window} chunk={chunk} computed={computed}"
                        );
                        peak = peak.max(needed);
                    }
                    let bound = kind.max_needed_blocks(bs, max_tokens, chunk);
                    assert_eq!(peak, bound, "bs={bs} window={window} chunk={chunk}");
                }
            }
        }
    }

    #[test]
    fn validation_refuses_recurrent_groups_and_zeros() {
        let mut spec = KvCacheSpec::uniform(4);
        assert_eq!(spec.validate(), Ok(()));
        spec.groups.push(LayerGroup {
            kind: sw(0),
            num_layers: 2,
        });
        assert_eq!(
            spec.validate(),
            Err(ConfigError::MustBePositive { name: "window" })
        );
        spec.groups[1].kind = LayerKind::Recurrent;
        let err = spec.validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "layer group 1 is recurrent state, which the KV manager does not support yet"
        );
        spec.groups.clear();
        assert_eq!(spec.validate(), Err(ConfigError::NoLayerGroups));
    }
}
