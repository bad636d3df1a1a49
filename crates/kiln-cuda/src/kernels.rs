//! Kiln's CUDA C sources, embedded in the binary. Local `#include "x.cuh"`
//! lines are expanded from [`HEADERS`] before compilation, so NVRTC needs
//! no files of ours on disk.

/// Headers that kernel sources include by name.
pub const HEADERS: &[(&str, &str)] = &[("common.cuh", include_str!("kernels/common.cuh"))];

/// Every kernel source: (name, CUDA C).
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("attention", include_str!("kernels/attention.cu")),
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
