//! FP8 products past the decode kernels' rows, on Hopper's FP8 tensor
//! cores through cuBLASLt's block-scaled GEMM (CUDA 12.9 and newer): the
//! weight's E4M3 codes as stored (a row's bodies are contiguous) under its
//! 1x128 scales (`blocks.rs` lays them out run-major, as this mode reads
//! them), times activations quantized the same way a row at a time
//! (`fp8.cu`'s `quant_e4m3_rows`), f32 accumulation, bf16 out. The best
//! algorithm a shape has is asked once and kept; a shape cuBLASLt has none
//! for (or a GPU without the mode) is answered `false` and the caller
//! dequantizes instead.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::{result as lt, sys};
use kiln_tensor::Result;

use crate::driver::device::{dev_err, Device, BLAS_WORKSPACE};

/// A cuBLASLt handle and the algorithms found for each shape.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    algos: Mutex<HashMap<Key, Option<sys::cublasLtMatmulAlgo_t>>>,
}

// SAFETY: the handle is used on the device's one stream, the map behind a lock.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Lt {
    /// A handle, or `None` where cuBLASLt is missing.
    pub(crate) fn new() -> Option<Lt> {
        // SAFETY: looks the library up without loading symbols.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        // The block-scaled modes came with cuBLASLt 12.9.
        // SAFETY: a plain query of the loaded library.
        if unsafe { sys::cublasLtGetVersion() } < 120900 {
            return None;
        }
        let handle = lt::create_handle().ok()?;
        Some(Lt {
            handle,
            algos: Mutex::new(HashMap::new()),
        })
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// Whether a part of `rows` weight rows goes to cuBLASLt: FP8 GEMMs want
/// their dimensions in multiples of 16 (a part of 36 rows found no
/// algorithm on an H100 and fell back; real models' parts are multiples of
/// 128).
pub(crate) fn fp8_rows_ok(rows: usize) -> bool {
    rows % 16 == 0
}

/// What an algorithm is chosen for: the shape, whether the output is
/// accumulated into, and each pointer's alignment.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    m: usize,
    n: usize,
    k: usize,
    ldc: usize,
    accumulate: bool,
    align: [u32; 4],
}

/// One FP8 product `out[n, m] (row stride ldc) = (x · sx) · (w · sw)ᵀ +
/// beta · out`: `w` `[m, k]` E4M3 with scales `[k / 128][m]`, `x` `[n, k]`
/// E4M3 with scales `[k / 128][n]`.
pub(crate) struct Fp8Product {
    pub w: u64,
    pub w_scales: u64,
    pub x: u64,
    pub x_scales: u64,
    pub out: u64,
    pub n: usize,
    pub k: usize,
    pub m: usize,
    pub ldc: usize,
    pub beta: f32,
}

/// The largest power of two (up to 256) dividing `p`.
fn alignment(p: u64) -> u32 {
    1 << p.trailing_zeros().min(8)
}

/// Descriptors freed on every path out.
struct Descs {
    op: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each created once below and freed once here.
        unsafe {
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.op);
        }
    }
}

fn set_desc<T>(
    d: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Option<()> {
    // SAFETY: `v` is the attribute's type, read during the call.
    unsafe { lt::set_matmul_desc_attribute(d, a, v as *const T as *const c_void, size_of::<T>()) }
        .ok()
}

/// `p`'s operation and layouts: column-major, as cuBLASLt sees it, out
/// (m × n) = op(A) op(B) with A the weight (k × m, transposed) and B the
/// activations (k × n), each under its 1x128 scales; `None` where the
/// library refuses any part (an older cuBLASLt without the mode).
fn descriptors(p: &Fp8Product) -> Option<Descs> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    use sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as VEC128;
    use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F, CUDA_R_8F_E4M3};
    let op =
        lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F).ok()?;
    let mut d = Descs {
        op,
        layouts: Vec::new(),
        pref: None,
    };
    let (t, n_) = (1i32, 0i32);
    set_desc(op, D::CUBLASLT_MATMUL_DESC_TRANSA, &t)?;
    set_desc(op, D::CUBLASLT_MATMUL_DESC_TRANSB, &n_)?;
    set_desc(op, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &VEC128)?;
    set_desc(op, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &VEC128)?;
    set_desc(op, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.w_scales)?;
    set_desc(op, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.x_scales)?;
    let (k, m, n) = (p.k as u64, p.m as u64, p.n as u64);
    for (ty, rows, cols, ld) in [
        (CUDA_R_8F_E4M3, k, m, p.k),
        (CUDA_R_8F_E4M3, k, n, p.k),
        (CUDA_R_16BF, m, n, p.ldc),
    ] {
        d.layouts
            .push(lt::create_matrix_layout(ty, rows, cols, ld as i64).ok()?);
    }
    Some(d)
}

