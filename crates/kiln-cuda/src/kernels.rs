//! Kiln's CUDA C sources, embedded in the binary: each op's kernels live
//! beside its launcher (`src/ops/<op>/<op>.cu`). Local `#include "x.cuh"`
//! lines are expanded from [`HEADERS`] before compilation, so NVRTC needs
//! no files of ours on disk.

use crate::{CompiledKernel, CudaError, KernelCompiler};

/// Headers that kernel sources include by name.
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("ops/common.cuh")),
    ("vec8.cuh", include_str!("ops/vec8.cuh")),
    (
        "rms_prologue.cuh",
        include_str!("ops/matmul/rms_prologue.cuh"),
    ),
    ("mma.cuh", include_str!("ops/matmul/mma.cuh")),
    (
        "block_parts.cuh",
        include_str!("ops/matmul/block_parts.cuh"),
    ),
    ("kv_elem.cuh", include_str!("ops/attention/kv_elem.cuh")),
    ("recurrent.cuh", include_str!("ops/recurrent/recurrent.cuh")),
];

/// Sources without which the backend does not start (the others' kernels
/// have fallbacks).
pub const REQUIRED: &[&str] = &[
    "gather",
    "norm",
    "activation",
    "elementwise",
    "rope_kv_write",
    "attention_reference",
];

/// Every kernel source: (name, CUDA C), each beside its op's launcher in
/// `src/ops/<op>/`.
pub const SOURCES: &[(&str, &str)] = &[
    ("gather", include_str!("ops/gather/gather.cu")),
    ("norm", include_str!("ops/norm/norm.cu")),
    ("activation", include_str!("ops/activation/activation.cu")),
    (
        "elementwise",
        include_str!("ops/elementwise/elementwise.cu"),
    ),
    (
        "rope_kv_write",
        include_str!("ops/rope_kv_write/rope_kv_write.cu"),
    ),
    (
        "attention_reference",
        include_str!("ops/attention/reference.cu"),
    ),
    ("attention_decode", include_str!("ops/attention/decode.cu")),
    (
        "attention_prefill",
        include_str!("ops/attention/prefill.cu"),
    ),
    ("matmul_gemv", include_str!("ops/matmul/gemv.cu")),
    ("matmul_blocks", include_str!("ops/matmul/blocks.cu")),
    ("matmul_fp8", include_str!("ops/matmul/fp8.cu")),
    ("argmax", include_str!("ops/argmax/argmax.cu")),
    ("sample", include_str!("ops/sample/sample.cu")),
    ("lora", include_str!("ops/lora/lora.cu")),
    ("moe", include_str!("ops/moe/moe.cu")),
    ("mla", include_str!("ops/mla/mla.cu")),
    ("recurrent", include_str!("ops/recurrent/recurrent.cu")),
    (
        "recurrent_chunk",
        include_str!("ops/recurrent/delta_chunk.cu"),
    ),
];

