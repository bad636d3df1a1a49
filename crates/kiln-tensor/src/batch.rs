//! One step as plain data — [`ForwardBatch`] (its sequences, rows, block
//! tables, recurrent state slots and LoRA rows) — and the paged KV cache
//! it runs over ([`KvCache`], shaped by [`KvPoolShape`]). Re-exported by
//! [`crate::backend`].

use std::any::Any;

/// Shape of a paged KV cache to allocate: `num_blocks` blocks of
/// `block_size` token slots of `num_layers` layers each. A model whose layers
/// differ (sliding-window and global) splits them into `num_groups` groups,
/// each with its own block table per sequence over the one pool; a block then
/// holds the layers of one group and `num_layers` is the largest group's.
/// Every layer of a block holds `kv_row` elements of keys and `kv_row` of
/// values a token; a layer whose keys are narrower (a model whose layers
/// differ in head size) uses the front of each row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPoolShape {
    /// Layers a block holds (see the type's docs).
    pub num_layers: usize,
    /// Block tables a sequence has: 1 for a model whose layers are alike.
    pub num_groups: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Elements of keys (and of values) a token has in one layer: the widest
    /// layer's `num_kv_heads * head_dim`.
    pub kv_row: usize,
}

impl KvPoolShape {
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// One sequence's part of a step: its new tokens are rows
/// `token_start..token_start + num_tokens` of the batch, at positions
/// `num_computed..`; its keys and values live in the blocks of its block
/// tables, one per KV group.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SeqSlice {
    pub token_start: usize,
    pub num_tokens: usize,
    /// Tokens already in the cache before this step.
    pub num_computed: usize,
    /// One table per KV group: entry `i` is the block holding the group's
    /// keys and values of tokens `i * block_size..`. Entries a sliding window
    /// no longer reads may name any block of the sequence's table (the
    /// kernels never use those keys).
    pub block_tables: Vec<Vec<u32>>,
}

/// Everything one forward step needs, as plain host data: the new tokens of
/// every sequence, concatenated, where their keys and values go, and which
/// rows want logits.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ForwardBatch {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub seqs: Vec<SeqSlice>,
    /// Per KV group, the cache slot (`block * block_size + offset`) of each
    /// new token.
    pub slot_mapping: Vec<Vec<u32>>,
    pub block_size: usize,
    /// Rows of the batch whose logits the step returns, in order.
    pub logits_rows: Vec<u32>,
    /// Which rows run with which LoRA adapter (none: every row the base
    /// model's). Not sent to other processes: adapters stay in theirs.
    #[serde(skip)]
    pub lora: crate::lora::LoraBatch,
    /// Each sequence's recurrent state in the cache ([`crate::recurrent`];
    /// empty: sequence `i` uses slot `i`, nothing restored or kept).
    pub states: Vec<SeqState>,
}

/// Where a sequence's recurrent state lives for a step, where it starts from,
/// and which snapshots of it the step keeps.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct SeqState {
    /// The sequence's slot.
    pub slot: u32,
    /// A slot whose state the sequence starts from (a prefix-cache hit's
    /// snapshot, taken after its `num_computed` tokens); `None`: zeros when
    /// nothing is computed yet, else the slot's own state.
    pub restore_from: Option<u32>,
    /// `(tokens, slot)`: after the sequence's first `tokens` tokens (within
    /// this step's), copy its state into `slot`.
    pub snapshots: Vec<(usize, u32)>,
}

