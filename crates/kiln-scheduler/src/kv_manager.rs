//! Per-request block tables over the block pool, one per layer group: admission
//! with a prefix lookup, allocation as a request grows, registration of blocks as
//! they fill, freeing of blocks that left a sliding window, and freeing.
//!
//! Entry `i` of a block table holds tokens `i * block_size .. (i + 1) * block_size`
//! of the group's layers. A table grows at its end; a sliding-window group also
//! drops entries at its front once no later query can read them (the front index is
//! [`BlockTable::first`]). Blocks found in the prefix cache at admission come first
//! and are shared (reference counted); every later block is the request's own. A
//! block is registered in the prefix cache once all its tokens are computed, whether
//! they came from the prompt or were generated, so a request that continues a
//! finished conversation hits the generated part too.
//!
//! Each group chains its blocks from its own root ([`BlockHash::group_root`]). A
//! prefix hits when every group's chain matches from the first block, so a sliding
//! group's blocks that left the window still count for hits while they stay cached
//! (freed, not yet reused); a sliding group takes only the hits inside the window.

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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// One layer group's block table of a request: entry `i` holds the group's keys and
/// values of tokens `i * block_size .. (i + 1) * block_size`. Entries before
/// [`BlockTable::first`] left a sliding window and were freed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockTable {
    /// The first entry still held.
    pub first: usize,
    /// The held entries, `first..`.
    pub blocks: Vec<BlockId>,
}

impl BlockTable {
    /// Entries, freed ones included: the table covers `len() * block_size` tokens.
    pub fn len(&self) -> usize {
        self.first + self.blocks.len()
    }

    /// Whether the table has no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The block of entry `idx`, if it is held.
    pub fn get(&self, idx: usize) -> Option<BlockId> {
        idx.checked_sub(self.first)
            .and_then(|i| self.blocks.get(i).copied())
    }
}

/// The prefix-cache chain of one group's table.
#[derive(Debug, Clone)]
struct Chain {
    root_hash: BlockHash,
    /// Hashes of the first entries of the table, those full and computed (hit at
    /// admission or registered since), freed ones included.
    block_hashes: Vec<BlockHash>,
    /// For each of those entries, the identity its successor names as parent: the
    /// block itself, or the registered block it duplicates.
    links: Vec<ChainLink>,
}

/// The blocks of one request, one table and chain per layer group.
#[derive(Debug, Clone)]
struct SeqBlocks {
    tables: Vec<BlockTable>,
    chains: Vec<Chain>,
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
    /// Recurrent-state slots; `None` for a model without recurrent layers.
    states: Option<StateSlots>,
}

/// A hybrid model's recurrent-state slots: one a running request, and
/// snapshots of states at block boundaries, keyed by the hash of the block
/// that ends there (group 0's chain), which a later request with the same
/// prefix restores instead of recomputing it.
#[derive(Debug, Clone)]
struct StateSlots {
    /// Running slots are `0..running`, snapshot slots `running..snapshots_end`,
    /// spare slots `snapshots_end..total`.
    running: u32,
    #[cfg(test)]
    snapshots_end: u32,
    #[cfg(test)]
    total: u32,
    /// Free spare slots (taken from the back).
    spares_free: Vec<u32>,
    /// A request's second slot, where its speculative decodes write their
    /// state ([`KvManager::spare_slot`]); a running or a spare slot (the two
    /// trade places when a speculative decode's drafts are all accepted).
    spare: BTreeMap<RequestId, u32>,
    /// Requests whose spare the step being planned or in flight writes.
    spare_busy: std::collections::BTreeSet<RequestId>,
    /// Free running slots (taken from the back).
    free: Vec<u32>,
    held: BTreeMap<RequestId, u32>,
    /// Snapshot slots are `running..running + snapshots`; free ones.
    snap_free: Vec<u32>,
    /// Published snapshots: the boundary block's hash → slot, and back.
    by_hash: std::collections::HashMap<BlockHash, u32>,
    hash_of: std::collections::HashMap<u32, BlockHash>,
    /// Last use of each published snapshot (eviction takes the oldest).
    last_use: std::collections::HashMap<u32, u64>,
    tick: u64,
    /// Snapshots the step in flight writes, published when it completes.
    pending: Vec<(u32, BlockHash)>,
    /// Snapshots this step restores (not evicted before it runs).
    pinned: Vec<u32>,
    /// A request's restore for its first step after admission.
    restores: BTreeMap<RequestId, u32>,
    /// Snapshots are taken every `interval` tokens (a multiple of the block
    /// size) and at the last block boundary of the prompt.
    interval: usize,
    /// Each running request's tail: a snapshot slot holding its state at
    /// the last block boundary it passed, published when it leaves (so the
    /// next turn of a chat resumes after the previous answer too).
    tails: BTreeMap<RequestId, Tail>,
}

