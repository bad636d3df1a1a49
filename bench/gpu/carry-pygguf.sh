#!/usr/bin/env bash
# The gguf Python package (llama.cpp's gguf-py, the independent GGUF reader of
# bench/gguf_py_check.py) with its pure-Python needs, into .device/pygguf (about
# 5 MB) so that a GPU round can carry it (the GPU machine reaches no registry;
# numpy is there with PyTorch). Then: GGUFPY=1 bench/gpu/quant_round.sh OUT.
set -euo pipefail
dir=${1:-.device/pygguf}
[ -d "$dir/gguf" ] || python3 -m pip install --quiet --no-deps --target "$dir" gguf==0.19.0 pyyaml tqdm >&2
echo "$dir"
