//! Recurrent token mixers (`recurrent.cu`): the state beside the KV blocks
//! (f32, [`kiln_tensor::StateShape`]), the convolution with its past
//! inputs (token by token in decode steps, every row at once in longer
//! ones), and the gated delta rule — each sequence's tokens in order, as
//! the CPU reference runs them, or for long prefills in the chunk-parallel
//! form (`chunk.rs`); restores from and snapshots into other slots as
//! [`kiln_tensor::SeqState`] says.

use cudarc::driver::LaunchConfig;
use kiln_tensor::recurrent::{GatedDeltaNet, RecurrentMixer, ShortConv};
use kiln_tensor::{ForwardBatch, KvCache, Result, StateShape, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, wrap};
use crate::driver::pool::DevBuf;

mod chunk;

/// Most taps a convolution may have (`KILN_CONV_MAX_K`).
const MAX_KERNEL: usize = 8;
/// Threads of a conv block.
const CONV_THREADS: u32 = 128;
/// The most dynamic shared memory the delta rule asks for.
pub(crate) const DELTA_MAX_SMEM: usize = 200 * 1024;
/// The widest keys `gated_delta_rule_k128` takes (its `DELTA_KMAX`).
const DELTA_REG_KEYS: usize = 128;

/// A cache's recurrent state on the device.
pub(crate) struct CudaState {
    pub(crate) buf: DevBuf,
}

pub(crate) fn alloc_state(
    cuda: &CudaBackend,
    shape: StateShape,
) -> Result<Box<dyn std::any::Any + Send>> {
    let bytes = shape.bytes() as usize;
    let buf = cuda.dev.alloc_exact(bytes.max(4), "recurrent state")?;
    // SAFETY: buf holds at least `bytes` bytes; zero is 0.0f.
    unsafe {
        cudarc::driver::result::memset_d8_async(
            buf.ptr,
            0,
            bytes.max(4),
            cuda.dev.stream.cu_stream(),
        )
    }
    .map_err(dev_err)?;
    Ok(Box::new(CudaState { buf }))
}

/// A layer's small parameters on the device, uploaded on first use: conv
/// (then a_log, dt_bias and norm for a DeltaNet, [`delta_offsets`]), f32.
struct Params {
    buf: DevBuf,
}

fn params(cuda: &CudaBackend, mixer: &RecurrentMixer) -> Result<u64> {
    let (copy, parts): (_, Vec<&[f32]>) = match mixer {
        RecurrentMixer::GatedDeltaNet(g) => {
            (&g.device, vec![&g.conv, &g.a_log, &g.dt_bias, &g.norm])
        }
        RecurrentMixer::ShortConv(c) => (&c.device, vec![&c.conv]),
    };
    if let Some(p) = copy.get().and_then(|b| b.downcast_ref::<Params>()) {
        return Ok(p.buf.ptr);
    }
    let data: Vec<f32> = parts.concat();
    let buf = cuda
        .dev
        .alloc_exact(data.len().max(1) * 4, "recurrent layer parameters")?;
    cuda.dev.htod(buf.ptr, &data)?;
    let p = buf.ptr;
    // (A racing first use keeps the other copy; both hold the same values.)
    let _ = copy.set(Box::new(Params { buf }));
    Ok(copy
        .get()
        .and_then(|b| b.downcast_ref::<Params>())
        .map_or(p, |p| p.buf.ptr))
}

/// The offsets of a delta-rule layer's parameters in its copy.
fn delta_offsets(g: &GatedDeltaNet) -> [usize; 4] {
    let a = g.conv.len();
    [0, a, a + g.a_log.len(), a + g.a_log.len() + g.dt_bias.len()]
}

/// Every sequence's state slot, the slot it starts from and its
/// snapshots' slots lie in the pool and no two sequences (or snapshots)
/// name the same slot; padding sequences (slot `u32::MAX`) name none.
pub(crate) fn check_states(batch: &ForwardBatch, slots: usize) -> Result<()> {
    let mut named = Vec::new();
    for i in 0..batch.seqs.len() {
        let st = batch.seq_state(i);
        if st.slot == u32::MAX {
            continue;
        }
        let src = st.restore_from.unwrap_or(st.slot);
        if src as usize >= slots || st.slot as usize >= slots {
            return Err(TensorError::Shape {
                op: "recurrent_mixer",
                detail: format!("state slot {} (from {src}) of {slots}", st.slot),
            });
        }
        named.push(st.slot);
        named.extend(st.snapshots.iter().map(|x| x.1));
    }
    let mut sorted = named.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1])
        || sorted.last().is_some_and(|&s| s as usize >= slots)
    {
        return Err(TensorError::Shape {
            op: "recurrent_mixer",
            detail: format!("state slots {named:?} of {slots}"),
        });
    }
    Ok(())
}