/// A running request's tail snapshot ([`StateSlots::tails`]).
#[derive(Debug, Clone, Copy)]
struct Tail {
    slot: u32,
    /// The boundary block whose state the slot holds (after the step that
    /// wrote it completed).
    hash: Option<BlockHash>,
    /// The boundary the step in flight writes.
    pending: Option<BlockHash>,
}

impl StateSlots {
    /// Every running slot is free or held by one admitted request; every
    /// snapshot slot is free, published, a tail or written by the step in
    /// flight, exactly one of them; the maps agree.
    #[cfg(test)]
    fn check_invariants<V>(&self, admitted: &BTreeMap<RequestId, V>) -> Result<(), String> {
        let mut running: Vec<u32> = self
            .free
            .iter()
            .chain(&self.spares_free)
            .chain(self.held.values())
            .chain(self.spare.values())
            .copied()
            .collect();
        running.sort_unstable();
        let expected: Vec<u32> = (0..self.running)
            .chain(self.snapshots_end..self.total)
            .collect();
        if running != expected {
            return Err(format!(
                "running and spare state slots {running:?}, not {expected:?}"
            ));
        }
        if self.free.iter().any(|&s| s >= self.running)
            || self.spares_free.iter().any(|&s| s < self.snapshots_end)
        {
            return Err("a free slot in the other pool's list".into());
        }
        if let Some(id) = self
            .spare
            .keys()
            .chain(&self.spare_busy)
            .find(|id| !self.held.contains_key(id))
        {
            return Err(format!(
                "request {id} has a spare state slot but no running slot"
            ));
        }
        if let Some(id) = self.held.keys().find(|id| !admitted.contains_key(id)) {
            return Err(format!("request {id} holds a state slot but no blocks"));
        }
        for (what, ids) in [
            ("tail", self.tails.keys().collect::<Vec<_>>()),
            ("restore", self.restores.keys().collect()),
        ] {
            if let Some(id) = ids.iter().find(|id| !self.held.contains_key(id)) {
                return Err(format!("request {id} has a {what} but no running slot"));
            }
        }
        let mut snaps: Vec<u32> = self
            .snap_free
            .iter()
            .chain(self.hash_of.keys())
            .chain(self.tails.values().map(|t| &t.slot))
            .chain(self.pending.iter().map(|p| &p.0))
            .copied()
            .collect();
        snaps.sort_unstable();
        if snaps != (self.running..self.snapshots_end).collect::<Vec<_>>() {
            return Err(format!(
                "snapshot slots {snaps:?} of {}..{}",
                self.running, self.snapshots_end
            ));
        }
        if self.by_hash.len() != self.hash_of.len()
            || self
                .by_hash
                .iter()
                .any(|(h, s)| self.hash_of.get(s) != Some(h))
            || self.last_use.len() != self.hash_of.len()
        {
            return Err(format!(
                "published snapshots' maps disagree: by_hash {:?}, hash_of {:?}, last_use {:?}",
                self.by_hash, self.hash_of, self.last_use
            ));
        }
        Ok(())
    }

    /// A running or spare slot back to its pool's free list.
    fn give_back(&mut self, slot: u32) {
        if slot < self.running {
            self.free.push(slot);
        } else {
            self.spares_free.push(slot);
        }
    }

