//! The block pool: a fixed number of KV blocks with reference counts, the LRU queue
//! of free blocks, and the content-addressed prefix cache over full blocks.
//!
//! A block is *used* while at least one block table references it and *free*
//! otherwise; every block is exactly one of the two. A full block whose content has
//! been computed can be *registered*: it gets its [`BlockHash`] (set once) and enters
//! the hash map, so later requests with the same prefix can reference it instead of
//! recomputing it. A registered block keeps its hash when it is freed, so a freed
//! prefix stays hittable until the block is reused for something else (evicted).
//!
//! Hits are checked exactly, so a hash collision can only cost a miss, never serve
//! the wrong KV. A registered block records its token ids and the identity of its
//! parent: the parent block and that block's *generation* (bumped each time the
//! block is allocated), or the root hash for a first block. A lookup walks a prefix
//! from its first block and takes a block only if its tokens equal the request's
//! and its parent is the very block incarnation the walk matched one step earlier.
//! By induction a hit's whole prefix equals the request's; only the root (the
//! extra keys) is compared by its 128-bit hash. A block whose parent was evicted
//! can never be hit again (an orphan) and gives up its hash to the next block that
//! registers the same one.

use std::collections::HashMap;

use kiln_sampling::TokenId;

use crate::error::ConfigError;
use crate::free_queue::FreeQueue;
use crate::hash::BlockHash;

/// The index of a KV block in the pool (and in the backend's paged KV tensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The id as an index into per-block arrays.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// Where a block sits in its chain: the identity the collision check compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChainLink {
    /// The first block of a sequence, after the root of these extra keys.
    Root(BlockHash),
    /// A later block, after this incarnation of `block_id`.
    Block {
        /// The block.
        block_id: BlockId,
        /// Its generation when it was the parent.
        generation: u64,
    },
}

/// What a registered block keeps so a hit can be checked exactly.
#[derive(Debug, Clone)]
struct CachedContent {
    hash: BlockHash,
    parent: ChainLink,
    token_ids: Box<[TokenId]>,
}

#[derive(Debug, Clone, Default)]
struct Block {
    ref_count: u32,
    /// Bumped at every allocation, so a [`ChainLink`] names one incarnation.
    generation: u64,
    cached: Option<CachedContent>,
}

/// The outcome of looking up one block of a prefix in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// A registered block with this hash holds exactly this parent and these tokens.
    Hit(BlockId),
    /// No block is registered under this hash, or only an orphan.
    Miss,
    /// A block that can still be hit is registered under this hash, but its parent
    /// or tokens differ: a hash collision, treated as a miss.
    Collision(BlockId),
}

/// Counters of the block pool since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockPoolStats {
    /// Registered blocks reused for new content, losing their cached prefix.
    pub num_evictions: u64,
}

