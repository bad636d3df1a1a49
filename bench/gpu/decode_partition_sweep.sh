#!/usr/bin/env bash
# Split decode attention's partition sizes on the Gemma-3-1B shape (one KV
# head: a step's grid is one row by one head, so the partitions alone fill
# the GPU), timed by batch-1 decode: KILN_DECODE_PARTITION_KEYS x
# KILN_DECODE_TARGET_BLOCKS, then cuda-check with the largest setting.
#   KILN=.device/kiln bench/gpu/decode_partition_sweep.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/decode_partition_sweep.sh OUT_DIR}; KILN=${KILN:-.device/kiln}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/sweep.log"; }
[ -f "$W/ck-gemma3-1b/config.json" ] || "$KILN" dev random-checkpoint --preset tiny --config bench/gpu/shapes/gemma3-1b.json --tokenizer "$TOK" -o "$W/ck-gemma3-1b" >> "$OUT/sweep.log" 2>&1
for round in 1 2; do
  for keys in 32 64 128 256; do
    for target in 256 64; do
      log "keys $keys target $target round $round"
      "$KILN" bench --device cuda -m "$W/ck-gemma3-1b" --prompt-tokens 1024 --gen-tokens 256 --runs 3 \
        --cuda-option "DECODE_PARTITION_KEYS=$keys" --cuda-option "DECODE_TARGET_BLOCKS=$target" \
        > "$OUT/decode-k$keys-t$target-r$round.json" 2>> "$OUT/sweep.log" || log FAILED
    done
  done
done
log "cuda-check keys 128 target 64"
"$KILN" dev cuda-check --cuda-option DECODE_PARTITION_KEYS=128 --cuda-option DECODE_TARGET_BLOCKS=64 -o "$OUT/cuda-check-k128-t64.json" >> "$OUT/sweep.log" 2>&1 || log "FAILED cuda-check"
log done
