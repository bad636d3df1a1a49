//! A step's metadata as the kernels read it: one `u32` array uploaded once
//! per step (token ids, positions, cache slots of every KV group, each
//! row's sequence, every group's block tables padded to a fixed width,
//! prefill query tiles, logits rows, recurrent state slots and snapshots),
//! and the padding of decode batches to the sizes recorded as CUDA graphs.

use kiln_tensor::{ForwardBatch, SeqSlice};

/// Query rows per prefill attention tile (the flash kernel's launch rule).
pub const TILE_ROWS: usize = 128;

/// Batch sizes recorded as graphs; a decode batch is padded to the next.
pub const GRAPH_BUCKETS: &[usize] = &[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128];

/// Offsets (in `u32` words) of each array inside [`StepMeta::words`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepMeta {
    pub words: Vec<u32>,
    pub num_rows: usize,
    pub num_seqs: usize,
    /// Block-table entries per sequence (tables are padded to this).
    pub width: usize,
    /// KV groups: each has its slots and its tables.
    pub num_groups: usize,
    pub tok: usize,
    pub pos: usize,
    /// Group 0's slots; group `g`'s at [`StepMeta::slot_of`].
    pub slot: usize,
    pub row_seq: usize,
    /// Each row's sequence's last key this step (bidirectional attention
    /// reads up to it).
    pub row_end: usize,
    /// Group 0's tables; group `g`'s at [`StepMeta::tables_of`].
    pub tables: usize,
    pub tiles: usize,
    pub num_tiles: usize,
    pub logits: usize,
    pub num_logits: usize,
    /// Recurrent layers' sequences (`ops/recurrent`): 6 words a sequence
    /// (first row, rows, state slot, the slot it starts from, fresh, first
    /// snapshot; a padding sequence's slots `u32::MAX`), then the snapshot
    /// count; at `rec_snaps` the snapshots (token, slot), room for one a
    /// sequence at least so a decode step's layout does not depend on them.
    pub rec_seqs: usize,
    pub rec_snaps: usize,
    /// Every sequence has exactly one new row (a decode step).
    pub decode_only: bool,
    /// Most keys any row attends to (its position + 1).
    pub max_keys: usize,
}

/// Smallest power of two ≥ the longest block table, at least 8.
pub fn table_width(batch: &ForwardBatch) -> usize {
    let longest = batch
        .seqs
        .iter()
        .flat_map(|s| s.block_tables.iter().map(Vec::len))
        .max()
        .unwrap_or(0);
    longest.max(8).next_power_of_two()
}

/// The recorded batch size a decode batch of `n` sequences runs as.
pub fn bucket_for(n: usize) -> Option<usize> {
    GRAPH_BUCKETS.iter().copied().find(|&b| b >= n)
}

impl StepMeta {
    /// Where group `g`'s cache slots start.
    pub fn slot_of(&self, g: usize) -> usize {
        self.slot + g * self.num_rows
    }

    /// Where group `g`'s block tables start (`num_seqs` tables of `width`).
    pub fn tables_of(&self, g: usize) -> usize {
        self.tables + g * self.num_seqs * self.width
    }