/// A fixed set of KV blocks with reference counts, an LRU free queue and a prefix
/// cache. Nothing here knows about tensors: a [`BlockId`] is an index the backend
/// maps to memory. It is changed only through the [`crate::Scheduler`]; callers get
/// a read-only view from [`crate::KvManager::pool`].
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    free_queue: FreeQueue,
    cached: HashMap<BlockHash, BlockId>,
    stats: BlockPoolStats,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens each, none cached.
    /// The first allocations take blocks 0, 1, 2, ... in order.
    pub(crate) fn new(num_blocks: usize, block_size: usize) -> Result<Self, ConfigError> {
        if num_blocks == 0 {
            return Err(ConfigError::MustBePositive { name: "num_blocks" });
        }
        if block_size == 0 {
            return Err(ConfigError::MustBePositive { name: "block_size" });
        }
        let num_blocks_u32 = u32::try_from(num_blocks)
            .ok()
            .filter(|&n| n < u32::MAX)
            .ok_or(ConfigError::TooManyBlocks { num_blocks })?;
        Ok(BlockPool {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free_queue: FreeQueue::full(num_blocks_u32),
            cached: HashMap::new(),
            stats: BlockPoolStats::default(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// All blocks, used and free.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks referenced by no block table (some may still hold a cached prefix).
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len()
    }

    /// Blocks referenced by at least one block table.
    pub fn num_used_blocks(&self) -> usize {
        self.blocks.len() - self.free_queue.len()
    }

    /// Registered blocks (used or free) that a prefix lookup can hit.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// How many block tables reference `block_id` (0 for a free block or an id
    /// outside the pool).
    pub fn ref_count(&self, block_id: BlockId) -> u32 {
        self.blocks.get(block_id.index()).map_or(0, |b| b.ref_count)
    }

    /// The hash `block_id` is registered under, if any.
    pub fn block_hash(&self, block_id: BlockId) -> Option<BlockHash> {
        self.blocks
            .get(block_id.index())
            .and_then(|b| b.cached.as_ref())
            .map(|c| c.hash)
    }

    /// The free blocks in eviction order: the first is reused first.
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free_queue.iter().map(BlockId)
    }

    /// Counters since the pool was created.
    pub fn stats(&self) -> BlockPoolStats {
        self.stats
    }

    /// The identity of the current incarnation of `block_id`, as a parent.
    pub(crate) fn link(&self, block_id: BlockId) -> ChainLink {
        ChainLink::Block {
            block_id,
            generation: self.blocks[block_id.index()].generation,
        }
    }

    /// Looks up the block registered under `hash` and checks it exactly: it must
    /// have been registered after `parent` and hold `token_ids`. An orphan under
    /// the hash is a miss; a live block with other content is a collision. Changes
    /// nothing; the caller takes a hit with `touch`.
    pub(crate) fn lookup(
        &self,
        hash: BlockHash,
        parent: ChainLink,
        token_ids: &[TokenId],
    ) -> Lookup {
        let Some(&block_id) = self.cached.get(&hash) else {
            return Lookup::Miss;
        };
        let content = self.blocks[block_id.index()]
            .cached
            .as_ref()
            .expect("the hash map only names registered blocks; this is a bug");
        if content.parent == parent && *content.token_ids == *token_ids {
            Lookup::Hit(block_id)
        } else if self.is_live(content.parent) {
            Lookup::Collision(block_id)
        } else {
            Lookup::Miss
        }
    }

    /// Adds a reference to `block_id` (a prefix hit), taking it out of the free queue
    /// if it was free.
    pub(crate) fn touch(&mut self, block_id: BlockId) {
        let block = &mut self.blocks[block_id.index()];
        if block.ref_count == 0 {
            self.free_queue.remove(block_id.0);
        }
        block.ref_count += 1;
    }

    /// Takes `n` blocks from the front of the free queue, each with one reference,
    /// evicting any prefix they cached. All or nothing: `None` (and no change) when
    /// fewer than `n` blocks are free.
    pub(crate) fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_queue.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let idx = self
                .free_queue
                .pop_front()
                .expect("the length was checked above; this is a bug");
            let block = &mut self.blocks[idx as usize];
            debug_assert_eq!(
                block.ref_count, 0,
                "a queued block is referenced; this is a bug"
            );
            if let Some(content) = block.cached.take() {
                self.cached.remove(&content.hash);
                self.stats.num_evictions += 1;
            }
            block.ref_count = 1;
            block.generation += 1;
            out.push(BlockId(idx));
        }
        Some(out)
    }

    /// Drops one reference from each block of a sequence's block table, given head
    /// first. Blocks are released tail first, so that among the blocks this frees the
    /// tail is evicted before the head: registered blocks go to the back of the free
    /// queue (most recently used), unregistered ones to the front (evicted first,
    /// since nothing can hit them).
    pub(crate) fn free(&mut self, block_table: &[BlockId]) {
        for &block_id in block_table.iter().rev() {
            let block = &mut self.blocks[block_id.index()];
            block.ref_count = block
                .ref_count
                .checked_sub(1)
                .expect("freed a block with no references; this is a bug");
            if block.ref_count == 0 {
                if block.cached.is_some() {
                    self.free_queue.push_back(block_id.0);
                } else {
                    self.free_queue.push_front(block_id.0);
                }
            }
        }
    }

    /// Registers the used, full, computed block `block_id`, which follows `parent`
    /// and holds `token_ids`, under `hash`. Returns the identity later blocks of the
    /// sequence should name as their parent:
    ///
    /// * the block itself, registered, when the hash was free or held by an orphan
    ///   (a block whose parent was evicted, which nothing can hit any more);
    /// * the block already registered with the same parent and tokens, when this
    ///   block duplicates it (the same prefix computed twice); this block stays
    ///   private;
    /// * the block itself, private, when a different live block holds the hash (a
    ///   collision); nothing can hit it or its successors.
    pub(crate) fn register(
        &mut self,
        block_id: BlockId,
        hash: BlockHash,
        parent: ChainLink,
        token_ids: &[TokenId],
    ) -> ChainLink {
        debug_assert_eq!(
            token_ids.len(),
            self.block_size,
            "only full blocks are registered"
        );
        debug_assert!(
            self.blocks[block_id.index()].ref_count > 0,
            "only used blocks are registered"
        );
        debug_assert!(
            self.blocks[block_id.index()].cached.is_none(),
            "a hash is set once"
        );
        if let Some(&existing) = self.cached.get(&hash) {
            if let Lookup::Hit(_) = self.lookup(hash, parent, token_ids) {
                return self.link(existing);
            }
            let existing_parent = self.blocks[existing.index()]
                .cached
                .as_ref()
                .map(|c| c.parent)
                .expect("the hash map only names registered blocks; this is a bug");
            if self.is_live(existing_parent) {
                return self.link(block_id);
            }
            self.unregister(existing);
        }
        self.blocks[block_id.index()].cached = Some(CachedContent {
            hash,
            parent,
            token_ids: token_ids.into(),
        });
        self.cached.insert(hash, block_id);
        self.link(block_id)
    }

    /// True if `link` names a root or a block incarnation that is still registered,
    /// so a block registered after it can still be hit.
    fn is_live(&self, link: ChainLink) -> bool {
        match link {
            ChainLink::Root(_) => true,
            ChainLink::Block {
                block_id,
                generation,
            } => {
                let block = &self.blocks[block_id.index()];
                block.generation == generation && block.cached.is_some()
            }
        }
    }

    /// Drops the hash of an orphan; if it is free, it moves to the front of the free
    /// queue, since nothing can hit it.
    fn unregister(&mut self, block_id: BlockId) {
        let block = &mut self.blocks[block_id.index()];
        if let Some(content) = block.cached.take() {
            self.cached.remove(&content.hash);
        }
        if block.ref_count == 0 {
            self.free_queue.remove(block_id.0);
            self.free_queue.push_front(block_id.0);
        }
    }

    /// Checks the pool's internal invariants: every block is free xor referenced,
    /// used + free = total, and the hash map names exactly the registered blocks.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        for (idx, block) in self.blocks.iter().enumerate() {
            let queued = self.free_queue.contains(idx as u32);
            if queued != (block.ref_count == 0) {
                return Err(format!(
                    "block {idx}: ref_count {} but queued = {queued}",
                    block.ref_count
                ));
            }
            if let Some(content) = &block.cached {
                if self.cached.get(&content.hash) != Some(&BlockId(idx as u32)) {
                    return Err(format!("block {idx} is registered but not in the map"));
                }
            }
        }
        for (hash, id) in &self.cached {
            if self.block_hash(*id) != Some(*hash) {
                return Err(format!("map entry for block {} has a stale hash", id.0));
            }
        }
        let num_queued = self.free_queue.iter().count();
        if num_queued != self.free_queue.len()
            || self.num_used_blocks() + self.num_free_blocks() != self.num_blocks()
        {
            return Err("free queue length is inconsistent".to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(ids: &[u32]) -> Vec<TokenId> {
        ids.iter().copied().map(TokenId).collect()
    }

    fn ids(ids: &[u32]) -> Vec<BlockId> {
        ids.iter().copied().map(BlockId).collect()
    }

    const ROOT: ChainLink = ChainLink::Root(BlockHash(7));

    #[test]
    fn freed_blocks_keep_their_hash_until_evicted() {
        let mut pool = BlockPool::new(3, 2).unwrap();
        let table = pool.allocate(2).unwrap();
        assert_eq!(table, ids(&[0, 1]));
        let h0 = BlockHash(100);
        assert_eq!(
            pool.register(table[0], h0, ROOT, &toks(&[1, 2])),
            pool.link(table[0])
        );
        pool.free(&table);
        // Unregistered block 1 goes to the front, registered block 0 to the back.
        assert_eq!(pool.free_blocks().collect::<Vec<_>>(), ids(&[1, 2, 0]));
        assert_eq!(
            pool.lookup(h0, ROOT, &toks(&[1, 2])),
            Lookup::Hit(BlockId(0))
        );
        assert_eq!(
            pool.lookup(h0, ROOT, &toks(&[1, 3])),
            Lookup::Collision(BlockId(0))
        );
        let other_root = ChainLink::Root(BlockHash(8));
        assert_eq!(
            pool.lookup(h0, other_root, &toks(&[1, 2])),
            Lookup::Collision(BlockId(0))
        );
        assert_eq!(pool.allocate(2).unwrap(), ids(&[1, 2]));
        assert_eq!(pool.stats().num_evictions, 0);
        assert_eq!(pool.allocate(1).unwrap(), ids(&[0]));
        assert_eq!(pool.stats().num_evictions, 1);
        assert_eq!(pool.lookup(h0, ROOT, &toks(&[1, 2])), Lookup::Miss);
        assert!(pool.allocate(1).is_none());
        pool.check_invariants().unwrap();
    }

    #[test]
    fn touch_takes_a_free_block_out_of_the_queue() {
        let mut pool = BlockPool::new(2, 1).unwrap();
        let table = pool.allocate(1).unwrap();
        pool.register(table[0], BlockHash(1), ROOT, &toks(&[5]));
        pool.free(&table);
        pool.touch(BlockId(0));
        pool.touch(BlockId(0));
        assert_eq!(pool.ref_count(BlockId(0)), 2);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free(&table);
        pool.free(&table);
        assert_eq!(pool.num_free_blocks(), 2);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn register_dedups_refuses_collisions_and_replaces_orphans() {
        let mut pool = BlockPool::new(6, 1).unwrap();
        let blocks = pool.allocate(6).unwrap();
        let (a, b, c, d, e, f) = (
            blocks[0], blocks[1], blocks[2], blocks[3], blocks[4], blocks[5],
        );
        // a registers; b holds the same content after the same parent: a duplicate.
        assert_eq!(
            pool.register(a, BlockHash(1), ROOT, &toks(&[1])),
            pool.link(a)
        );
        assert_eq!(
            pool.register(b, BlockHash(1), ROOT, &toks(&[1])),
            pool.link(a)
        );
        assert_eq!(pool.block_hash(b), None);
        // c collides with a (same hash, other tokens) and stays private.
        assert_eq!(
            pool.register(c, BlockHash(1), ROOT, &toks(&[2])),
            pool.link(c)
        );
        assert_eq!(pool.block_hash(c), None);
        // d follows a; once a is evicted, d is an orphan and e takes its hash.
        let after_a = pool.link(a);
        assert_eq!(
            pool.register(d, BlockHash(2), after_a, &toks(&[3])),
            pool.link(d)
        );
        pool.free(&[a]);
        assert_eq!(pool.allocate(1).unwrap(), vec![a]);
        // The new incarnation of a is not d's parent, whatever it will hold: d is an
        // orphan now, a miss.
        assert_eq!(
            pool.lookup(BlockHash(2), pool.link(a), &toks(&[3])),
            Lookup::Miss
        );
        // e follows the live block f and takes the orphan's hash.
        assert_eq!(
            pool.register(f, BlockHash(3), ROOT, &toks(&[9])),
            pool.link(f)
        );
        assert_eq!(
            pool.register(e, BlockHash(2), pool.link(f), &toks(&[3])),
            pool.link(e)
        );
        assert_eq!(pool.block_hash(d), None);
        assert_eq!(
            pool.lookup(BlockHash(2), after_a, &toks(&[3])),
            Lookup::Collision(e)
        );
        pool.check_invariants().unwrap();
    }

    #[test]
    fn rejects_empty_and_oversized_pools() {
        assert!(BlockPool::new(0, 16).is_err());
        assert!(BlockPool::new(4, 0).is_err());
        assert!(BlockPool::new(u32::MAX as usize, 16).is_err());
    }
}