/// Runs `p` on `dev`'s stream; `Ok(false)` when cuBLASLt has no algorithm
/// for it (nothing was launched).
pub(crate) fn fp8_product(dev: &Device, lt_: &Lt, p: &Fp8Product) -> Result<bool> {
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    if p.n == 0 || p.m == 0 {
        return Ok(true);
    }
    let key = Key {
        m: p.m,
        n: p.n,
        k: p.k,
        ldc: p.ldc,
        accumulate: p.beta != 0.0,
        align: [p.w, p.x, p.out, p.out].map(alignment),
    };
    let cached = lt_
        .algos
        .lock()
        .map_err(|_| dev_err("cuBLASLt algorithms"))?
        .get(&key)
        .copied();
    if cached == Some(None) {
        return Ok(false);
    }
    let Some(mut d) = descriptors(p) else {
        // Refused once: every later product of this shape is answered `false` at once.
        lt_.algos
            .lock()
            .map_err(|_| dev_err("cuBLASLt algorithms"))?
            .insert(key, None);
        return Ok(false);
    };
    let (op, a, b, c) = (d.op, d.layouts[0], d.layouts[1], d.layouts[2]);
    let algo = match cached {
        Some(a) => a,
        None => {
            let pref = lt::create_matmul_pref().map_err(dev_err)?;
            d.pref = Some(pref);
            let set = |attr: P, v: u64, size: usize| {
                // SAFETY: a u64 (workspace) or u32 (alignments) attribute, read during the call.
                unsafe {
                    lt::set_matmul_pref_attribute(
                        pref,
                        attr,
                        &v as *const u64 as *const c_void,
                        size,
                    )
                }
                .map_err(dev_err)
            };
            set(
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                BLAS_WORKSPACE as u64,
                8,
            )?;
            for (attr, al) in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ]
            .into_iter()
            .zip(key.align)
            {
                // (Little-endian: the u64's first four bytes are the u32.)
                set(attr, al as u64, 4)?;
            }
            // SAFETY: descriptors created above.
            let found = unsafe { lt::get_matmul_algo_heuristic(lt_.handle, op, a, b, c, c, pref) }
                .ok()
                .map(|h| h.algo);
            lt_.algos
                .lock()
                .map_err(|_| dev_err("cuBLASLt algorithms"))?
                .insert(key, found);
            found
        }
    };
    let Some(algo) = algo else {
        return Ok(false);
    };
    let alpha = 1f32;
    // SAFETY: w [m, k] and x [n, k] E4M3 with their [k / 128][m] and
    // [k / 128][n] f32 scales, out n rows of ldc >= m bf16 (the caller's
    // contract); the workspace is the device's, used on its one stream.
    unsafe {
        lt::matmul(
            lt_.handle,
            op,
            &alpha as *const f32 as *const c_void,
            &p.beta as *const f32 as *const c_void,
            p.w as *const c_void,
            a,
            p.x as *const c_void,
            b,
            p.out as *const c_void,
            c,
            p.out as *mut c_void,
            c,
            &algo,
            dev.workspace.ptr as *mut c_void,
            BLAS_WORKSPACE,
            dev.stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(dev_err)?;
    Ok(true)
}
