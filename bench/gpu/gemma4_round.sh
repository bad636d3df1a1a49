#!/usr/bin/env bash
# Gemma 4 on the H200 against transformers (issue 16): cuda-check (attention
# over a pool wider than the layer, the value norm, attention_shared), then
# random checkpoints of the E2B text decoder's layer shape (15 layers: per-layer inputs, KV
# sharing, double-wide MLPs, 256/512 heads) and of the 31B's attention (K = V)
# at a small size: 800-token prompts past the 512-token window, Kiln CUDA
# prefill and decode paths and Kiln CPU against transformers bf16 and f32
# (bench/gpu/parity.py); the engine (blocks behind the window freed) against
# `kiln generate` (bench/gpu/engine_window.py); batch-1 decode of both shapes.
#   KILN=.device/kiln bench/gpu/gemma4_round.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/gemma4_round.sh OUT_DIR}; KILN=${KILN:-.device/kiln}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/gemma4.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$OUT/gpu.txt"
log cuda-check; "$KILN" dev cuda-check -o "$OUT/cuda-check.json" >> "$OUT/gemma4.log" 2>&1 || log "FAILED cuda-check"
for s in gemma4-keqv gemma4-e2b; do
  log "parity $s"
  rm -rf "$W/ck-$s"
  "$KILN" dev random-checkpoint --preset tiny --config "bench/gpu/shapes/$s.json" --tokenizer "$TOK" -o "$W/ck-$s" >> "$OUT/gemma4.log" 2>&1 || log "FAILED checkpoint $s"
  python3 bench/gpu/parity.py --kiln "$KILN" --ckpt "$W/ck-$s" --tokens 800 --prefill 700 ${CPU:---cpu} --out "$OUT/parity-$s.json" >> "$OUT/gemma4.log" 2>&1 || log "FAILED parity $s"
done
log "engine window gemma4-e2b"
python3 bench/gpu/engine_window.py --kiln "$KILN" --ckpt "$W/ck-gemma4-e2b" --out "$OUT/engine-window-gemma4-e2b.json" >> "$OUT/gemma4.log" 2>&1 || log "FAILED engine window"
for s in gemma4-keqv gemma4-e2b; do
  log "decode $s"
  "$KILN" bench --device cuda -m "$W/ck-$s" --prompt-tokens 1024 --gen-tokens 256 --runs 3 > "$OUT/decode-$s.json" 2>> "$OUT/gemma4.log" || log "FAILED decode $s"
done
log done
