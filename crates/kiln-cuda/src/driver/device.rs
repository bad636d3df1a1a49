//! The device: context, its one stream, loaded kernels,
//! cuBLAS, the memory pool, and typed launch helpers over raw pointers.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaStream, DeviceRepr, DriverError,
    LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use kiln_tensor::{DType, Result, Tensor, TensorError};

use super::compile::CompiledKernel;
use super::pool::{DevBuf, Pool};
use super::{driver_available, CudaError};

pub(crate) const NAME: &str = "cuda";

pub(crate) fn dev_err(e: impl std::fmt::Debug) -> TensorError {
    TensorError::Device {
        backend: NAME,
        message: format!("{e:?}"),
    }
}

/// cuBLAS workspace, set explicitly so recorded steps never allocate.
pub(crate) const BLAS_WORKSPACE: usize = 32 << 20;

pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub funcs: HashMap<String, CudaFunction>,
    pub pool: Arc<Pool>,
    pub name: String,
    /// The architecture NVRTC compiles for (`compute_90` on Hopper).
    pub arch: &'static str,
    /// The GPU's exact machine architecture (`sm_90`), where Kiln knows it.
    pub machine: Option<&'static str>,
    /// Kernels launched through [`Device::launch`] may start while the
    /// previous kernel finishes (programmatic dependent launch: sm_90 and
    /// newer, unless [`CudaOptions::pdl`] is off); every kernel waits for
    /// its inputs first.
    pub pdl: bool,
    /// Streaming multiprocessors.
    pub sms: usize,
    /// cuBLASLt (FP8 products), where the library is present.
    pub lt: Option<crate::ops::matmul::Lt>,
    /// cuBLAS's workspace, lent to cuBLASLt (one stream: never both at once).
    pub workspace: DevBuf,
}

