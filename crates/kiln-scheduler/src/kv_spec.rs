//! What a model's KV cache looks like: the block size and groups of layers that
//! attend alike, and the block arithmetic of each kind.
//!
//! Models whose layers differ (Gemma's alternating sliding-window and global layers,
//! hybrids with recurrent layers) are described as several [`LayerGroup`]s, each with
//! its own block table per request over one shared pool. A block holds the keys and
//! values of one group's layers for `block_size` tokens, so groups have equal sizes:
//! [`KvCacheSpec::for_layers`] splits each kind's layers into groups of the smallest
//! kind's count (Gemma 3's 15 sliding and 3 global layers become five sliding groups
//! and one global group of three layers; a uniform model is one group). A sliding
//! group frees the blocks that left its window as the request advances, so a long
//! request holds its window's blocks in those layers, not its whole length.
//! Recurrent layers are refused when a [`crate::KvManager`] is built.

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

/// The KV cache layout of a model: the block size and its layer groups, one block
/// table per group and request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheSpec {
    /// Tokens per block (see [`DEFAULT_BLOCK_SIZE`]).
    pub block_size: usize,
    /// The layer groups; a uniform model has one.
    pub groups: Vec<LayerGroup>,
}

/// Where one layer's keys and values live: the block table of its group, and its
/// layer within a block (each block holds [`KvCacheSpec::layers_per_block`] layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSlot {
    /// The layer's group in [`KvCacheSpec::groups`].
    pub group: usize,
    /// The layer's place among its group's layers.
    pub slot: usize,
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

    /// The layout of a model whose layer `i` keeps its past as `kinds[i]`: the
    /// layers of each kind (kinds in the order they first appear) split in order
    /// into groups of the smallest kind's count, the last group of a kind possibly
    /// smaller; and each layer's place. One kind gives one group.
    pub fn for_layers(kinds: &[LayerKind], block_size: usize) -> (KvCacheSpec, Vec<LayerSlot>) {
        let mut distinct: Vec<(LayerKind, usize)> = Vec::new();
        for &kind in kinds {
            match distinct.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, n)) => *n += 1,
                None => distinct.push((kind, 1)),
            }
        }
        let per_group = distinct.iter().map(|&(_, n)| n).min().unwrap_or(1);
        let mut groups: Vec<LayerGroup> = Vec::new();
        // The group each kind's layers are filling.
        let mut filling: Vec<Option<usize>> = vec![None; distinct.len()];
        let mut slots = Vec::with_capacity(kinds.len());
        for &kind in kinds {
            let k = distinct
                .iter()
                .position(|(d, _)| *d == kind)
                .expect("every kind was counted");
            let group = match filling[k] {
                Some(g) if groups[g].num_layers < per_group => g,
                _ => {
                    groups.push(LayerGroup {
                        kind,
                        num_layers: 0,
                    });
                    filling[k] = Some(groups.len() - 1);
                    groups.len() - 1
                }
            };
            slots.push(LayerSlot {
                group,
                slot: groups[group].num_layers,
            });
            groups[group].num_layers += 1;
        }
        (KvCacheSpec { block_size, groups }, slots)
    }

    /// Layers each block holds: the largest group's.
    pub fn layers_per_block(&self) -> usize {
        self.groups.iter().map(|g| g.num_layers).max().unwrap_or(0)
    }

    /// The most blocks one request of up to `max_num_tokens` tokens, computed in
    /// chunks of at most `max_chunk_tokens`, holds at once over all groups.
    pub fn max_blocks_for(&self, max_num_tokens: usize, max_chunk_tokens: usize) -> usize {
        self.groups
            .iter()
            .map(|g| {
                g.kind
                    .max_needed_blocks(self.block_size, max_num_tokens, max_chunk_tokens)
            })
            .sum()
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

    /// Entries of a block table covering `num_tokens` tokens.
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
    fn layers_split_into_groups_of_the_smallest_kinds_count() {
        // Gemma 3 270M: every 6th of 18 layers global.
        let kinds: Vec<LayerKind> = (0..18)
            .map(|i| if i % 6 == 5 { FULL } else { sw(512) })
            .collect();
        let (spec, slots) = KvCacheSpec::for_layers(&kinds, 16);
        assert_eq!(spec.block_size, 16);
        let group_kinds: Vec<LayerKind> = spec.groups.iter().map(|g| g.kind).collect();
        assert_eq!(
            group_kinds,
            [sw(512), sw(512), FULL, sw(512), sw(512), sw(512)]
        );
        assert!(spec.groups.iter().all(|g| g.num_layers == 3));
        assert_eq!(spec.layers_per_block(), 3);
        // Layers 0-4 fill groups 0 and 1; layer 5 starts the global group.
        let at = |i: usize| (slots[i].group, slots[i].slot);
        assert_eq!(
            [at(0), at(2), at(3), at(4), at(5)],
            [(0, 0), (0, 2), (1, 0), (1, 1), (2, 0)]
        );
        assert_eq!([at(11), at(17), at(16)], [(2, 1), (2, 2), (5, 2)]);
        // Every (group, slot) is one layer's.
        let mut seen: Vec<(usize, usize)> = (0..18).map(at).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 18);
        // 22 sliding and 4 global layers (Gemma 3 1B): groups of 4, the last sliding
        // group of 2.
        let kinds: Vec<LayerKind> = (0..26)
            .map(|i| if i % 6 == 5 { FULL } else { sw(512) })
            .collect();
        let (spec, _) = KvCacheSpec::for_layers(&kinds, 16);
        let sizes: Vec<usize> = spec.groups.iter().map(|g| g.num_layers).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 26);
        assert_eq!(spec.layers_per_block(), 4);
        assert_eq!(spec.groups.iter().filter(|g| g.kind == FULL).count(), 1);
        assert_eq!(sizes.iter().filter(|&&n| n < 4).count(), 1);
        // A uniform model is one group of every layer.
        let (spec, slots) = KvCacheSpec::for_layers(&[FULL; 5], 16);
        assert_eq!(
            spec,
            KvCacheSpec {
                block_size: 16,
                ..KvCacheSpec::uniform(5)
            }
        );
        assert_eq!(slots[4], LayerSlot { group: 0, slot: 4 });
    }

    #[test]
    fn a_long_context_needs_the_window_in_sliding_groups() {
        let kinds: Vec<LayerKind> = (0..18)
            .map(|i| if i % 6 == 5 { FULL } else { sw(512) })
            .collect();
        let (spec, _) = KvCacheSpec::for_layers(&kinds, 16);
        // 32k tokens decoded one at a time: the global group 2048 blocks, each
        // sliding group 33 (512 keys span at most 33 blocks of 16).
        assert_eq!(spec.max_blocks_for(32768, 1), 2048 + 5 * 33);
        // Chunks of 512 tokens: a chunk's queries read 1023 keys.
        assert_eq!(spec.max_blocks_for(32768, 512), 2048 + 5 * 65);
        // Short requests hold every block in every group.
        assert_eq!(spec.max_blocks_for(100, 512), 6 * 7);
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