    /// A spare that is a running slot, taken from a request whose step
    /// does not write it, back to the running pool (for an admission).
    fn reclaim_running_spare(&mut self) {
        let idle = self
            .spare
            .iter()
            .find(|(id, &s)| s < self.running && !self.spare_busy.contains(id))
            .map(|(&id, _)| id);
        if let Some(slot) = idle.and_then(|id| self.spare.remove(&id)) {
            self.free.push(slot);
        }
    }

    /// A snapshot slot: a free one, else the least recently used published
    /// one not restored or written by the step being planned.
    fn take_snapshot_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.snap_free.pop() {
            return Some(s);
        }
        let busy = |s: &u32| self.pinned.contains(s) || self.pending.iter().any(|p| p.0 == *s);
        let (&victim, _) = self
            .last_use
            .iter()
            .filter(|(s, _)| !busy(s))
            .min_by_key(|(s, &t)| (t, **s))?;
        if let Some(h) = self.hash_of.remove(&victim) {
            self.by_hash.remove(&h);
        }
        self.last_use.remove(&victim);
        Some(victim)
    }
}

/// How a hybrid model's recurrent state is kept (see
/// [`crate::SchedulerConfig::state_slots`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StateConfig {
    pub(crate) running: usize,
    pub(crate) snapshots: usize,
    pub(crate) interval: usize,
    pub(crate) spares: usize,
}

impl KvManager {
    /// A manager over `num_blocks` blocks laid out as `spec` says. Fails if the spec
    /// cannot be served (see [`KvCacheSpec::validate`]) or the pool size is invalid.
    /// With `states`, each admitted request also holds a recurrent-state slot,
    /// and prefix hits resume from state snapshots.
    pub(crate) fn new(
        spec: KvCacheSpec,
        num_blocks: usize,
        states: Option<StateConfig>,
    ) -> Result<Self, ConfigError> {
        spec.validate()?;
        let pool = BlockPool::new(num_blocks, spec.block_size)?;
        let states = states.map(|c| {
            let running = c.running as u32;
            let snapshots_end = running + c.snapshots as u32;
            StateSlots {
                running,
                #[cfg(test)]
                snapshots_end,
                #[cfg(test)]
                total: snapshots_end + c.spares as u32,
                spares_free: (snapshots_end..snapshots_end + c.spares as u32)
                    .rev()
                    .collect(),
                spare: BTreeMap::new(),
                spare_busy: Default::default(),
                free: (0..running).rev().collect(),
                held: BTreeMap::new(),
                snap_free: (running..running + c.snapshots as u32).rev().collect(),
                by_hash: Default::default(),
                hash_of: Default::default(),
                last_use: Default::default(),
                tick: 0,
                pending: Vec::new(),
                pinned: Vec::new(),
                restores: BTreeMap::new(),
                interval: c.interval.max(1),
                tails: BTreeMap::new(),
            }
        });
        Ok(KvManager {
            spec,
            pool,
            seqs: BTreeMap::new(),
            stats: PrefixCacheStats::default(),
            chain_hash: BlockHash::chain,
            states,
        })
    }

    /// Request `id`'s recurrent-state slot, while it is admitted.
    pub fn state_slot(&self, id: RequestId) -> Option<u32> {
        self.states.as_ref()?.held.get(&id).copied()
    }

    /// Request `id`'s spare state slot for the speculative decode being
    /// planned: its own, a free one, or one another request's step does not
    /// write; `None` when there is none (it decodes without guesses).
    pub(crate) fn spare_slot(&mut self, id: RequestId) -> Option<u32> {
        let st = self.states.as_mut()?;
        if !st.held.contains_key(&id) {
            return None;
        }
        let slot = match st.spare.get(&id) {
            Some(&s) => s,
            None => {
                let slot = match st.spares_free.pop() {
                    Some(s) => s,
                    None => {
                        let (&other, _) =
                            st.spare.iter().find(|(o, _)| !st.spare_busy.contains(o))?;
                        st.spare.remove(&other)?
                    }
                };
                st.spare.insert(id, slot);
                slot
            }
        };
        st.spare_busy.insert(id);
        Some(slot)
    }

