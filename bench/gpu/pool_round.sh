#!/usr/bin/env bash
# Issue 24 on the GPU: what running the engine in its own process costs on a
# Llama-3-8B-shaped random bf16 checkpoint (`kiln dev random-checkpoint --preset llama3-8b`,
# SmolLM2 tokenizer): `kiln serve --isolation process` against `--isolation thread`, batch 1
# (bench/isolation_bench.py: decode tok/s from the median TPOT and the median TTFT, 512 tokens
# in, 128 out, modes alternated over ROUNDS fresh servers).
#   KILN=.device/kiln bench/gpu/pool_round.sh OUT_DIR [ROUNDS]
set -uo pipefail
OUT=${1:?usage: bench/gpu/pool_round.sh OUT_DIR [ROUNDS]}; K=${KILN:-.device/kiln}; W=${WORK:-$PWD/target/kiln-w}
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ -f "$W/ck8b/config.json" ] || timeout 150 "$K" dev random-checkpoint --preset llama3-8b --proj-std 0.01 \
  --tokenizer bench/smollm2-tokenizer -o "$W/ck8b" > /dev/null 2>&1
timeout 500 python3 bench/isolation_bench.py --kiln "$K" --model "$W/ck8b" --device cuda --vocab 49152 \
  --input-len 512 --output-len 128 --rounds "${2:-2}" --out "$OUT/isolation-8b.json"
echo "isolation rc=$?"
