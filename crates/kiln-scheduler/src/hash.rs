//! Content hashes of KV blocks, chained from a per-request root.
//!
//! A block's hash covers its parent's hash and its own token ids, so equal hashes
//! mean (up to collisions) equal prefixes. The chain starts at a root hash that covers
//! the request's extra keys (the adapter and the cache salt), so requests that differ
//! in any of them never share a block. Media hashes for multimodal prompts will join
//! the chain as per-block extra keys in [`BlockHash::chain`].
//!
//! The hash is a small dependency-free two-lane 64-bit design (one xxHash64-style
//! lane and one with MurmurHash3's constants, each round a bijection of the lane
//! state, so no input word can collapse a lane), giving 128 bits. It is deterministic
//! across runs and platforms (inputs are packed little-endian), but it is not
//! cryptographic, and it need not be: the hash only finds a candidate block. The
//! block pool then checks the candidate exactly, comparing its token ids and the
//! identity of its parent block, and treats any mismatch as a miss (see
//! [`crate::BlockPool`]), so a collision, accidental or crafted, costs a miss and
//! never serves another prefix's KV. Only the root, and so the extra keys, is
//! compared by its 128-bit hash.

use std::fmt;

use kiln_sampling::TokenId;

/// The id of a LoRA adapter, part of the extra keys of every block hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterId(pub u32);

/// The 128-bit content hash of a full KV block, chained on its parent's hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

/// Domain tags keep a root hash from ever equalling the hash of a block.
const TAG_ROOT: u64 = 0x726f_6f74_6b69_6c6e;
const TAG_BLOCK: u64 = 0x626c_6f63_6b69_6c6e;
const TAG_GROUP: u64 = 0x6772_6f75_706b_6c6e;

impl BlockHash {
    /// The root of a request's chain: covers the adapter id and the cache salt.
    ///
    /// Requests with the same extra keys have the same root, so their equal prefixes
    /// hash alike; a different salt or adapter gives an unrelated chain.
    pub fn root(adapter_id: Option<AdapterId>, cache_salt: Option<&str>) -> BlockHash {
        let mut h = Lanes::new();
        h.write(TAG_ROOT);
        match adapter_id {
            Some(AdapterId(id)) => {
                h.write(1);
                h.write(u64::from(id));
            }
            None => h.write(0),
        }
        match cache_salt {
            Some(salt) => {
                h.write(1);
                h.write_bytes(salt.as_bytes());
            }
            None => h.write(0),
        }
        h.finish()
    }

    /// The root of layer group `group`'s chain under this root: the root itself for
    /// group 0, an unrelated root for each other group, so the blocks of different
    /// groups (which hold different layers) never hit each other.
    pub fn group_root(self, group: usize) -> BlockHash {
        if group == 0 {
            return self;
        }
        let mut h = Lanes::new();
        h.write(TAG_GROUP);
        h.write((self.0 >> 64) as u64);
        h.write(self.0 as u64);
        h.write(group as u64);
        h.finish()
    }

    /// The hash of a block holding `token_ids`, whose parent (the previous block of
    /// the sequence, or the root for the first block) has hash `parent`.
    pub fn chain(parent: BlockHash, token_ids: &[TokenId]) -> BlockHash {
        let mut h = Lanes::new();
        h.write(TAG_BLOCK);
        h.write((parent.0 >> 64) as u64);
        h.write(parent.0 as u64);
        h.write(token_ids.len() as u64);
        for pair in token_ids.chunks(2) {
            let lo = u64::from(pair[0].0);
            let hi = pair.get(1).map_or(0, |t| u64::from(t.0));
            h.write(lo | (hi << 32));
        }
        h.finish()
    }
}

/// Two independent 64-bit lanes and the number of words written.
struct Lanes {
    a: u64,
    b: u64,
    num_words: u64,
}

const A_MUL1: u64 = 0x9e37_79b1_85eb_ca87;
const A_MUL2: u64 = 0xc2b2_ae3d_27d4_eb4f;
const B_MUL1: u64 = 0xff51_afd7_ed55_8ccd;
const B_MUL2: u64 = 0xc4ce_b9fe_1a85_ec53;

impl Lanes {
    fn new() -> Self {
        Lanes {
            a: 0x2722_0a95_fe3d_7b1c,
            b: 0x5851_f42d_4c95_7f2d,
            num_words: 0,
        }
    }