    /// The speculative decode of request `id` that wrote its spare slot is
    /// over (or its drafts were dropped before it ran): with `accepted_all`
    /// the spare holds the request's state and becomes its slot (the old one
    /// its spare).
    pub(crate) fn spare_done(&mut self, id: RequestId, accepted_all: bool) {
        let Some(st) = self.states.as_mut() else {
            return;
        };
        st.spare_busy.remove(&id);
        if accepted_all {
            if let (Some(held), Some(spare)) = (st.held.get_mut(&id), st.spare.get_mut(&id)) {
                std::mem::swap(held, spare);
            }
        }
    }

    /// Whether requests hold recurrent state.
    pub(crate) fn has_states(&self) -> bool {
        self.states.is_some()
    }

    /// The snapshot request `id`'s first step restores (once).
    pub(crate) fn take_restore(&mut self, id: RequestId) -> Option<u32> {
        self.states.as_mut()?.restores.remove(&id)
    }

    /// Snapshots of request `id`'s state for a step computing its tokens
    /// `start..end` (`token_ids` its known tokens, `num_prompt` of them the
    /// prompt): at each block boundary past `start` up to `end` that is a
    /// multiple of the interval or the prompt's last full block, whose block
    /// is not snapshotted yet — `(tokens into the step, slot)`. They are
    /// published when the step completes ([`KvManager::publish_snapshots`]).
    pub(crate) fn plan_snapshots(
        &mut self,
        id: RequestId,
        root_hash: BlockHash,
        token_ids: &[TokenId],
        num_prompt: usize,
        start: usize,
        end: usize,
    ) -> Vec<(usize, u32)> {
        let bs = self.spec.block_size;
        let chain_hash = self.chain_hash;
        // Hashing resumes after the blocks the request has registered (group
        // 0's chain, the same hashes), not from its first token.
        let (mut hash, mut hashed) = self
            .seqs
            .get(&id)
            .and_then(|s| s.chains.first())
            .and_then(|c| {
                c.block_hashes
                    .last()
                    .map(|&h| (h, c.block_hashes.len() * bs))
            })
            .filter(|&(_, n)| n <= start)
            .unwrap_or((root_hash.group_root(0), 0));
        let Some(st) = self.states.as_mut() else {
            return Vec::new();
        };
        let prompt_end = num_prompt / bs * bs;
        let mut out = Vec::new();
        let mut c = (start / bs + 1) * bs;
        while c <= end.min(token_ids.len()) {
            if c % st.interval == 0 || c == prompt_end {
                while hashed < c {
                    hash = chain_hash(hash, &token_ids[hashed..hashed + bs]);
                    hashed += bs;
                }
                let known =
                    st.by_hash.contains_key(&hash) || st.pending.iter().any(|p| p.1 == hash);
                if !known {
                    let Some(slot) = st.take_snapshot_slot() else {
                        break;
                    };
                    st.pending.push((slot, hash));
                    out.push((c - start, slot));
                }
            }
            c += bs;
        }
        // The tail: the last boundary this step passes, unless a checkpoint
        // above keeps it.
        let last = end.min(token_ids.len()) / bs * bs;
        if last > start && last >= bs && !out.iter().any(|&(t, _)| t == last - start) {
            while hashed < last {
                hash = chain_hash(hash, &token_ids[hashed..hashed + bs]);
                hashed += bs;
            }
            let tail = match st.tails.get(&id) {
                Some(t) => Some(t.slot),
                None => st.take_snapshot_slot(),
            };
            if let Some(slot) = tail {
                let t = st.tails.entry(id).or_insert(Tail {
                    slot,
                    hash: None,
                    pending: None,
                });
                t.pending = Some(hash);
                out.push((last - start, slot));
            }
        }
        out
    }

