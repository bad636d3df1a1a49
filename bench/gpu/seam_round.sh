#!/usr/bin/env bash
# Issue 16's GPU round, on the H200 from the repo root: the binary under test
# ($NEW) against the binary before the family/Weight/by-op reshaping ($OLD)
# in one lease, interleaved, on the Llama-3-8B shape (batch-1 decode, 4,096-token
# prefill, 64 concurrent requests); a Qwen3-8B shape (QK-norm) and a
# Gemma-3-1B shape (head_dim 256, sliding window 512 on 5 of 6 layers, GeGLU,
# post-norms) from `kiln dev random-checkpoint --config bench/gpu/shapes/*.json`;
# Gemma parity against transformers past the window (prefill and decode).
#
#   NEW=.device/kiln OLD=.device/kiln-old bench/gpu/seam_round.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/seam_round.sh OUT_DIR}
NEW=${NEW:-.device/kiln}; OLD=${OLD:-.device/kiln-old}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/seam.log"; }
j() { local name=$1; shift; log "$name: $*"; "$@" > "$OUT/$name.json" 2>> "$OUT/seam.log" || log "FAILED $name"; }
[ -f "$W/ck8b/READY" ] || j save8b python3 bench/gpu/hf_bench.py --stages save8b --cfg-dir "$TOK" --save-dir "$W/ck8b" --out "$OUT/save8b-meta.json"
[ -f "$W/ckq3/config.json" ] || j ckq3 "$NEW" dev random-checkpoint --preset llama3-8b --config bench/gpu/shapes/qwen3-8b.json --tokenizer "$TOK" -o "$W/ckq3"
# AB_ONLY=1: the 8B A/B alone (Gemma has its own round, bench/gpu/window_round.sh).
if [ -z "${AB_ONLY:-}" ]; then
  [ -f "$W/ckg1b/config.json" ] || j ckg1b "$NEW" dev random-checkpoint --preset tiny --config bench/gpu/shapes/gemma3-1b.json --tokenizer "$TOK" -o "$W/ckg1b"
  j parity-gemma3-1b python3 bench/gpu/parity.py --kiln "$NEW" --ckpt "$W/ckg1b" --tokens 800 --prefill 700 --out "$OUT/parity-gemma3-1b-full.json"
fi
for r in 1 2; do
  for b in NEW OLD; do
    bin=${!b}
    j "llama8b-decode-$b-$r" "$bin" bench --device cuda -m "$W/ck8b" --prompt-tokens 512 --gen-tokens 128 --runs 3
    j "qwen3-8b-decode-$b-$r" "$bin" bench --device cuda -m "$W/ckq3" --prompt-tokens 512 --gen-tokens 128 --runs 3
  done
done
for b in NEW OLD; do
  bin=${!b}
  j "llama8b-prefill4096-$b" "$bin" bench --device cuda -m "$W/ck8b" --prompt-tokens 4096 --gen-tokens 2 --runs 3
  j "llama8b-c64-$b" "$bin" bench-engine --device cuda -m "$W/ck8b" --concurrency 64 --prompt-tokens 128 --gen-tokens 128 --prefix-tokens 1000
done
[ -n "${AB_ONLY:-}" ] || j gemma3-1b-decode "$NEW" bench --device cuda -m "$W/ckg1b" --prompt-tokens 1024 --gen-tokens 256 --runs 3
log done
