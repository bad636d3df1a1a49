//! The delta rule's chunk-parallel form (`delta_chunk.cu`) for steps with
//! long sequences: four launches — the normalized q and k with the gates,
//! every chunk's `W` and `U` at once, each sequence's chunks in order
//! carrying the state, every chunk's outputs at once — over work arrays
//! freed when the step's kernels are done with them (the pool is stream
//! ordered). The chunk table is uploaded for the call, so a recorded step
//! never runs this form.

use std::sync::atomic::Ordering;

use cudarc::driver::LaunchConfig;
use kiln_tensor::recurrent::GatedDeltaNet;
use kiln_tensor::{ForwardBatch, Result};

use super::DeltaArgs;
use crate::backend::CudaBackend;
use crate::driver::device::dev_err;

/// Tokens a chunk (`DELTA_CHUNK`).
const CHUNK: usize = 64;
/// The widest keys the state kernel keeps (`DELTA_CHUNK_KMAX`).
const MAX_KEYS: usize = 128;
/// The widest values the output kernel takes (a thread a column).
const MAX_VALUES: usize = 256;
/// The form's kernels, each given [`MAX_SMEM`] of dynamic shared memory.
pub(super) const KERNELS: [&str; 3] = [
    "gated_delta_chunk_solve",
    "gated_delta_chunk_state",
    "gated_delta_chunk_out",
];
/// What the largest head the form takes asks of shared memory (the state
/// kernel's at 128 keys).
pub(super) const MAX_SMEM: usize = state_smem(MAX_KEYS);

/// The solve kernel's shared memory for a head of `kd` keys and `vd` values.
const fn solve_smem(kd: usize, vd: usize) -> usize {
    let rows = CHUNK * (kd + 1);
    let x = CHUNK * (kd + vd);
    4 * ((if rows > x { rows } else { x }) + CHUNK * CHUNK + 2 * CHUNK)
}

/// The state kernel's: partial sums, u, G and two staged [`CHUNK`] x `kd`
/// row blocks.
const fn state_smem(kd: usize) -> usize {
    4 * (9 * CHUNK * 32 + CHUNK + 2 * CHUNK * kd)
}

/// The output kernel's.
const fn out_smem(kd: usize, vd: usize) -> usize {
    let qk = 2 * CHUNK * (kd + 1);
    let u = CHUNK * vd;
    4 * ((if qk > u { qk } else { u }) + CHUNK * CHUNK + 9 * CHUNK)
}

/// Whether the form takes this layer's heads on this device now (not while
/// a step is being recorded: it uploads its chunk table).
pub(super) fn takes(cuda: &CudaBackend, g: &GatedDeltaNet) -> bool {
    g.k_dim <= MAX_KEYS
        && g.v_dim <= MAX_VALUES
        // (Rows staged in 16-byte pieces.)
        && g.k_dim.is_multiple_of(4)
        && g.v_dim.is_multiple_of(4)
        && !cuda.capturing.load(Ordering::Relaxed)
        && ["gated_delta_prep"]
            .iter()
            .chain(KERNELS.iter())
            .all(|k| cuda.dev.has(k))
}

/// The chunk table (sequence, first row, tokens, tokens of the sequence
/// before it; 4 `i32` a chunk) and then each sequence's first chunk (and
/// the count): the sequences' tokens cut into chunks of [`CHUNK`] from
/// their first.
fn chunk_table(batch: &ForwardBatch) -> (Vec<i32>, usize) {
    let mut chunks = Vec::new();
    let mut firsts = Vec::with_capacity(batch.seqs.len() + 1);
    for (i, seq) in batch.seqs.iter().enumerate() {
        firsts.push((chunks.len() / 4) as i32);
        let mut r = 0;
        while r < seq.num_tokens {
            let len = (seq.num_tokens - r).min(CHUNK);
            chunks.extend([i, seq.token_start + r, len, r].map(|v| v as i32));
            r += len;
        }
    }
    let num = chunks.len() / 4;
    firsts.push(num as i32);
    chunks.extend(firsts);
    (chunks, num)
}