    /// The step in flight completed: its snapshots hold their states.
    pub(crate) fn publish_snapshots(&mut self) {
        let Some(st) = self.states.as_mut() else {
            return;
        };
        st.pinned.clear();
        for (slot, hash) in std::mem::take(&mut st.pending) {
            // A request that left while the step ran may have published its
            // tail at the same boundary: one slot keeps it.
            if st.by_hash.contains_key(&hash) {
                st.snap_free.push(slot);
                continue;
            }
            st.tick += 1;
            st.by_hash.insert(hash, slot);
            st.hash_of.insert(slot, hash);
            st.last_use.insert(slot, st.tick);
        }
        for t in st.tails.values_mut() {
            if let Some(h) = t.pending.take() {
                t.hash = Some(h);
            }
        }
    }

    /// Replaces the block hash function (tests force collisions with it).
    #[cfg(test)]
    pub(crate) fn set_chain_hash(&mut self, chain_hash: ChainHash) {
        self.chain_hash = chain_hash;
    }

    /// `n` free blocks outside any request (see
    /// [`crate::Scheduler::lend_blocks`]).
    pub(crate) fn lend(&mut self, n: usize) -> Option<Vec<BlockId>> {
        self.pool.allocate(n)
    }

    /// Blocks [`KvManager::lend`] gave out, back to the free queue (at its
    /// front: nothing can hit them).
    pub(crate) fn take_back(&mut self, blocks: &[BlockId]) {
        self.pool.free(blocks);
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

    /// The block tables of a request that holds blocks (running), one per group.
    pub fn block_tables(&self, id: RequestId) -> Option<&[BlockTable]> {
        self.seqs.get(&id).map(|s| s.tables.as_slice())
    }

    /// Walks group `group`'s chain of `token_ids` from `root_hash` through the
    /// prefix cache, at most `max_blocks` blocks: the hits with their hashes and
    /// links, and whether the walk stopped at a collision.
    fn walk(
        &self,
        root_hash: BlockHash,
        token_ids: &[TokenId],
        max_blocks: usize,
    ) -> (Vec<BlockId>, Chain, bool) {
        let mut hits = Vec::new();
        let mut chain = Chain {
            root_hash,
            block_hashes: Vec::new(),
            links: Vec::new(),
        };
        let (mut parent_hash, mut parent_link) = (root_hash, ChainLink::Root(root_hash));
        for block_tokens in token_ids
            .chunks_exact(self.spec.block_size)
            .take(max_blocks)
        {
            let hash = (self.chain_hash)(parent_hash, block_tokens);
            match self.pool.lookup(hash, parent_link, block_tokens) {
                Lookup::Hit(block_id) => {
                    hits.push(block_id);
                    chain.block_hashes.push(hash);
                    parent_hash = hash;
                    parent_link = self.pool.link(block_id);
                    chain.links.push(parent_link);
                }
                Lookup::Collision(_) => return (hits, chain, true),
                Lookup::Miss => break,
            }
        }
        (hits, chain, false)
    }

    /// Admits a request that holds no blocks, whose known tokens are `token_ids`
    /// (prompt, then any tokens generated before a preemption): looks up the
    /// longest cached prefix of full blocks that every group has, never the last
    /// token (it is always recomputed so there are logits), then allocates blocks
    /// for up to `max_new_tokens` more tokens. All or nothing: on `Err` nothing
    /// changed and no counter moved.
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
        if let Some(st) = self.states.as_mut().filter(|st| st.free.is_empty()) {
            st.reclaim_running_spare();
        }
        if self.states.as_ref().is_some_and(|st| st.free.is_empty()) {
            // (The scheduler runs at most as many requests as there are slots.)
            return Err(OutOfBlocks {
                needed: 0,
                free: self.pool.num_free_blocks(),
            });
        }
        let mut num_hit = token_ids.len().saturating_sub(1) / bs;
        let mut collided = false;
        let mut walks = Vec::with_capacity(self.spec.groups.len());
        for g in 0..self.spec.groups.len() {
            let walk = self.walk(root_hash.group_root(g), token_ids, num_hit);
            num_hit = num_hit.min(walk.0.len());
            collided |= walk.2;
            walks.push(walk);
        }
        // A hybrid resumes from the deepest snapshot its hits reach (the
        // recurrent state of a prefix is in no block).
        let mut restore = None;
        if let Some(st) = &self.states {
            let hashes = &walks[0].1.block_hashes;
            let found = (1..=num_hit)
                .rev()
                .find_map(|b| st.by_hash.get(&hashes[b - 1]).map(|&slot| (b, slot)));
            num_hit = found.map_or(0, |(b, _)| b);
            restore = found.map(|(_, slot)| slot);
        }
        let num_cached_tokens = num_hit * bs;
        let num_new_tokens = (token_ids.len() - num_cached_tokens).min(max_new_tokens);
        let end = self
            .spec
            .blocks_for_tokens(num_cached_tokens + num_new_tokens);
        // Each group takes its hits from the first block a query can read.
        let firsts: Vec<usize> = self
            .spec
            .groups
            .iter()
            .map(|g| {
                g.kind
                    .first_needed_block_idx(bs, num_cached_tokens)
                    .min(num_hit)
            })
            .collect();
        let num_new_blocks = self.spec.groups.len() * (end - num_hit);
        let num_free_hits = walks
            .iter()
            .zip(&firsts)
            .flat_map(|((hits, _, _), &first)| &hits[first..num_hit])
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
        for ((hits, _, _), &first) in walks.iter().zip(&firsts) {
            for &block_id in &hits[first..num_hit] {
                self.pool.touch(block_id);
            }
        }
        let mut tables = Vec::with_capacity(walks.len());
        let mut chains = Vec::with_capacity(walks.len());
        for ((hits, mut chain, _), first) in walks.into_iter().zip(firsts) {
            let mut blocks = hits[first..num_hit].to_vec();
            blocks.extend(
                self.pool
                    .allocate(end - num_hit)
                    .expect("free blocks were counted above; this is a bug"),
            );
            chain.block_hashes.truncate(num_hit);
            chain.links.truncate(num_hit);
            tables.push(BlockTable { first, blocks });
            chains.push(chain);
        }
        self.stats.num_lookups += 1;
        self.stats.num_queried_tokens += token_ids.len() as u64;
        self.stats.num_hit_blocks += num_hit as u64;
        self.stats.num_hit_tokens += num_cached_tokens as u64;
        self.stats.num_collisions += u64::from(collided);
        self.seqs.insert(id, SeqBlocks { tables, chains });
        if let Some(st) = &mut self.states {
            let slot = st
                .free
                .pop()
                .expect("a free slot was checked above; this is a bug");
            st.held.insert(id, slot);
            if let Some(from) = restore {
                st.tick += 1;
                st.last_use.insert(from, st.tick);
                st.pinned.push(from);
                st.restores.insert(id, from);
            }
        }
        Ok(Admission {
            num_cached_tokens,
            num_new_tokens,
        })
    }