impl Device {
    /// Opens GPU `ordinal` (compute capability 8.0 or newer) with its own
    /// stream, cuBLAS and the pool; `pdl` asks for programmatic dependent
    /// launch where the GPU has it. No kernels yet: [`Device::load`].
    pub fn open(ordinal: usize, pdl: bool) -> std::result::Result<Self, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        let gpu = |e: &dyn std::fmt::Debug| CudaError::Device(format!("GPU {ordinal}: {e:?}"));
        let ctx = CudaContext::new(ordinal).map_err(|e| gpu(&e))?;
        // One stream: ordering is the stream's; no per-buffer events (they
        // would also break recording steps as graphs).
        // SAFETY: every buffer is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(|e| gpu(&e))?;
        if major < 8 {
            return Err(CudaError::Device(format!(
                "GPU {ordinal} has compute capability {major}.{minor}; Kiln needs 8.0 or newer"
            )));
        }
        let arch = match (major, minor) {
            (9, _) => "compute_90",
            (8, 9) => "compute_89",
            (8, 6) => "compute_86",
            (8, _) => "compute_80",
            _ => "compute_90",
        };
        // Machine code only for an exact match (a newer GPU runs the PTX).
        let machine = match (major, minor) {
            (9, 0) => Some("sm_90"),
            (8, 9) => Some("sm_89"),
            (8, 6) => Some("sm_86"),
            (8, 0) => Some("sm_80"),
            _ => None,
        };
        let name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        // A stream of our own: the legacy default stream cannot be recorded.
        let stream = ctx.new_stream().map_err(|e| gpu(&e))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Device(format!("cuBLAS: {e:?}")))?;
        let pool = Pool::new(stream.clone());
        let workspace = pool
            .get_exact(BLAS_WORKSPACE)
            .ok_or_else(|| CudaError::Device("no memory for the cuBLAS workspace".into()))?;
        // SAFETY: the workspace outlives the handle (both live in `Device`).
        unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace.ptr as *mut c_void,
                BLAS_WORKSPACE,
            )
            .result()
            .map_err(|e| CudaError::Device(format!("cuBLAS workspace: {e:?}")))?;
        }
        let pdl = major >= 9 && pdl;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map(|n| n.max(1) as usize)
            .unwrap_or(132);
        Ok(Device {
            ctx,
            stream,
            blas,
            funcs: HashMap::new(),
            pool,
            name,
            arch,
            machine,
            pdl,
            sms,
            lt: crate::ops::matmul::Lt::new(),
            workspace,
        })
    }

    /// Loads compiled kernels: every entry point of their PTX becomes a
    /// function [`Device::func`] finds by name.
    /// The driver turns each module's PTX into machine code as it loads it;
    /// the modules load in parallel.
    pub fn load(&mut self, kernels: &[CompiledKernel]) -> std::result::Result<(), CudaError> {
        use rayon::prelude::*;
        let modules = kernels
            .par_iter()
            .map(|k| {
                // Machine code the driver refuses (an NVRTC newer than the
                // driver) falls back to the PTX.
                let binary = k
                    .cubin
                    .as_ref()
                    .and_then(|c| self.ctx.load_module(Ptx::from_binary(c.clone())).ok());
                binary
                    .map(Ok)
                    .unwrap_or_else(|| self.ctx.load_module(Ptx::from_src(k.ptx.clone())))
                    .map_err(|e| CudaError::Device(format!("loading {}: {e:?}", k.name)))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for (k, module) in kernels.iter().zip(modules) {
            for line in k.ptx.lines() {
                if let Some(rest) = line.trim().strip_prefix(".visible .entry ") {
                    let entry = rest.split('(').next().unwrap_or(rest).to_string();
                    let f = module
                        .load_function(&entry)
                        .map_err(|e| CudaError::Device(format!("{entry}: {e:?}")))?;
                    self.funcs.insert(entry, f);
                }
            }
        }
        Ok(())
    }

    /// A launch of `func` on the device's stream, with programmatic
    /// dependent launch where [`Device::pdl`] allows it.
    pub fn launch<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a> {
        Launch {
            dev: self,
            func,
            args: Vec::with_capacity(24),
        }
    }

    pub fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| dev_err(format!("kernel {name} not loaded")))
    }

    pub fn has(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    /// A pooled activation buffer of `elems` elements of `elem_bytes`.
    pub fn alloc(&self, elems: usize, elem_bytes: usize, what: &str) -> Result<DevBuf> {
        let bytes = (elems * elem_bytes).max(1);
        self.pool
            .get(bytes)
            .ok_or_else(|| TensorError::OutOfMemory {
                backend: NAME,
                bytes: bytes as u64,
                what: what.to_string(),
            })
    }

    /// An exact-size buffer (weights, caches).
    pub fn alloc_exact(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        self.pool
            .get_exact(bytes)
            .ok_or_else(|| TensorError::OutOfMemory {
                backend: NAME,
                bytes: bytes as u64,
                what: what.to_string(),
            })
    }

    /// An exact-size buffer set to zero on the stream: counters that
    /// kernels leave zeroed.
    pub fn alloc_zeroed(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        let buf = self.alloc_exact(bytes, what)?;
        // SAFETY: buf holds `bytes` bytes.
        unsafe { drv::memset_d8_async(buf.ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(dev_err)?;
        Ok(buf)
    }

    pub fn htod<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` holds at least `size_of_val(src)` bytes (callers
        // allocate it so); pageable sources are staged before this returns.
        unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(dev_err)
    }

    pub fn dtoh<T: Copy + Default>(&self, src: u64, n: usize) -> Result<Vec<T>> {
        let mut out = vec![T::default(); n];
        if n > 0 {
            // SAFETY: `src` holds `n` elements of T.
            unsafe { drv::memcpy_dtoh_async(&mut out, src, self.stream.cu_stream()) }
                .map_err(dev_err)?;
        }
        self.stream.synchronize().map_err(dev_err)?;
        Ok(out)
    }

    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges hold `bytes` bytes.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(dev_err)
    }

    /// Device-to-device copy bandwidth in GB/s, bytes read and written
    /// counted (the ceiling of a memory-bound kernel), best of three samples.
    /// Each sample times eight back-to-back 1 GiB copies: the host's launch
    /// and synchronize (~10 µs) would otherwise count against one ~0.5 ms
    /// copy and understate the bandwidth by ~2 %.
    pub fn copy_bandwidth_gbs(&self) -> Result<f64> {
        const BYTES: usize = 1 << 30;
        const COPIES: usize = 8;
        let a = self.alloc(BYTES, 1, "bandwidth probe")?;
        let b = self.alloc(BYTES, 1, "bandwidth probe")?;
        let mut best = f64::INFINITY;
        for i in 0..4 {
            self.synchronize()?;
            let t = std::time::Instant::now();
            for _ in 0..COPIES {
                self.dtod(b.ptr, a.ptr, BYTES)?;
            }
            self.synchronize()?;
            if i > 0 {
                best = best.min(t.elapsed().as_secs_f64());
            }
        }
        Ok(2.0 * (COPIES * BYTES) as f64 / best / 1e9)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev_err)
    }
}

/// A tensor's device buffer.
pub(crate) fn buf<'a>(t: &'a Tensor, op: &'static str) -> Result<&'a DevBuf> {
    t.storage()
        .downcast_ref::<DevBuf>()
        .ok_or(TensorError::WrongBackend { op, expected: NAME })
}

pub(crate) fn ptr(t: &Tensor, op: &'static str) -> Result<u64> {
    Ok(buf(t, op)?.ptr)
}

pub(crate) fn wrap(shape: Vec<usize>, b: DevBuf) -> Tensor {
    Tensor::from_storage(shape, DType::BF16, Arc::new(b))
}

pub(crate) fn to_bf16(data: &[f32]) -> Vec<bf16> {
    use rayon::prelude::*;
    data.par_iter().map(|&x| bf16::from_f32(x)).collect()
}

/// One block per row with `threads` threads.
pub(crate) fn rows_cfg(rows: usize, threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// A grid-stride launch over `n` elements.
pub(crate) fn elems_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A kernel launch being built: arguments by reference, in the kernel's
/// order, then [`Launch::launch`].
pub(crate) struct Launch<'a> {
    dev: &'a Device,
    func: &'a CudaFunction,
    args: Vec<*mut c_void>,
}

impl<'a> Launch<'a> {
    /// Adds the next argument (a device pointer as `u64`, or a scalar).
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Launches the kernel.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order
    /// and type, and every pointer must be valid for what the kernel does
    /// with it for as long as it runs.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> std::result::Result<(), DriverError> {
        self.dev.ctx.bind_to_thread()?;
        // SAFETY: a zeroed attribute is a valid value of the C union.
        let mut attr: drv_sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id =
            drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = drv_sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.dev.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.dev.pdl),
        };
        // SAFETY: the caller vouches for the arguments; `config` and `attr`
        // live through the call.
        drv_sys::cuLaunchKernelEx(
            &config,
            self.func.cu_function(),
            self.args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}