pub(crate) fn recurrent_mixer(
    cuda: &CudaBackend,
    x: &Tensor,
    mixer: &RecurrentMixer,
    batch: &ForwardBatch,
    cache: &mut KvCache,
) -> Result<Tensor> {
    let kernel = DeltaKernel {
        registers: true,
        chunk_rows: cuda.options.delta_chunk_rows,
    };
    recurrent_mixer_with(cuda, x, mixer, batch, cache, kernel)
}

/// Which delta-rule kernel runs a step (cuda-check runs each, whatever the
/// options say).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeltaKernel {
    /// The register kernel where it takes the head (token order; always,
    /// but for cuda-check's runs of the shared-memory kernel at every
    /// shape: it serves keys wider than 128). On an H100 the 9B shape's
    /// decode runs 150.8 tok/s with it against 127.0.
    pub(crate) registers: bool,
    /// The chunk-parallel form when a sequence has at least this many new
    /// tokens (and the step is not being recorded).
    pub(crate) chunk_rows: usize,
}

/// A delta-rule launch's arguments, shared by the token-order kernels and
/// the chunk-parallel form: device pointers and the columns of z, b and a
/// in the packed projections `x`.
pub(crate) struct DeltaArgs<'a> {
    pub(crate) g: &'a GatedDeltaNet,
    pub(crate) mixed: u64,
    pub(crate) mstride: i32,
    pub(crate) x: u64,
    pub(crate) x_stride: i64,
    pub(crate) z_col: i32,
    pub(crate) b_col: i32,
    pub(crate) a_col: i32,
    pub(crate) a_log: u64,
    pub(crate) dt_bias: u64,
    pub(crate) norm: u64,
    pub(crate) state: u64,
    pub(crate) slot_len: i64,
    pub(crate) conv_len: i64,
    pub(crate) seqs: u64,
    pub(crate) snaps: u64,
    pub(crate) num_seqs: i32,
    pub(crate) out: u64,
}

