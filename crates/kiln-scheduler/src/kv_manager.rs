//! Per-request block tables over the block pool: admission with a prefix lookup,
//! allocation as a request grows, registration of blocks as they fill, and freeing.
//!
//! A request's block table is append-only while it holds blocks: entry `i` holds
//! tokens `i * block_size .. (i + 1) * block_size`. Blocks found in the prefix cache
//! at admission come first and are shared (reference counted); every later block is
//! the request's own. A block is registered in the prefix cache once all its tokens
//! are computed, whether they came from the prompt or were generated, so a request
//! that continues a finished conversation hits the generated part too.

use std::collections::BTreeMap;

use kiln_sampling::TokenId;

use crate::block_pool::{BlockId, BlockPool, ChainLink, Lookup};
use crate::error::{ConfigError, OutOfBlocks};
use crate::hash::BlockHash;
use crate::kv_spec::KvCacheSpec;
use crate::request::RequestId;

/// How a block's hash is computed from its parent's hash and its token ids. Tests
/// swap in a weak function to force collisions.
pub(crate) type ChainHash = fn(BlockHash, &[TokenId]) -> BlockHash;

/// Counters of the prefix cache since the manager was created. Lookups happen at
/// each admission, including re-admissions after preemption.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Admissions that looked up their prefix.
    pub num_lookups: u64,
    /// Known tokens of the admitted requests (the most a lookup could hit).
    pub num_queried_tokens: u64,
    /// Cached blocks taken by admissions.
    pub num_hit_blocks: u64,
    /// Tokens in those blocks.
    pub num_hit_tokens: u64,
    /// Lookups that found a block under the right hash with different content.
    pub num_collisions: u64,
}

/// What an admission got: cached tokens and the tokens to compute in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admission {
    pub(crate) num_cached_tokens: usize,
    pub(crate) num_new_tokens: usize,
}

/// The blocks of one request.
#[derive(Debug, Clone)]
struct SeqBlocks {
    root_hash: BlockHash,
    block_table: Vec<BlockId>,
    /// Hashes of the first blocks of the table, those full and computed (hit at
    /// admission or registered since).
    block_hashes: Vec<BlockHash>,
    /// For each of those blocks, the identity its successor names as parent: the
    /// block itself, or the registered block it duplicates.
    links: Vec<ChainLink>,
}

/// The KV bookkeeping of every request that holds blocks: block tables over one
/// [`BlockPool`] and the prefix cache. Changed only through the
/// [`crate::Scheduler`]; callers get a read-only view from
/// [`crate::Scheduler::kv_manager`].
#[derive(Debug, Clone)]
pub struct KvManager {
    spec: KvCacheSpec,
    pool: BlockPool,
    seqs: BTreeMap<RequestId, SeqBlocks>,
    stats: PrefixCacheStats,
    chain_hash: ChainHash,
}

impl KvManager {
    /// A manager over `num_blocks` blocks laid out as `spec` says. Fails if the spec
    /// cannot be served (see [`KvCacheSpec::validate`]) or the pool size is invalid.
    pub(crate) fn new(spec: KvCacheSpec, num_blocks: usize) -> Result<Self, ConfigError> {
        spec.validate()?;
        let pool = BlockPool::new(num_blocks, spec.block_size)?;
        Ok(KvManager {
            spec,
            pool,
            seqs: BTreeMap::new(),
            stats: PrefixCacheStats::default(),
            chain_hash: BlockHash::chain,
        })
    }

    /// Replaces the block hash function (tests force collisions with it).
    #[cfg(test)]
    pub(crate) fn set_chain_hash(&mut self, chain_hash: ChainHash) {
        self.chain_hash = chain_hash;
    }

