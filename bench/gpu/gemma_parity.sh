#!/usr/bin/env bash
# Gemma 3 on CUDA against transformers: random checkpoints of the 270M and 1B
# shapes (bench/gpu/shapes), 800-token prompts past the 512-token sliding
# window, prefill and decode paths (bench/gpu/parity.py).
#   KILN=.device/kiln bench/gpu/gemma_parity.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/gemma_parity.sh OUT_DIR}; KILN=${KILN:-.device/kiln}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"
for s in gemma3-270m gemma3-1b; do
  rm -rf "$W/ck-$s"
  "$KILN" dev random-checkpoint --preset tiny --config "bench/gpu/shapes/$s.json" --tokenizer "$TOK" -o "$W/ck-$s" >> "$OUT/gemma.log" 2>&1
  python3 bench/gpu/parity.py --kiln "$KILN" --ckpt "$W/ck-$s" --tokens 800 --prefill 700 --cpu --out "$OUT/parity-$s.json" >> "$OUT/gemma.log" 2>&1 || echo "FAILED $s" >> "$OUT/gemma.log"
done