    /// Lay out `batch` with block tables padded to `width` entries.
    pub fn build(batch: &ForwardBatch, width: usize) -> StepMeta {
        let n = batch.num_tokens();
        let s = batch.seqs.len();
        let groups = batch.slot_mapping.len().max(1);
        let mut words = Vec::with_capacity(
            (3 + groups) * n + groups * s * width + 2 * n + batch.logits_rows.len(),
        );
        let tok = words.len();
        words.extend_from_slice(&batch.token_ids);
        let pos = words.len();
        words.extend_from_slice(&batch.positions);
        let slot = words.len();
        for g in 0..groups {
            let start = words.len();
            if let Some(slots) = batch.slot_mapping.get(g) {
                words.extend(slots.iter().take(n));
            }
            words.resize(start + n, 0);
        }
        let row_seq = words.len();
        words.resize(row_seq + n, 0);
        for (i, seq) in batch.seqs.iter().enumerate() {
            let end = (seq.token_start + seq.num_tokens).min(n);
            words[row_seq + seq.token_start.min(end)..row_seq + end].fill(i as u32);
        }
        let row_end = words.len();
        words.resize(row_end + n, 0);
        for seq in &batch.seqs {
            let end = (seq.token_start + seq.num_tokens).min(n);
            let last = (seq.num_computed + seq.num_tokens).saturating_sub(1) as u32;
            words[row_end + seq.token_start.min(end)..row_end + end].fill(last);
        }
        let tables = words.len();
        for g in 0..groups {
            for seq in &batch.seqs {
                let start = words.len();
                if let Some(table) = seq.block_tables.get(g) {
                    words.extend(table.iter().take(width));
                }
                words.resize(start + width, 0);
            }
        }
        let tiles = words.len();
        // (keys attended by the tile's last row, first row, rows): the
        // kernel runs tiles in order, so the longest go first.
        let mut tile_list = Vec::new();
        for seq in &batch.seqs {
            let mut r = 0;
            while r < seq.num_tokens {
                let rows = (seq.num_tokens - r).min(TILE_ROWS);
                tile_list.push((seq.num_computed + r + rows, seq.token_start + r, rows));
                r += rows;
            }
        }
        tile_list.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let num_tiles = tile_list.len();
        for (_, first, rows) in tile_list {
            words.push(first as u32);
            words.push(rows as u32);
        }
        let logits = words.len();
        words.extend_from_slice(&batch.logits_rows);
        let rec_seqs = words.len();
        let mut snaps: Vec<u32> = Vec::new();
        for (i, seq) in batch.seqs.iter().enumerate() {
            let st = batch.seq_state(i);
            let pad = st.slot == u32::MAX;
            let fresh = seq.num_computed == 0 && st.restore_from.is_none();
            words.extend([
                seq.token_start as u32,
                seq.num_tokens as u32,
                st.slot,
                if pad {
                    u32::MAX
                } else {
                    st.restore_from.unwrap_or(st.slot)
                },
                fresh as u32,
                (snaps.len() / 2) as u32,
            ]);
            if !pad {
                for &(t, slot) in &st.snapshots {
                    snaps.extend([t as u32, slot]);
                }
            }
        }
        let num_snaps = snaps.len() / 2;
        words.push(num_snaps as u32);
        let rec_snaps = words.len();
        words.extend(snaps);
        words.resize(rec_snaps + 2 * num_snaps.max(s) + 1, 0);
        StepMeta {
            num_rows: n,
            num_seqs: s,
            width,
            num_groups: groups,
            tok,
            pos,
            slot,
            row_seq,
            row_end,
            tables,
            tiles,
            num_tiles,
            logits,
            num_logits: batch.logits_rows.len(),
            rec_seqs,
            rec_snaps,
            decode_only: !batch.seqs.is_empty() && batch.seqs.iter().all(|q| q.num_tokens == 1),
            max_keys: batch
                .positions
                .iter()
                .map(|&p| p as usize + 1)
                .max()
                .unwrap_or(0),
            words,
        }
    }
}

/// Whether `batch` is a decode step a recording can replay: one new token
/// per sequence, every one wanting logits, in order, and no adapter rows.
pub fn is_graphable(batch: &ForwardBatch) -> bool {
    // A step with adapters launches per its row groups: eager.
    !batch.seqs.is_empty()
        && batch.lora.is_empty()
        && batch.seqs.iter().enumerate().all(|(i, s)| {
            s.num_tokens == 1
                && s.token_start == i
                && !s.block_tables.is_empty()
                && s.block_tables.iter().all(|t| !t.is_empty())
        })
        && batch.logits_rows.len() == batch.seqs.len()
        && batch
            .logits_rows
            .iter()
            .enumerate()
            .all(|(i, &r)| r as usize == i)
}

