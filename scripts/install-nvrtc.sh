#!/usr/bin/env bash
# Install NVRTC and the CUDA headers from PyPI (CUDA 13.0 wheels) into DIR
# (default ~/.cache/kiln/cuda), for compiling Kiln's kernels where there is
# no CUDA toolkit. Prints the directory. Pinned to 13.0.x: a newer NVRTC
# emits PTX that the CUDA 13.0 driver on the GPU machines rejects.
set -euo pipefail
dir=${1:-${KILN_CUDA_HOME:-$HOME/.cache/kiln/cuda}}
if [ ! -f "$dir/nvidia/cu13/lib/libnvrtc.so.13" ] || [ ! -f "$dir/nvidia/cu13/include/cuda_bf16.h" ]; then
  mkdir -p "$dir"
  python3 -m pip install --quiet --no-deps --target "$dir" \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 >&2
fi
echo "$dir"