pub(super) fn launch(cuda: &CudaBackend, a: &DeltaArgs, batch: &ForwardBatch) -> Result<()> {
    let g = a.g;
    let n = batch.num_tokens();
    let (table, num_chunks) = chunk_table(batch);
    if num_chunks == 0 {
        return Ok(());
    }
    let tb = cuda.dev.alloc(table.len(), 4, "the delta rule's chunks")?;
    cuda.dev.htod(tb.ptr, &table)?;
    let chunks = tb.ptr;
    let seq_chunks = tb.ptr + 16 * num_chunks as u64;
    let (kh, vh, kd, vd) = (g.k_heads, g.v_heads, g.k_dim, g.v_dim);
    let qk = cuda
        .dev
        .alloc(n * 2 * kh * kd, 4, "the delta rule's q and k")?;
    let gb = cuda.dev.alloc(n * 2 * vh, 4, "the delta rule's gates")?;
    let w = cuda.dev.alloc(n * vh * kd, 4, "the delta rule's W")?;
    let u = cuda.dev.alloc(n * vh * vd, 4, "the delta rule's U")?;
    let oi = cuda.dev.alloc(n * vh * vd, 4, "the delta rule's outputs")?;
    let (khi, vhi, kdi, vdi) = (kh as i32, vh as i32, kd as i32, vd as i32);

    let mut b = cuda.dev.launch(cuda.dev.func("gated_delta_prep")?);
    b.arg(&a.mixed)
        .arg(&a.mstride)
        .arg(&a.x)
        .arg(&a.x_stride)
        .arg(&a.b_col)
        .arg(&a.a_col)
        .arg(&a.a_log)
        .arg(&a.dt_bias)
        .arg(&khi)
        .arg(&vhi)
        .arg(&kdi)
        .arg(&qk.ptr)
        .arg(&gb.ptr);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: mixed [n, mstride] f32 with q | k first; x [n] rows with b and
    // a at their columns; qk [n, 2 kh kd] and gb [n, 2 vh] allocated above.
    unsafe { b.launch(cfg) }.map_err(dev_err)?;

    let mut b = cuda.dev.launch(cuda.dev.func("gated_delta_chunk_solve")?);
    b.arg(&a.mixed)
        .arg(&a.mstride)
        .arg(&khi)
        .arg(&vhi)
        .arg(&kdi)
        .arg(&vdi)
        .arg(&chunks)
        .arg(&qk.ptr)
        .arg(&gb.ptr)
        .arg(&w.ptr)
        .arg(&u.ptr);
    let cfg = LaunchConfig {
        grid_dim: (num_chunks as u32, vh as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: solve_smem(kd, vd) as u32,
    };
    // SAFETY: the chunk table covers rows < n; the work arrays as above,
    // W [n, vh, kd] and U [n, vh, vd]; shared memory as the kernel asks,
    // within MAX_SMEM (kd <= 128, vd <= 256).
    unsafe { b.launch(cfg) }.map_err(dev_err)?;

    let mut b = cuda.dev.launch(cuda.dev.func("gated_delta_chunk_state")?);
    b.arg(&qk.ptr)
        .arg(&gb.ptr)
        .arg(&w.ptr)
        .arg(&u.ptr)
        .arg(&oi.ptr)
        .arg(&khi)
        .arg(&vhi)
        .arg(&kdi)
        .arg(&vdi)
        .arg(&a.state)
        .arg(&a.slot_len)
        .arg(&a.conv_len)
        .arg(&a.seqs)
        .arg(&a.snaps)
        .arg(&a.num_seqs)
        .arg(&chunks)
        .arg(&seq_chunks);
    let cfg = LaunchConfig {
        grid_dim: (a.num_seqs as u32, vh as u32, (vd as u32).div_ceil(32)),
        block_dim: (256, 1, 1),
        shared_mem_bytes: state_smem(kd) as u32,
    };
    // SAFETY: as above; the state and sequence metadata as
    // `recurrent_mixer_with` checked them; oi [n, vh, vd].
    unsafe { b.launch(cfg) }.map_err(dev_err)?;

    let threads = (vd as u32).div_ceil(32) * 32;
    let mut b = cuda.dev.launch(cuda.dev.func("gated_delta_chunk_out")?);
    b.arg(&qk.ptr)
        .arg(&gb.ptr)
        .arg(&u.ptr)
        .arg(&oi.ptr)
        .arg(&a.x)
        .arg(&a.x_stride)
        .arg(&a.z_col)
        .arg(&a.norm)
        .arg(&g.eps)
        .arg(&khi)
        .arg(&vhi)
        .arg(&kdi)
        .arg(&vdi)
        .arg(&a.seqs)
        .arg(&chunks)
        .arg(&a.out);
    let cfg = LaunchConfig {
        grid_dim: (num_chunks as u32, vh as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: out_smem(kd, vd) as u32,
    };
    // SAFETY: as above; x has z at z_col; out [n, vh * vd] bf16; threads
    // <= 256 (vd <= 256), shared memory within MAX_SMEM.
    unsafe { b.launch(cfg) }.map_err(dev_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_are_cut_into_chunks_from_their_first_token() {
        let mut batch = ForwardBatch {
            block_size: 16,
            ..ForwardBatch::default()
        };
        for (len, computed) in [(130usize, 0usize), (1, 9), (64, 3)] {
            batch.push_seq(&vec![1; len], computed, vec![0; 12], true);
        }
        let (t, num) = chunk_table(&batch);
        assert_eq!(num, 5);
        assert_eq!(
            &t[..20],
            &[0, 0, 64, 0, 0, 64, 64, 64, 0, 128, 2, 128, 1, 130, 1, 0, 2, 131, 64, 0]
        );
        assert_eq!(&t[20..], &[0, 3, 4, 5]);
    }

    #[test]
    fn the_largest_head_fits_the_shared_memory_asked() {
        for (kd, vd) in [
            (MAX_KEYS, MAX_VALUES),
            (1, 1),
            (MAX_KEYS, 1),
            (1, MAX_VALUES),
        ] {
            assert!(solve_smem(kd, vd) <= MAX_SMEM, "{kd} {vd}");
            assert!(out_smem(kd, vd) <= MAX_SMEM, "{kd} {vd}");
            assert!(state_smem(kd) <= MAX_SMEM, "{kd}");
        }
        // Within what a Hopper or Ampere block may have (227 KiB / 163 KiB).
        assert!(MAX_SMEM <= 163 * 1024);
    }
}