/// Every kernel the backend launches by name (the CI compile test checks
/// each is an entry point of the compiled sources).
pub const ENTRY_POINTS: &[&str] = &[
    "mla_query_bf16",
    "mla_kv_bf16",
    "mla_output_bf16",
    "embedding_bf16",
    "add_rms_norm_bf16",
    "gated_act_bf16",
    "rope_bf16",
    "write_kv_bf16",
    "add_scale_bf16",
    "softcap_bf16",
    "layer_norm_bf16",
    "gelu_erf_bf16",
    "lora_shrink_bf16",
    "lora_expand_bf16",
    "lora_expand_epi_bf16",
    "lora_expand8_bf16",
    "lora_expand8_epi_bf16",
    "lora_shrink_mma_bf16",
    "lora_expand_mma_bf16",
    "moe_route_bf16",
    "moe_group",
    "moe_route_group_bf16",
    "moe_gate_up_bf16",
    "moe_down_bf16",
    "moe_combine_bf16",
    "moe_gather_bf16",
    "moe_act_bf16",
    "moe_combine_sorted_bf16",
    "moe_gate_up_mxfp4",
    "moe_down_mxfp4",
    "add_bias_bf16",
    "gather_rows_bf16",
    "copy_cols_bf16",
    "paged_attention_bf16",
    "gemv_direct_bf16_m1",
    "gemv_direct_bf16_m2",
    "gemv_direct_bf16_m3",
    "gemv_direct_bf16_m4",
    "gemv_direct_bf16_m5",
    "gemv_direct_bf16_m6",
    "gemv_direct_bf16_m7",
    "gemv_direct_bf16_m8",
    "rms_norm_gemv_direct_bf16_m1",
    "rms_norm_gemv_direct_bf16_m2",
    "rms_norm_gemv_direct_bf16_m3",
    "rms_norm_gemv_direct_bf16_m4",
    "rms_norm_gemv_direct_bf16_m5",
    "rms_norm_gemv_direct_bf16_m6",
    "rms_norm_gemv_direct_bf16_m7",
    "rms_norm_gemv_direct_bf16_m8",
    "argmax_logprob_bf16",
    "argmax_logprob_masked_bf16",
    "sample_bf16",
    "qkv_rope_write_bf16",
    "gated_act_packed_bf16",
    "decode_attention_hd64",
    "decode_attention_hd128",
    "decode_attention_hd256",
    "decode_attention_vpre_hd64",
    "decode_attention_vpre_hd128",
    "decode_attention_vpre_hd256",
    "decode_attention_reduce_hd64",
    "decode_attention_reduce_hd128",
    "decode_attention_reduce_hd256",
    "flash_prefill_hd64",
    "flash_prefill_hd128",
    "flash_prefill_hd256",
    "quant_e4m3_rows",
    "write_kv_fp8",
    "qkv_rope_write_fp8",
    "paged_attention_fp8",
    "decode_attention_fp8_hd64",
    "decode_attention_fp8_hd128",
    "decode_attention_fp8_hd256",
    "decode_attention_vpre_fp8_hd64",
    "decode_attention_vpre_fp8_hd128",
    "decode_attention_vpre_fp8_hd256",
    "flash_prefill_fp8_hd64",
    "flash_prefill_fp8_hd128",
    "flash_prefill_fp8_hd256",
    "recurrent_conv",
    "recurrent_conv_rows",
    "recurrent_conv_state",
    "gated_delta_rule",
    "gated_delta_rule_k128",
    "gated_delta_prep",
    "gated_delta_chunk_solve",
    "gated_delta_chunk_state",
    "gated_delta_chunk_out",
];

/// The block formats with kernels, by kernel name: `qgemv_<fmt>_m1` …
/// `_m8` and `dequant_<fmt>_bf16` each — `matmul_blocks`'
/// (`ops/matmul/blocks.cu`, dp4a on integer codes), then `fp8`
/// (`ops/matmul/fp8.cu`, tensor cores).
pub const BLOCK_FORMATS: &[&str] = &[
    "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k", "q4_z", "q4_z32", "fp8",
];

/// Every block-weight kernel the backend launches by name.
pub fn block_entry_points() -> Vec<String> {
    BLOCK_FORMATS
        .iter()
        .flat_map(|f| {
            (1..=8)
                .map(move |m| format!("qgemv_{f}_m{m}"))
                .chain([format!("dequant_{f}_bf16")])
        })
        .collect()
}

/// `src` with its local includes expanded from [`HEADERS`].
pub fn expand(src: &str) -> String {
    crate::driver::compile::expand(src, HEADERS)
}

/// The compilation units: every source with its includes expanded, the
/// block formats' source once a format (`KILN_BLOCK_FMT` = its index in
/// [`BLOCK_FORMATS`], unit `matmul_blocks_<fmt>`), so that they compile and
/// load in parallel.
pub fn units() -> Vec<(String, String)> {
    SOURCES
        .iter()
        .flat_map(|&(name, src)| {
            let src = expand(src);
            match name {
                "matmul_blocks" => BLOCK_FORMATS
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| **f != "fp8")
                    .map(|(i, f)| {
                        (
                            format!("{name}_{f}"),
                            format!("#define KILN_BLOCK_FMT {i}\n{src}"),
                        )
                    })
                    .collect(),
                _ => vec![(name.to_string(), src)],
            }
        })
        .collect()
}

/// Every compilation unit ([`units`]) compiled by `compiler`, in parallel
/// (from its cache when possible), each with its unit's name.
pub fn compile_units(
    compiler: &KernelCompiler,
) -> Vec<(String, Result<CompiledKernel, CudaError>)> {
    use rayon::prelude::*;
    units()
        .into_par_iter()
        .map(|(name, src)| {
            let k = compiler.compile(&name, &src);
            (name, k)
        })
        .collect()
}

/// Every compilation unit compiled by `compiler`; the first error, if any.
pub fn compile_all(compiler: &KernelCompiler) -> Result<Vec<CompiledKernel>, CudaError> {
    compile_units(compiler)
        .into_iter()
        .map(|(_, k)| k)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_includes_are_expanded_and_system_ones_kept() {
        let s = expand(SOURCES[0].1);
        assert!(!s.contains("#include \"common.cuh\""));
        assert!(s.contains("__device__ __forceinline__ float block_sum"));
        assert!(s.contains("#include <cuda_bf16.h>"));
    }
}
