//! Kiln's CUDA C sources, embedded in the binary. Local `#include "x.cuh"`
//! lines are expanded from [`HEADERS`] before compilation, so NVRTC needs
//! no files of ours on disk.

/// Headers that kernel sources include by name.
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("rms_prologue.cuh", include_str!("kernels/rms_prologue.cuh")),
    ("mma.cuh", include_str!("kernels/mma.cuh")),
];

/// Sources without which the backend does not start.
pub const REQUIRED: &[&str] = &["elementwise", "attention"];

/// Every kernel source: (name, CUDA C).
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("attention", include_str!("kernels/attention.cu")),
    ("argmax", include_str!("kernels/argmax.cu")),
    ("gemv_direct", include_str!("kernels/gemv_direct.cu")),
    ("fused", include_str!("kernels/fused.cu")),
    ("flash", include_str!("kernels/flash.cu")),
    ("sample", include_str!("kernels/sample.cu")),
];

/// Every kernel the backend launches by name (the CI compile test checks
/// each is an entry point of the compiled sources).
pub const ENTRY_POINTS: &[&str] = &[
    "embedding_bf16",
    "add_rms_norm_bf16",
    "gated_act_bf16",
    "rope_bf16",
    "write_kv_bf16",
    "add_scale_bf16",
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
];

/// `src` with its local includes expanded (once each).
pub fn expand(src: &str) -> String {
    let mut out = String::with_capacity(src.len() + 4096);
    for line in src.lines() {
        let included = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'))
            .and_then(|name| HEADERS.iter().find(|(h, _)| *h == name));
        match included {
            Some((_, header)) => {
                out.push_str(&header.replace("#pragma once", ""));
                out.push('\n');
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
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