    /// Mixes one word into both lanes. Each step is a bijection of the lane for a
    /// fixed word (add, rotate, multiply by an odd constant).
    fn write(&mut self, word: u64) {
        self.a = self
            .a
            .wrapping_add(word.wrapping_mul(A_MUL2))
            .rotate_left(31)
            .wrapping_mul(A_MUL1);
        self.b = self
            .b
            .wrapping_add(word.rotate_left(32).wrapping_mul(B_MUL2))
            .rotate_left(27)
            .wrapping_mul(B_MUL1);
        self.num_words += 1;
    }

    /// Writes a length and then the bytes, eight to a word, little-endian.
    fn write_bytes(&mut self, bytes: &[u8]) {
        self.write(bytes.len() as u64);
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write(u64::from_le_bytes(word));
        }
    }

    fn finish(self) -> BlockHash {
        let a = avalanche_a(self.a ^ self.num_words);
        let b = avalanche_b(self.b ^ self.num_words.rotate_left(32));
        BlockHash((u128::from(a) << 64) | u128::from(b))
    }
}

/// xxHash64's final avalanche.
fn avalanche_a(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(A_MUL2);
    h ^= h >> 29;
    h = h.wrapping_mul(0x1656_67b1_9e37_79f9);
    h ^ (h >> 32)
}

/// MurmurHash3's `fmix64`.
fn avalanche_b(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(B_MUL1);
    h ^= h >> 33;
    h = h.wrapping_mul(B_MUL2);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn toks(ids: &[u32]) -> Vec<TokenId> {
        ids.iter().copied().map(TokenId).collect()
    }

    #[test]
    fn hashes_are_pinned() {
        // Hashes must not change between runs, platforms or versions unnoticed.
        let root = BlockHash::root(None, None);
        let block = BlockHash::chain(root, &toks(&[1, 2, 3, 4]));
        let salted = BlockHash::root(Some(AdapterId(3)), Some("tenant"));
        assert_eq!(
            format!("{root:?}"),
            "BlockHash(c08d4d76a6e21808041f3090df5e7f59)"
        );
        assert_eq!(
            format!("{block:?}"),
            "BlockHash(f4108c18576c859cb45f2264ed6058dd)"
        );
        assert_eq!(
            format!("{salted:?}"),
            "BlockHash(4fda698deb9497fc00dfd9a36acb7020)"
        );
    }

    #[test]
    fn every_input_changes_the_hash() {
        let root = BlockHash::root(None, None);
        let variants = [
            root,
            BlockHash::root(Some(AdapterId(0)), None),
            BlockHash::root(Some(AdapterId(1)), None),
            BlockHash::root(None, Some("")),
            BlockHash::root(None, Some("a")),
            BlockHash::root(Some(AdapterId(1)), Some("a")),
            BlockHash::chain(root, &[]),
            BlockHash::chain(root, &toks(&[0])),
            BlockHash::chain(root, &toks(&[0, 0])),
            BlockHash::chain(root, &toks(&[1, 0])),
            BlockHash::chain(root, &toks(&[0, 1])),
            BlockHash::chain(BlockHash(1), &toks(&[0, 1])),
        ];
        let distinct: HashSet<_> = variants.iter().collect();
        assert_eq!(distinct.len(), variants.len());
    }

    #[test]
    fn no_collisions_among_many_small_blocks() {
        // All 4-token blocks over a 12-token vocabulary under two parents: 41,472 hashes.
        // Each 64-bit lane alone is collision-free here too.
        let (mut full, mut high, mut low) = (HashSet::new(), HashSet::new(), HashSet::new());
        for parent in [BlockHash::root(None, None), BlockHash(0)] {
            for n in 0..12u32.pow(4) {
                let ids = [n % 12, n / 12 % 12, n / 144 % 12, n / 1728];
                let h = BlockHash::chain(parent, &toks(&ids));
                assert!(full.insert(h.0), "collision at {ids:?}");
                assert!(
                    high.insert((h.0 >> 64) as u64),
                    "high-lane collision at {ids:?}"
                );
                assert!(low.insert(h.0 as u64), "low-lane collision at {ids:?}");
            }
        }
    }
}
