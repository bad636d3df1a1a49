#!/usr/bin/env bash
# Issue 22 on the GPU: speculative decoding on a Llama-3-8B-shaped random bf16 checkpoint
# (`kiln dev random-checkpoint --preset llama3-8b --proj-std 0.01`, SmolLM2 tokenizer) with
# `kiln bench-spec --workload repeat` (a 512-token prompt the answer is asked to copy):
# plain decoding, n-gram lookup and the prompt as a `prediction`, at batch 1 and at 64
# concurrent requests (the adaptive switch: no speculation above --speculative-max-batch
# running requests), side by side in one lease on the same binary. Random weights do not
# copy their prompt: what they generate decides acceptance (their greedy output tends to
# fall into loops, which n-gram lookup predicts; the prediction is mostly rejected) — the
# JSON records the acceptance that came.
#   KILN=.device/kiln bench/gpu/spec_round.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/spec_round.sh OUT_DIR}; K=${KILN:-.device/kiln}; W=${WORK:-$PWD/target/kiln-w}
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ -f "$W/ck8b/config.json" ] || timeout 150 "$K" dev random-checkpoint --preset llama3-8b --proj-std 0.01 \
  --tokenizer bench/smollm2-tokenizer -o "$W/ck8b" > /dev/null 2>&1
for t in ${SPEC_TOKENS:-5}; do
  timeout 400 "$K" bench-spec -m "$W/ck8b" --device cuda --workload repeat --prompt-tokens 512 --gen-tokens 256 \
    --methods off,ngram,prediction --concurrency 1,64 --speculative-tokens "$t" \
    > "$OUT/spec-repeat-k$t.json" 2> "$OUT/spec-repeat-k$t.err"; echo "bench-spec k=$t rc=$?"
  grep -E "x(1|64):" "$OUT/spec-repeat-k$t.err"
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); print('speedup b1', d['batch1_decode_speedup_vs_off'])
for m,v in d['methods'].items(): print(m, {c:(round(x['output_tokens_per_second'],1), x.get('throughput_vs_off'), x['acceptance_rate'], x['outputs_equal_plain']) for c,x in v.items()})" "$OUT/spec-repeat-k$t.json"
done