    /// Grows the block tables of admitted request `id`, which has
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
        let needed: usize = seq
            .tables
            .iter()
            .map(|t| target.saturating_sub(t.len()))
            .sum();
        let free = self.pool.num_free_blocks();
        let mut blocks = self
            .pool
            .allocate(needed)
            .ok_or(OutOfBlocks { needed, free })?
            .into_iter();
        for table in &mut seq.tables {
            let n = target.saturating_sub(table.len());
            table.blocks.extend(blocks.by_ref().take(n));
        }
        Ok(())
    }

    /// Registers in the prefix cache every block of request `id` that the first
    /// `num_computed_tokens` of `token_ids` fill, in every group. A block whose
    /// content is already cached in another block stays private to the request, and
    /// its successors chain on the cached one.
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
        for (table, chain) in seq.tables.iter().zip(&mut seq.chains) {
            let num_full = (num_computed_tokens.min(token_ids.len()) / bs).min(table.len());
            while chain.block_hashes.len() < num_full {
                let idx = chain.block_hashes.len();
                let Some(block_id) = table.get(idx) else {
                    // Freed before it filled (cannot happen: a block leaves the
                    // window only after its tokens are computed and registered).
                    debug_assert!(false, "entry {idx} freed before it was registered");
                    break;
                };
                let (parent_hash, parent_link) = match idx.checked_sub(1) {
                    Some(prev) => (chain.block_hashes[prev], chain.links[prev]),
                    None => (chain.root_hash, ChainLink::Root(chain.root_hash)),
                };
                let block_tokens = &token_ids[idx * bs..(idx + 1) * bs];
                let hash = (self.chain_hash)(parent_hash, block_tokens);
                let link = self
                    .pool
                    .register(block_id, hash, parent_link, block_tokens);
                chain.block_hashes.push(hash);
                chain.links.push(link);
            }
        }
    }

    /// Frees the blocks of request `id` that no query at position
    /// `num_computed_tokens` or later reads: the front of each sliding-window
    /// group's table. Call it after the step's blocks are registered.
    pub(crate) fn free_out_of_window(&mut self, id: RequestId, num_computed_tokens: usize) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let bs = self.spec.block_size;
        for (table, group) in seq.tables.iter_mut().zip(&self.spec.groups) {
            let first = group
                .kind
                .first_needed_block_idx(bs, num_computed_tokens)
                .min(table.len());
            if first > table.first {
                let gone: Vec<BlockId> = table.blocks.drain(..first - table.first).collect();
                table.first = first;
                self.pool.free(&gone);
            }
        }
    }

    /// Gives back request `id`'s blocks past those its first `num_tokens`
    /// tokens need (the end of a speculative step whose drafts were
    /// rejected: their slots were written but nothing registered them).
    pub(crate) fn truncate(&mut self, id: RequestId, num_tokens: usize) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let keep = num_tokens.div_ceil(self.spec.block_size);
        for table in &mut seq.tables {
            if table.len() > keep {
                let cut = keep.saturating_sub(table.first);
                let gone: Vec<BlockId> = table.blocks.split_off(cut);
                self.pool.free(&gone);
            }
        }
    }

    /// Blocks request `id` holds over all groups (0 if it holds none).
    pub fn num_held_blocks(&self, id: RequestId) -> usize {
        self.seqs
            .get(&id)
            .map_or(0, |s| s.tables.iter().map(|t| t.blocks.len()).sum())
    }

    /// Releases every block of request `id` (tail first, so the tail is evicted
    /// first). Returns false if it held none.
    pub(crate) fn free(&mut self, id: RequestId) -> bool {
        if let Some(st) = &mut self.states {
            for slot in [st.held.remove(&id), st.spare.remove(&id)]
                .into_iter()
                .flatten()
            {
                st.give_back(slot);
            }
            st.spare_busy.remove(&id);
            st.restores.remove(&id);
            // The tail becomes a snapshot of its boundary, unless a step in
            // flight is still writing it or that boundary is kept already.
            if let Some(t) = st.tails.remove(&id) {
                match t.hash {
                    Some(h) if t.pending.is_none() && !st.by_hash.contains_key(&h) => {
                        st.tick += 1;
                        st.by_hash.insert(h, t.slot);
                        st.hash_of.insert(t.slot, h);
                        st.last_use.insert(t.slot, st.tick);
                    }
                    _ => st.snap_free.push(t.slot),
                }
            }
        }
        match self.seqs.remove(&id) {
            Some(seq) => {
                for table in &seq.tables {
                    self.pool.free(&table.blocks);
                }
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
            for (table, chain) in seq.tables.iter().zip(&seq.chains) {
                for block_id in &table.blocks {
                    if !seen.insert(*block_id) {
                        return Err(format!("request {id} names block {} twice", block_id.0));
                    }
                    refs[block_id.index()] += 1;
                }
                if chain.block_hashes.len() > table.len() {
                    return Err(format!("request {id} has more hashes than blocks"));
                }
                if chain.block_hashes.len() < table.first {
                    return Err(format!(
                        "request {id} freed an unregistered block: first {} hashes {} len {}",
                        table.first,
                        chain.block_hashes.len(),
                        table.len()
                    ));
                }
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
        if let Some(st) = &self.states {
            st.check_invariants(&self.seqs)?;
        }
        Ok(())
    }
}