impl ForwardBatch {
    /// Append a sequence's `tokens`, computed after `num_computed` cached
    /// tokens, with its one block table (a model with one KV group);
    /// `want_logits` asks for its last row.
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        num_computed: usize,
        block_table: Vec<u32>,
        want_logits: bool,
    ) {
        self.push_seq_groups(tokens, num_computed, vec![block_table], want_logits);
    }

    /// [`ForwardBatch::push_seq`] with one block table per KV group (every
    /// sequence of a batch has the same number).
    pub fn push_seq_groups(
        &mut self,
        tokens: &[u32],
        num_computed: usize,
        block_tables: Vec<Vec<u32>>,
        want_logits: bool,
    ) {
        let start = self.token_ids.len();
        let bs = self.block_size;
        if self.slot_mapping.len() < block_tables.len() {
            self.slot_mapping.resize(block_tables.len(), Vec::new());
        }
        for (i, &t) in tokens.iter().enumerate() {
            let pos = num_computed + i;
            self.token_ids.push(t);
            self.positions.push(pos as u32);
            for (slots, table) in self.slot_mapping.iter_mut().zip(&block_tables) {
                slots.push(table[pos / bs] * bs as u32 + (pos % bs) as u32);
            }
        }
        if want_logits && !tokens.is_empty() {
            self.logits_rows.push((start + tokens.len() - 1) as u32);
        }
        self.seqs.push(SeqSlice {
            token_start: start,
            num_tokens: tokens.len(),
            num_computed,
            block_tables,
        });
    }

    /// A batch of one sequence over a cache shaped `pool`, returning logits
    /// for rows `logits_from..`. Entry `i` of group `g`'s table is block
    /// `i * num_groups + g`, so the tables grow with the sequence and the
    /// cache needs `num_groups * ceil(tokens / block_size)` blocks.
    pub fn single(
        tokens: &[u32],
        num_computed: usize,
        pool: &KvPoolShape,
        logits_from: usize,
    ) -> Self {
        let bs = pool.block_size.max(1);
        let groups = pool.num_groups.max(1);
        let total = num_computed + tokens.len();
        let blocks = total.div_ceil(bs) as u32;
        let mut b = ForwardBatch {
            block_size: pool.block_size,
            ..ForwardBatch::default()
        };
        let tables = (0..groups as u32)
            .map(|g| (0..blocks).map(|i| i * groups as u32 + g).collect())
            .collect();
        b.push_seq_groups(tokens, num_computed, tables, false);
        b.logits_rows = (logits_from.min(tokens.len()) as u32..tokens.len() as u32).collect();
        b
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Sequence `i`'s recurrent state (slot `i` when [`ForwardBatch::states`]
    /// is empty).
    pub fn seq_state(&self, i: usize) -> SeqState {
        self.states.get(i).cloned().unwrap_or(SeqState {
            slot: i as u32,
            ..SeqState::default()
        })
    }
}

/// A paged KV cache whose storage belongs to a backend, and the
/// recurrent state of a hybrid model's recurrent layers beside it.
pub struct KvCache {
    pub spec: KvPoolShape,
    id: u64,
    storage: Box<dyn Any + Send>,
    state: Option<(crate::recurrent::StateShape, Box<dyn Any + Send>)>,
}

impl KvCache {
    pub fn from_storage(spec: KvPoolShape, storage: Box<dyn Any + Send>) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        KvCache {
            spec,
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            storage,
            state: None,
        }
    }

    /// This cache with recurrent state of `shape` in `storage` (a
    /// backend's [`Memory::alloc_state`]).
    pub fn with_state(
        mut self,
        shape: crate::recurrent::StateShape,
        storage: Box<dyn Any + Send>,
    ) -> Self {
        self.state = Some((shape, storage));
        self
    }

    /// The recurrent state's shape, if the cache has one.
    pub fn state_shape(&self) -> Option<crate::recurrent::StateShape> {
        self.state.as_ref().map(|s| s.0)
    }

    /// The recurrent state's shape and storage.
    pub fn state_mut(&mut self) -> Option<(crate::recurrent::StateShape, &mut (dyn Any + Send))> {
        self.state.as_mut().map(|(s, b)| (*s, b.as_mut()))
    }

    /// Unique for the life of the process: what a backend's recordings of
    /// steps over this cache are keyed by.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn storage_mut(&mut self) -> &mut (dyn Any + Send) {
        self.storage.as_mut()
    }

    pub fn storage(&self) -> &(dyn Any + Send) {
        self.storage.as_ref()
    }
}
