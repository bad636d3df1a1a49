//! The CUDA backend's collectives for tensor parallelism
//! ([`kiln_tensor::Collectives`]): NCCL — one communicator a GPU, every
//! collective on the backend's stream, so a recorded step holds them —
//! or, to check the sharded path where only one GPU is lent, a
//! [`kiln_tensor::HostGroup`] (ranks on any GPUs, the same one included,
//! exchanging through host memory; steps run eagerly).

use cudarc::nccl::{result as nccl, sys as nccl_sys};
use kiln_tensor::{HostRank, Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{buf, wrap};

/// How a CUDA backend reaches the other ranks of its group.
pub enum CudaGroup {
    Host(HostRank),
    Nccl(NcclRank),
}

/// One rank's NCCL communicator.
pub struct NcclRank {
    comm: nccl_sys::ncclComm_t,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time; each rank's backend makes its calls from the thread running its
// step, in stream order.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

impl Drop for NcclRank {
    fn drop(&mut self) {
        // SAFETY: the communicator was made by `ncclCommInitAll` and is
        // not used after this.
        unsafe {
            let _ = nccl::comm_destroy(self.comm);
        }
    }
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> TensorError {
    TensorError::Device {
        backend: "nccl",
        message: format!("{what}: {e:?}"),
    }
}

/// Whether NCCL's library loads (`libnccl.so` on the library path).
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { nccl_sys::is_culib_present() }
}

/// One communicator for each of `ordinals` (GPU `ordinals[r]` is rank
/// `r`), made together by this process (`ncclCommInitAll`).
pub fn nccl_ranks(ordinals: &[usize]) -> Result<Vec<NcclRank>> {
    if !nccl_available() {
        return Err(nccl_err(
            "loading NCCL",
            "libnccl.so is not on the library path (LD_LIBRARY_PATH)",
        ));
    }
    let n = ordinals.len();
    let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
    let mut comms = vec![std::ptr::null_mut(); n];
    // SAFETY: `comms` and `devs` hold `n` entries each.
    unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, devs.as_ptr()) }
        .map_err(|e| nccl_err("ncclCommInitAll", e))?;
    Ok(comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| NcclRank {
            comm,
            rank,
            world: n,
        })
        .collect())
}

/// A fresh NCCL unique id: what the node that leads sends the others.
pub fn nccl_unique_id() -> Result<[u8; 128]> {
    if !nccl_available() {
        return Err(nccl_err(
            "loading NCCL",
            "libnccl.so is not on the library path",
        ));
    }
    let id = nccl::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

/// This process's communicators in a group of `world` ranks spread over
/// processes (nodes): GPU `ordinals[i]` is rank `first + i`; every process
/// passes the same `id` ([`nccl_unique_id`] of the leading node).
pub fn nccl_ranks_joining(
    ordinals: &[usize],
    world: usize,
    first: usize,
    id: [u8; 128],
) -> Result<Vec<NcclRank>> {
    if !nccl_available() {
        return Err(nccl_err(
            "loading NCCL",
            "libnccl.so is not on the library path",
        ));
    }
    let id = nccl_sys::ncclUniqueId {
        internal: id.map(|b| b as ::core::ffi::c_char),
    };
    let mut out = Vec::with_capacity(ordinals.len());
    nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
    for (i, &o) in ordinals.iter().enumerate() {
        let ctx =
            cudarc::driver::CudaContext::new(o).map_err(|e| nccl_err("a GPU's context", e))?;
        ctx.bind_to_thread()
            .map_err(|e| nccl_err("a GPU's context", e))?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; the id is the group's.
        unsafe { nccl::comm_init_rank(&mut comm, world as i32, id, (first + i) as i32) }
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        out.push(NcclRank {
            comm,
            rank: first + i,
            world,
        });
    }
    nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
    Ok(out)
}

impl CudaGroup {
    pub fn rank_world(&self) -> (usize, usize) {
        match self {
            CudaGroup::Host(r) => (r.rank, r.group.world()),
            CudaGroup::Nccl(r) => (r.rank, r.world),
        }
    }
}

impl CudaBackend {
    fn stream_ptr(&self) -> nccl_sys::cudaStream_t {
        self.dev.stream.cu_stream() as nccl_sys::cudaStream_t
    }

    pub(crate) fn group_all_reduce(&self, g: &CudaGroup, x: &Tensor) -> Result<Tensor> {
        match g {
            CudaGroup::Host(r) => r.all_reduce_sum(self, x),
            CudaGroup::Nccl(r) => {
                let n = x.num_elements();
                let out = self.alloc(n, "all-reduce")?;
                // SAFETY: both buffers hold `n` bf16 values on this
                // backend's device; the call is queued on its stream.
                unsafe {
                    nccl::all_reduce(
                        buf(x, "all_reduce_sum")?.ptr as *const _,
                        out.ptr as *mut _,
                        n,
                        nccl_sys::ncclDataType_t::ncclBfloat16,
                        nccl_sys::ncclRedOp_t::ncclSum,
                        r.comm,
                        self.stream_ptr(),
                    )
                }
                .map_err(|e| nccl_err("ncclAllReduce", e))?;
                Ok(wrap(x.shape().to_vec(), out))
            }
        }
    }

    pub(crate) fn group_all_gather_columns(
        &self,
        g: &CudaGroup,
        x: &Tensor,
        keep: &[usize],
    ) -> Result<Tensor> {
        let r = match g {
            CudaGroup::Host(r) => return r.all_gather_columns(self, x, keep),
            CudaGroup::Nccl(r) => r,
        };
        let (rows, width) = x.dims2("all_gather_columns")?;
        if keep.len() != r.world || keep.iter().any(|&k| k > width) {
            return Err(TensorError::Shape {
                op: "all_gather_columns",
                detail: format!("keep {keep:?} of {width} columns over {} ranks", r.world),
            });
        }
        let n = rows * width;
        let all = self.alloc(n * r.world, "all-gather")?;
        // SAFETY: `all` holds every rank's `n` values; queued on this
        // backend's stream.
        unsafe {
            nccl::all_gather(
                buf(x, "all_gather_columns")?.ptr as *const _,
                all.ptr as *mut _,
                n,
                nccl_sys::ncclDataType_t::ncclBfloat16,
                r.comm,
                self.stream_ptr(),
            )
        }
        .map_err(|e| nccl_err("ncclAllGather", e))?;
        let total: usize = keep.iter().sum();
        let out = self.alloc(rows * total, "gathered columns")?;
        let mut at = 0;
        for (rank, &k) in keep.iter().enumerate() {
            if k == 0 || rows == 0 {
                continue;
            }
            let copy = cudarc::driver::sys::CUDA_MEMCPY2D_st {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: all.ptr + (rank * n * 2) as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: width * 2,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: out.ptr + (at * 2) as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: total * 2,
                WidthInBytes: k * 2,
                Height: rows,
            };
            // SAFETY: the rectangle lies inside both buffers.
            let rc = unsafe {
                cudarc::driver::sys::cuMemcpy2DAsync_v2(&copy, self.dev.stream.cu_stream())
            };
            if rc != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                return Err(nccl_err("cuMemcpy2DAsync", rc));
            }
            at += k;
        }
        Ok(wrap(vec![rows, total], out))
    }
}
