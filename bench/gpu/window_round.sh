#!/usr/bin/env bash
# Issue 16's sliding-window round on the H200, from the repo root: cuda-check
# (every attention kernel over two KV groups, a windowed layer's freed table
# entries naming another block), Gemma 3 against transformers past the
# 512-token window (270M and 1B shapes; prefill, decode and CPU paths), the
# engine with out-of-window blocks freed against `kiln generate`, Gemma-3-1B
# batch-1 decode, and its per-kernel times (ncu) when ncu is there.
#   KILN=.device/kiln bench/gpu/window_round.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/window_round.sh OUT_DIR}; KILN=${KILN:-.device/kiln}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/window.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null
log cuda-check; "$KILN" dev cuda-check -o "$OUT/cuda-check.json" >> "$OUT/window.log" 2>&1 || log "FAILED cuda-check"
log gemma parity; KILN="$KILN" WORK="$W" bench/gpu/gemma_parity.sh "$OUT"
log engine window
python3 bench/gpu/engine_window.py --kiln "$KILN" --ckpt "$W/ck-gemma3-270m" --out "$OUT/engine-window-270m.json" >> "$OUT/window.log" 2>&1 || log "FAILED engine window"
log gemma3-1b decode
"$KILN" bench --device cuda -m "$W/ck-gemma3-1b" --prompt-tokens 1024 --gen-tokens 256 --runs 3 > "$OUT/gemma3-1b-decode.json" 2>> "$OUT/window.log" || log "FAILED decode"
if [ -z "${NO_NCU:-}" ] && command -v ncu >/dev/null; then
  log ncu gemma3-1b decode kernels
  timeout 200 ncu --csv --metrics gpu__time_duration.sum --launch-skip 4000 --launch-count 800 \
    "$KILN" bench --device cuda -m "$W/ck-gemma3-1b" --prompt-tokens 512 --gen-tokens 24 --runs 0 \
    > "$OUT/ncu-gemma3-1b-decode.csv" 2>> "$OUT/window.log" || log "ncu FAILED"
fi
log done