/// `batch` (graphable) padded to `bucket` sequences: each padding sequence
/// is one token at position 0 whose key and value go to `scratch_block`,
/// a cache block no real sequence owns. With `stateful` (a model with
/// recurrent layers) every sequence names its state and the padding ones
/// none (slot `u32::MAX`: the recurrent kernels skip them).
pub fn pad_decode(
    batch: &ForwardBatch,
    bucket: usize,
    scratch_block: u32,
    stateful: bool,
) -> ForwardBatch {
    let mut out = batch.clone();
    if stateful {
        out.states = (0..batch.seqs.len()).map(|i| batch.seq_state(i)).collect();
        out.states.resize(
            bucket.max(batch.seqs.len()),
            kiln_tensor::SeqState {
                slot: u32::MAX,
                ..Default::default()
            },
        );
    }
    let groups = batch.slot_mapping.len().max(1);
    out.slot_mapping.resize(groups, Vec::new());
    for i in batch.seqs.len()..bucket {
        out.token_ids.push(0);
        out.positions.push(0);
        for slots in &mut out.slot_mapping {
            slots.push(scratch_block * batch.block_size as u32);
        }
        out.logits_rows.push(i as u32);
        out.seqs.push(SeqSlice {
            token_start: i,
            num_tokens: 1,
            num_computed: 0,
            block_tables: vec![vec![scratch_block]; groups],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_tensor::SeqState;

    fn batch() -> ForwardBatch {
        let mut b = ForwardBatch {
            block_size: 4,
            ..ForwardBatch::default()
        };
        b.push_seq(&[5, 6, 7], 2, vec![3, 9], true);
        b.push_seq(&[8], 6, vec![1, 2], true);
        b
    }

    #[test]
    fn layout_holds_every_array_at_its_offset() {
        let b = batch();
        let m = StepMeta::build(&b, 8);
        let w = &m.words;
        assert_eq!(&w[m.tok..m.tok + 4], &[5, 6, 7, 8]);
        assert_eq!(&w[m.pos..m.pos + 4], &[2, 3, 4, 6]);
        assert_eq!(&w[m.slot..m.slot + 4], &[14, 15, 36, 10]);
        assert_eq!(&w[m.row_seq..m.row_seq + 4], &[0, 0, 0, 1]);
        // Each row's sequence's last key: 2 cached + 3 new, 6 cached + 1 new.
        assert_eq!(&w[m.row_end..m.row_end + 4], &[4, 4, 4, 6]);
        assert_eq!(&w[m.tables..m.tables + 8], &[3, 9, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&w[m.tables + 8..m.tables + 10], &[1, 2]);
        assert_eq!(m.num_tiles, 2);
        assert_eq!(&w[m.tiles..m.tiles + 4], &[3, 1, 0, 3]);
        assert_eq!(&w[m.logits..m.logits + 2], &[2, 3]);
        assert!(!m.decode_only);
        assert_eq!(m.max_keys, 7);
    }

    #[test]
    fn long_prefills_split_into_tiles_of_at_most_128_rows_longest_first() {
        let mut b = ForwardBatch {
            block_size: 16,
            ..ForwardBatch::default()
        };
        let toks: Vec<u32> = (0..300).collect();
        b.push_seq(&toks, 0, (0..19).collect(), true);
        b.push_seq(&toks[..5], 400, (19..45).collect(), true);
        let m = StepMeta::build(&b, table_width(&b));
        assert_eq!(m.width, 32);
        let t = &m.words[m.tiles..m.tiles + 2 * m.num_tiles];
        // Keys of each tile's last row: 405, 300, 256, 128.
        assert_eq!(t, &[300, 5, 256, 44, 128, 128, 0, 128]);
    }

    #[test]
    fn decode_batches_pad_to_their_bucket_with_scratch_rows() {
        let mut b = ForwardBatch {
            block_size: 4,
            ..ForwardBatch::default()
        };
        b.push_seq(&[1], 5, vec![0, 2], true);
        b.push_seq(&[2], 0, vec![1], true);
        b.push_seq(&[3], 9, vec![3, 4, 5], true);
        assert!(is_graphable(&b));
        assert_eq!(bucket_for(3), Some(4));
        let p = pad_decode(&b, 4, 7, false);
        assert!(is_graphable(&p));
        assert_eq!(p.seqs.len(), 4);
        assert_eq!(p.slot_mapping[0][3], 28);
        assert_eq!(p.logits_rows, vec![0, 1, 2, 3]);
        let m = StepMeta::build(&p, table_width(&p));
        assert!(m.decode_only);
        // Same shape of metadata for any batch of the bucket and width.
        let mut q = b.clone();
        q.seqs[0].num_computed = 6;
        q.positions[0] = 6;
        let m2 = StepMeta::build(&pad_decode(&q, 4, 7, false), table_width(&p));
        assert_eq!(m.words.len(), m2.words.len());
        assert_eq!((m.tables, m.logits), (m2.tables, m2.logits));
    }

    #[test]
    fn recurrent_slots_and_snapshots_keep_one_layout_a_bucket() {
        let mut b = ForwardBatch {
            block_size: 4,
            ..ForwardBatch::default()
        };
        b.push_seq(&[1], 5, vec![0, 2], true);
        b.push_seq(&[2], 0, vec![1], true);
        b.push_seq(&[3], 9, vec![3, 4, 5], true);
        b.states = vec![
            SeqState {
                slot: 4,
                ..SeqState::default()
            },
            SeqState {
                slot: 0,
                restore_from: Some(2),
                snapshots: vec![(1, 5)],
            },
            SeqState {
                slot: 1,
                ..SeqState::default()
            },
        ];
        let p = pad_decode(&b, 4, 7, true);
        assert_eq!(p.states.len(), 4);
        assert_eq!(p.states[3].slot, u32::MAX);
        let m = StepMeta::build(&p, 8);
        let w = &m.words[m.rec_seqs..];
        // (first row, rows, slot, from, fresh, first snapshot) a sequence.
        assert_eq!(&w[..6], &[0, 1, 4, 4, 0, 0]);
        assert_eq!(&w[6..12], &[1, 1, 0, 2, 0, 0]);
        assert_eq!(&w[12..18], &[2, 1, 1, 1, 0, 1]);
        assert_eq!(&w[18..24], &[3, 1, u32::MAX, u32::MAX, 1, 1]);
        assert_eq!(w[24], 1);
        assert_eq!(m.rec_snaps, m.rec_seqs + 25);
        assert_eq!(&m.words[m.rec_snaps..m.rec_snaps + 2], &[1, 5]);
        // Without the snapshot the layout is the same.
        b.states[1].snapshots.clear();
        let m2 = StepMeta::build(&pad_decode(&b, 4, 7, true), 8);
        assert_eq!(m.words.len(), m2.words.len());
        assert_eq!(m2.words[m2.rec_seqs + 24], 0);
        // A batch without states names slot i for sequence i.
        let m3 = StepMeta::build(
            &pad_decode(
                &ForwardBatch {
                    states: Vec::new(),
                    ..b
                },
                4,
                7,
                true,
            ),
            8,
        );
        assert_eq!(m3.words[m3.rec_seqs + 6 + 2], 1);
    }

    #[test]
    fn each_kv_group_has_its_slots_and_tables() {
        let mut b = ForwardBatch {
            block_size: 4,
            ..ForwardBatch::default()
        };
        b.push_seq_groups(&[5, 6], 3, vec![vec![0, 1], vec![2, 3]], true);
        b.push_seq_groups(&[7], 0, vec![vec![4], vec![5]], true);
        let m = StepMeta::build(&b, 8);
        let w = &m.words;
        assert_eq!(m.num_groups, 2);
        assert_eq!(&w[m.slot_of(0)..m.slot_of(0) + 3], &[3, 4, 16]);
        assert_eq!(&w[m.slot_of(1)..m.slot_of(1) + 3], &[11, 12, 20]);
        assert_eq!(&w[m.tables_of(0)..m.tables_of(0) + 2], &[0, 1]);
        assert_eq!(w[m.tables_of(0) + 8], 4);
        assert_eq!(&w[m.tables_of(1)..m.tables_of(1) + 2], &[2, 3]);
        assert_eq!(w[m.tables_of(1) + 8], 5);
        assert_eq!(&w[m.row_seq..m.row_seq + 3], &[0, 0, 1]);
        // Padding keeps every group.
        let mut d = ForwardBatch {
            block_size: 4,
            ..ForwardBatch::default()
        };
        d.push_seq_groups(&[1], 5, vec![vec![0, 2], vec![1, 3]], true);
        let p = pad_decode(&d, 2, 9, false);
        assert!(is_graphable(&p));
        assert_eq!(p.slot_mapping, vec![vec![9, 36], vec![13, 36]]);
        assert_eq!(p.seqs[1].block_tables, vec![vec![9], vec![9]]);
    }

    #[test]
    fn prefill_or_partial_logits_are_not_graphable() {
        assert!(!is_graphable(&batch()));
        let mut b = ForwardBatch {
            block_size: 4,
            ..ForwardBatch::default()
        };
        b.push_seq(&[1], 5, vec![0, 2], false);
        assert!(!is_graphable(&b));
    }
}
