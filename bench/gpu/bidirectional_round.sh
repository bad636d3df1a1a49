#!/usr/bin/env bash
# Bidirectional attention on CUDA (issue 16): cuda-check, then a random
# checkpoint of EmbeddingGemma-300M's decoder shape (one KV head of 256,
# windows of 257 keys each way on 5 of 6 layers) against transformers on a
# 700-token prompt, every position from one step (bench/gpu/parity.py; its
# decode run has no decode steps: an encoder sees the whole prompt at once).
#   KILN=.device/kiln bench/gpu/bidirectional_round.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/bidirectional_round.sh OUT_DIR}; KILN=${KILN:-.device/kiln}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/bidirectional.log"; }
log cuda-check; "$KILN" dev cuda-check -o "$OUT/cuda-check.json" >> "$OUT/bidirectional.log" 2>&1 || log "FAILED cuda-check"
rm -rf "$W/ck-egemma"
"$KILN" dev random-checkpoint --preset tiny --config bench/gpu/shapes/embeddinggemma-300m.json --tokenizer "$TOK" -o "$W/ck-egemma" >> "$OUT/bidirectional.log" 2>&1 || log "FAILED checkpoint"
log parity
python3 bench/gpu/parity.py --kiln "$KILN" --ckpt "$W/ck-egemma" --tokens 700 --prefill 700 --cpu --out "$OUT/parity-embeddinggemma-300m.json" >> "$OUT/bidirectional.log" 2>&1 || log "FAILED parity"
log done