    /// The KV cache layout.
    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.spec.block_size
    }

    /// The block pool, read-only.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Counters of the prefix cache.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// The block table of a request that holds blocks (running), head first.
    pub fn block_table(&self, id: RequestId) -> Option<&[BlockId]> {
        self.seqs.get(&id).map(|s| s.block_table.as_slice())
    }

    /// Admits a request that holds no blocks, whose known tokens are `token_ids`
    /// (prompt, then any tokens generated before a preemption): looks up the
    /// longest cached prefix of full blocks, never the last token (it is always
    /// recomputed so there are logits), then allocates blocks for up to
    /// `max_new_tokens` more tokens. All or nothing: on `Err` nothing changed and no
    /// counter moved.
    pub(crate) fn admit(
        &mut self,
        id: RequestId,
        token_ids: &[TokenId],
        root_hash: BlockHash,
        max_new_tokens: usize,
    ) -> Result<Admission, OutOfBlocks> {
        debug_assert!(
            !self.seqs.contains_key(&id),
            "request {id} admitted twice; this is a bug"
        );
        let bs = self.spec.block_size;
        let max_hit_blocks = token_ids.len().saturating_sub(1) / bs;
        let mut hits = Vec::new();
        let mut block_hashes = Vec::new();
        let mut links = Vec::new();
        let mut collided = false;
        let (mut parent_hash, mut parent_link) = (root_hash, ChainLink::Root(root_hash));
        for block_tokens in token_ids.chunks_exact(bs).take(max_hit_blocks) {
            let hash = (self.chain_hash)(parent_hash, block_tokens);
            match self.pool.lookup(hash, parent_link, block_tokens) {
                Lookup::Hit(block_id) => {
                    hits.push(block_id);
                    block_hashes.push(hash);
                    parent_hash = hash;
                    parent_link = self.pool.link(block_id);
                    links.push(parent_link);
                }
                Lookup::Collision(_) => {
                    collided = true;
                    break;
                }
                Lookup::Miss => break,
            }
        }
        let num_cached_tokens = hits.len() * bs;
        let num_new_tokens = (token_ids.len() - num_cached_tokens).min(max_new_tokens);
        let num_new_blocks = self
            .spec
            .blocks_for_tokens(num_cached_tokens + num_new_tokens)
            - hits.len();
        let num_free_hits = hits
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        let needed = num_new_blocks + num_free_hits;
        if needed > self.pool.num_free_blocks() {
            return Err(OutOfBlocks {
                needed,
                free: self.pool.num_free_blocks(),
            });
        }
        // Take the hits first so that allocating new blocks cannot evict them.
        for &block_id in &hits {
            self.pool.touch(block_id);
        }
        let new_blocks = self
            .pool
            .allocate(num_new_blocks)
            .expect("free blocks were counted above; this is a bug");
        self.stats.num_lookups += 1;
        self.stats.num_queried_tokens += token_ids.len() as u64;
        self.stats.num_hit_blocks += hits.len() as u64;
        self.stats.num_hit_tokens += num_cached_tokens as u64;
        self.stats.num_collisions += u64::from(collided);
        let mut block_table = hits;
        block_table.extend(new_blocks);
        self.seqs.insert(
            id,
            SeqBlocks {
                root_hash,
                block_table,
                block_hashes,
                links,
            },
        );
        Ok(Admission {
            num_cached_tokens,
            num_new_tokens,
        })
    }

    /// Grows the block table of admitted request `id`, which has
    /// `num_computed_tokens` computed tokens, to hold `num_new_tokens` more. Appends
    /// only; all or nothing.
    pub(crate) fn allocate_for(
        &mut self,
        id: RequestId,
        num_computed_tokens: usize,
        num_new_tokens: usize,
    ) -> Result<(), OutOfBlocks> {
        let seq = self
            .seqs
            .get_mut(&id)
            .expect("allocate_for is called for admitted requests only; this is a bug");
        let target = (num_computed_tokens + num_new_tokens).div_ceil(self.spec.block_size);
        let needed = target.saturating_sub(seq.block_table.len());
        let free = self.pool.num_free_blocks();
        let blocks = self
            .pool
            .allocate(needed)
            .ok_or(OutOfBlocks { needed, free })?;
        seq.block_table.extend(blocks);
        Ok(())
    }

    /// Registers in the prefix cache every block of request `id` that the first
    /// `num_computed_tokens` of `token_ids` fill. A block whose content is already
    /// cached in another block stays private to the request, and its successors
    /// chain on the cached one.
    pub(crate) fn register_full_blocks(
        &mut self,
        id: RequestId,
        token_ids: &[TokenId],
        num_computed_tokens: usize,
    ) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let bs = self.spec.block_size;
        let num_full = (num_computed_tokens.min(token_ids.len()) / bs).min(seq.block_table.len());
        while seq.block_hashes.len() < num_full {
            let idx = seq.block_hashes.len();
            let (parent_hash, parent_link) = match idx.checked_sub(1) {
                Some(prev) => (seq.block_hashes[prev], seq.links[prev]),
                None => (seq.root_hash, ChainLink::Root(seq.root_hash)),
            };
            let block_tokens = &token_ids[idx * bs..(idx + 1) * bs];
            let hash = (self.chain_hash)(parent_hash, block_tokens);
            let link = self
                .pool
                .register(seq.block_table[idx], hash, parent_link, block_tokens);
            seq.block_hashes.push(hash);
            seq.links.push(link);
        }
    }

    /// Releases every block of request `id` (tail first, so the tail is evicted
    /// first). Returns false if it held none.
    pub(crate) fn free(&mut self, id: RequestId) -> bool {
        match self.seqs.remove(&id) {
            Some(seq) => {
                self.pool.free(&seq.block_table);
                true
            }
            None => false,
        }
    }

    /// Checks that reference counts equal the number of block tables naming each
    /// block, that no table names a block twice, and the pool's own invariants.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (id, seq) in &self.seqs {
            let mut seen = std::collections::BTreeSet::new();
            for block_id in &seq.block_table {
                if !seen.insert(*block_id) {
                    return Err(format!("request {id} names block {} twice", block_id.0));
                }
                refs[block_id.index()] += 1;
            }
            if seq.block_hashes.len() > seq.block_table.len() {
                return Err(format!("request {id} has more hashes than blocks"));
            }
        }
        for (idx, &expected) in refs.iter().enumerate() {
            let actual = self.pool.ref_count(BlockId(idx as u32));
            if actual != expected {
                return Err(format!(
                    "block {idx}: ref_count {actual}, {expected} tables name it"
                ));
            }
        }
        Ok(())
    }
}
