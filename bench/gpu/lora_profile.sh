#!/usr/bin/env bash
# Where a LoRA decode step's time goes on the GPU machine (8B shape, 64 rows, 8 rank-16 adapters):
# bench-engine base with graphs / base eager (KILN_CUDA_GRAPHS=0) / one adapter / eight adapters,
# then ncu's per-kernel time over a few decode steps of the eight-adapter run.
#   KILN=.device/kiln bench/gpu/lora_profile.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/lora_profile.sh OUT_DIR}
KILN=${KILN:-.device/kiln}; W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"; OUT=$(cd "$OUT" && pwd)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0} PYTHONUNBUFFERED=1
LOG="$OUT/profile.log"
log() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
[ -f "$W/ck8b/READY" ] || python3 bench/gpu/hf_bench.py --stages save8b --cfg-dir "$TOK" --save-dir "$W/ck8b" --out "$OUT/save8b.json" >> "$LOG" 2>&1
[ -f "$W/lora8b-7/adapter_config.json" ] || python3 bench/gpu/make_lora.py --ckpt "$W/ck8b" --out "$W/lora8b-" --count 8 --rank 16 --alpha 32 >> "$LOG" 2>&1
L8=""; for i in 0 1 2 3 4 5 6 7; do L8="$L8 --lora $W/lora8b-$i"; done
B="$KILN bench-engine --device cuda -m $W/ck8b --concurrency 64 --prompt-tokens 256 --prefix-tokens 16 --kv-mib 16384"
log base-graphs;  $B --gen-tokens 64 > "$OUT/base.json" 2>> "$LOG"
log base-eager;   KILN_CUDA_GRAPHS=0 $B --gen-tokens 64 > "$OUT/base-eager.json" 2>> "$LOG"
log lora-1;       $B --gen-tokens 64 --lora "$W/lora8b-0" > "$OUT/lora1.json" 2>> "$LOG"
# shellcheck disable=SC2086
log lora-8;       $B --gen-tokens 64 $L8 > "$OUT/lora8.json" 2>> "$LOG"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
log "ncu $NCU"
# shellcheck disable=SC2086
timeout 300 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  --launch-skip 0 --launch-count 6000 \
  $KILN bench-engine --device cuda -m $W/ck8b --concurrency 64 --prompt-tokens 32 --gen-tokens 6 --kv-mib 4096 $L8 \
  > "$OUT/ncu-lora8.csv" 2>> "$LOG"
KILN_CUDA_GRAPHS=0 timeout 200 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  --launch-skip 0 --launch-count 6000 \
  $KILN bench-engine --device cuda -m $W/ck8b --concurrency 64 --prompt-tokens 32 --gen-tokens 6 --kv-mib 4096 \
  > "$OUT/ncu-base-eager.csv" 2>> "$LOG"
log done
