#!/usr/bin/env bash
# Batch-1 decode of a random checkpoint of one shape (bench/gpu/shapes/SHAPE.json, or a checkpoint
# already at $WORK/SHAPE) on CUDA and ncu's time per kernel over a window of decode launches,
# summed by kernel (printed: the machine returns few files).
# KILN=.device/kiln bench/gpu/decode_prof.sh OUT_DIR SHAPE [PROMPT_TOKENS]
set -uo pipefail
OUT=${1:?usage: bench/gpu/decode_prof.sh OUT_DIR SHAPE [PROMPT_TOKENS]}; S=${2:?shape}; P=${3:-1024}
K=${KILN:-.device/kiln}; W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f "$W/$S/config.json" ] || timeout 200 "$K" dev random-checkpoint --preset tiny --config "bench/gpu/shapes/$S.json" \
  --tokenizer "$TOK" -o "$W/$S" > "$OUT/ckpt-$S.log" 2>&1 || { echo "checkpoint $S failed"; tail -c 600 "$OUT/ckpt-$S.log"; }
timeout 200 "$K" bench --device cuda -m "$W/$S" --prompt-tokens "$P" --gen-tokens 256 --runs 3 > "$OUT/decode-$S.json" 2> "$OUT/decode-$S.err"
python3 -c "
import json; d=json.load(open('$OUT/decode-$S.json'))
print('$S decode', [round(x,1) for x in d['decode_tokens_per_second'].get('runs', [])], 'median', round(d['decode_tokens_per_second']['median'],1),
      'fraction', round(d['decode_fraction_of_bandwidth'],4), 'bytes/token', d['decode_weight_bytes_per_token'], 'copy GB/s', d['bandwidth_gbs'])" \
  || tail -c 800 "$OUT/decode-$S.err"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "${NO_NCU:-}" ] || [ -z "$NCU" ] && exit 0
# Skip the load and prefill; count a window of decode launches (eager: ncu then sees each kernel;
# a recorded step is one graph launch, and graphs change no kernel's own time).
KILN_CUDA_GRAPHS=0 timeout 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  --launch-skip "${NCU_SKIP:-8000}" --launch-count "${NCU_COUNT:-600}" \
  "$K" bench --device cuda -m "$W/$S" --prompt-tokens "$P" --gen-tokens 64 --runs 1 \
  > "$OUT/ncu-$S.csv" 2> "$OUT/ncu-$S.err" || { echo "ncu failed"; tail -c 600 "$OUT/ncu-$S.err"; }
python3 bench/gpu/ncu_summary.py "$OUT/ncu-$S.csv"