/// [`recurrent_mixer`] with the delta rule's kernel chosen by `kernel`.
pub(crate) fn recurrent_mixer_with(
    cuda: &CudaBackend,
    x: &Tensor,
    mixer: &RecurrentMixer,
    batch: &ForwardBatch,
    cache: &mut KvCache,
    kernel: DeltaKernel,
) -> Result<Tensor> {
    let (n, d) = x.dims2("recurrent_mixer")?;
    if d != mixer.in_dim() || n != batch.num_tokens() {
        return Err(TensorError::Shape {
            op: "recurrent_mixer",
            detail: format!(
                "input [{n}, {d}] for {} tokens of {} columns",
                batch.num_tokens(),
                mixer.in_dim()
            ),
        });
    }
    let Some((shape, storage)) = cache.state_mut() else {
        return Err(TensorError::Shape {
            op: "recurrent_mixer",
            detail: "a cache without recurrent state".into(),
        });
    };
    let state = storage
        .downcast_ref::<CudaState>()
        .ok_or(TensorError::WrongBackend {
            op: "recurrent_mixer",
            expected: "cuda",
        })?
        .buf
        .ptr;
    let (conv, rec) = mixer.state();
    if shape.conv != conv || shape.recurrent != rec || mixer.state_layer() >= shape.num_layers {
        return Err(TensorError::Shape {
            op: "recurrent_mixer",
            detail: format!("{} state ({conv}, {rec}) against {shape:?}", mixer.name()),
        });
    }
    let layer_state = state + 4 * shape.offset(mixer.state_layer(), 0) as u64;
    let slot_len = shape.per_slot() as i64;
    let out = cuda.alloc(n * mixer.out_dim(), "a recurrent mixer's output")?;
    if n == 0 {
        return Ok(wrap(vec![0, mixer.out_dim()], out));
    }
    // The sequences' slots and snapshots: in the step's metadata
    // (`StepMeta::rec_seqs`), so recorded steps replay with each step's.
    check_states(batch, shape.num_slots)?;
    let step = cuda.step_meta(batch)?;
    let seqs_ptr = step.base + 4 * step.meta.rec_seqs as u64;
    let snaps_ptr = step.base + 4 * step.meta.rec_snaps as u64;
    let num_seqs = batch.seqs.len() as i32;
    let p = params(cuda, mixer)?;
    let xp = ptr(x, "recurrent_mixer")?;
    let x_stride = d as i64;
    let conv_launch = |k: usize, channels: usize, mode: i32, f32_out: u64, bf16_out: u64| {
        if k == 0 || k > MAX_KERNEL {
            return Err(TensorError::Shape {
                op: "recurrent_mixer",
                detail: format!("a convolution of {k} taps (at most {MAX_KERNEL})"),
            });
        }
        let (ki, ci) = (k as i32, channels as i32);
        let col_blocks = (channels as u32).div_ceil(CONV_THREADS);
        let per_seq = LaunchConfig {
            grid_dim: (batch.seqs.len() as u32, col_blocks, 1),
            block_dim: (CONV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // Decode steps (recorded): each sequence's token after its window.
        // Longer steps: every row at once, then the windows kept.
        let parallel = !step.meta.decode_only && cuda.dev.has("recurrent_conv_state");
        if !parallel {
            let mut b = cuda.dev.launch(cuda.dev.func("recurrent_conv")?);
            b.arg(&xp)
                .arg(&x_stride)
                .arg(&p)
                .arg(&ki)
                .arg(&ci)
                .arg(&mode)
                .arg(&layer_state)
                .arg(&slot_len)
                .arg(&seqs_ptr)
                .arg(&snaps_ptr)
                .arg(&num_seqs)
                .arg(&f32_out)
                .arg(&bf16_out);
            // SAFETY: x [n, d] bf16 with rows of b | c | x (mode 1) or the
            // conv's channels first (mode 0); the params' first
            // `channels * k` f32 are the taps; the state of `shape` at
            // `layer_state`; the metadata as `StepMeta::build` laid it out;
            // the output [n, channels].
            return unsafe { b.launch(per_seq) }.map_err(dev_err);
        }
        let row_seq = step.base + 4 * step.meta.row_seq as u64;
        let mut b = cuda.dev.launch(cuda.dev.func("recurrent_conv_rows")?);
        b.arg(&xp)
            .arg(&x_stride)
            .arg(&p)
            .arg(&ki)
            .arg(&ci)
            .arg(&mode)
            .arg(&layer_state)
            .arg(&slot_len)
            .arg(&seqs_ptr)
            .arg(&row_seq)
            .arg(&f32_out)
            .arg(&bf16_out);
        let rows = LaunchConfig {
            grid_dim: (n as u32, col_blocks, 1),
            block_dim: (CONV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; row_seq one word a row of the step.
        unsafe { b.launch(rows) }.map_err(dev_err)?;
        let mut b = cuda.dev.launch(cuda.dev.func("recurrent_conv_state")?);
        b.arg(&xp)
            .arg(&x_stride)
            .arg(&ki)
            .arg(&ci)
            .arg(&mode)
            .arg(&layer_state)
            .arg(&slot_len)
            .arg(&seqs_ptr)
            .arg(&snaps_ptr)
            .arg(&num_seqs);
        // SAFETY: as above; writes only the sequences' and snapshots'
        // slots, which `check_states` found distinct.
        unsafe { b.launch(per_seq) }.map_err(dev_err)
    };
    match mixer {
        RecurrentMixer::ShortConv(ShortConv { dim, kernel, .. }) => {
            conv_launch(*kernel, *dim, 1, 0, out.ptr)?;
        }
        RecurrentMixer::GatedDeltaNet(g) => {
            let cd = g.conv_dim();
            let mixed = cuda.dev.alloc(n * cd, 4, "the DeltaNet's convolution")?;
            conv_launch(g.kernel, cd, 0, mixed.ptr, 0)?;
            let [_, a_log, dt_bias, norm] = delta_offsets(g).map(|o| p + 4 * o as u64);
            let (vh, vd) = (g.v_heads as i32, g.v_dim as i32);
            let z_col = cd as i32;
            let args = DeltaArgs {
                g,
                mixed: mixed.ptr,
                mstride: cd as i32,
                x: xp,
                x_stride,
                z_col,
                b_col: z_col + vh * vd,
                a_col: z_col + vh * vd + vh,
                a_log,
                dt_bias,
                norm,
                state: layer_state,
                slot_len,
                conv_len: conv as i64,
                seqs: seqs_ptr,
                snaps: snaps_ptr,
                num_seqs,
                out: out.ptr,
            };
            let long = batch.seqs.iter().any(|q| q.num_tokens >= kernel.chunk_rows);
            if long && chunk::takes(cuda, g) {
                chunk::launch(cuda, &args, batch)?;
            } else {
                token_order(cuda, &args, kernel.registers)?;
            }
        }
    }
    Ok(wrap(vec![n, mixer.out_dim()], out))
}

/// The delta rule token by token: the register kernel where it takes the
/// head and `registers` asks for it, else the shared-memory one.
fn token_order(cuda: &CudaBackend, a: &DeltaArgs, registers: bool) -> Result<()> {
    let g = a.g;
    let threads = (g.v_dim as u32).div_ceil(32).max(1) * 32;
    let smem = (g.k_dim * g.v_dim + 2 * g.k_dim) * 4;
    if threads > 1024 || smem > DELTA_MAX_SMEM {
        return Err(TensorError::Unsupported {
            backend: "cuda",
            what: format!(
                "DeltaNet heads of {} x {} (at most 1024 value dims and {} KiB of state)",
                g.k_dim,
                g.v_dim,
                DELTA_MAX_SMEM / 1024
            ),
        });
    }
    // Keys of up to 128 with up to 256 value dims: the state in registers
    // (`gated_delta_rule_k128`) when asked; else in shared memory.
    let regs = registers
        && g.k_dim <= DELTA_REG_KEYS
        && threads <= 256
        && cuda.dev.has("gated_delta_rule_k128");
    let (name, smem) = match regs {
        true => (
            "gated_delta_rule_k128",
            ((threads as usize / 32) * 2 * DELTA_REG_KEYS + 64) * 4,
        ),
        false => ("gated_delta_rule", smem),
    };
    let func = cuda.dev.func(name)?;
    let (kh, vh, kd, vd) = (
        g.k_heads as i32,
        g.v_heads as i32,
        g.k_dim as i32,
        g.v_dim as i32,
    );
    let mut b = cuda.dev.launch(func);
    b.arg(&a.mixed)
        .arg(&a.mstride)
        .arg(&a.x)
        .arg(&a.x_stride)
        .arg(&a.z_col)
        .arg(&a.b_col)
        .arg(&a.a_col)
        .arg(&a.a_log)
        .arg(&a.dt_bias)
        .arg(&a.norm)
        .arg(&g.eps)
        .arg(&kh)
        .arg(&vh)
        .arg(&kd)
        .arg(&vd)
        .arg(&a.state)
        .arg(&a.slot_len)
        .arg(&a.conv_len)
        .arg(&a.seqs)
        .arg(&a.snaps)
        .arg(&a.num_seqs)
        .arg(&a.out);
    let cfg = LaunchConfig {
        grid_dim: (a.num_seqs as u32, g.v_heads as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: mixed [n, cd] f32 written by the convolution; x [n, in_dim]
    // bf16 with z, b, a at their columns; the params at their offsets; the
    // state and metadata as `recurrent_mixer_with` checked them; out
    // [n, v_heads * v_dim].
    unsafe { b.launch(cfg) }.map_err(dev_err)
}

/// Raises the delta rule's dynamic shared memory limit; a GPU that cannot
/// give it loses the kernel (hybrid models then refuse to load), with a
/// warning.
pub(crate) fn configure(dev: &mut crate::driver::device::Device, warnings: &mut Vec<String>) {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    dev.funcs.retain(|entry, f| {
        let bytes = match entry.as_str() {
            "gated_delta_rule" => DELTA_MAX_SMEM,
            e if chunk::KERNELS.contains(&e) => chunk::MAX_SMEM,
            _ => return true,
        };
        match f.set_attribute(attr, bytes as i32) {
            Ok(()) => true,
            Err(e) => {
                warnings.push(format!("{entry} unavailable: {e:?}"));
                false
            }
        }
    });
}
