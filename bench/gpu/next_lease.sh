#!/usr/bin/env bash
# One device call for the checks and figures the open issues wait on, in priority order, each
# stage under its own time limit, compact summaries on stdout (the machine returns few files),
# checkpoints deleted between stages (the machine's disk is 64 GiB):
#   1. kiln dev cuda-check: failures and the LoRA / recurrent lines (the kernels last changed);
#   2. issue 23: the 8B shape with 8 rank-16 adapters against none, with each CUDA-core expand
#      (KILN_LORA_EXPAND8; bench/gpu/lora_embed_round.sh);
#   3. issue 21: the tiny hybrids' rows against the CPU and transformers in bf16 (tinydiag), the
#      Qwen3.5-9B shape's serving figures (hybrid_round.sh "serve").
#   4. (`hprof`) the 9B shape's decode and 4,096-token prefill token by token and chunk-parallel,
#      op by op with synchronous launches, and the recurrent mixer's kernels under ncu;
#   5. (`mtp`) `--speculative mtp` on CUDA: the tiny Qwen3.5 with its head, outputs against plain.
#   6. (`chunk`) the delta rule's chunk-parallel form in the tiny Qwen3.5 against the CPU; at real
#      head sizes, 1,200 tokens prefilled in one step and in steps of 7, 64 and 1,000; against
#      transformers (parity.py). hprof times it on the 9B shape's 4,096-token prefill.
#   7. (`glm`, `deepseek`) GLM-4.5 (DeepSeek-style grouped sigmoid routing) and DeepSeek-V3/V2,
#      GLM-4.7-Flash (latent attention) on CUDA: the tiny random checkpoints' rows against the
#      CPU's, MTP speculation against plain decoding, a 1024-wide checkpoint with real head sizes
#      against transformers (parity.py).
#   8. (`gemma`) issue 16: the Gemma-3-1B shape's batch-1 decode and ncu's time per kernel
#      (bench/gpu/decode_prof.sh; eager under ncu).
#   KILN=.device/kiln bench/gpu/next_lease.sh OUT_DIR [STAGES]
#   (STAGES: check lora hybrid chunk hprof mtp glm deepseek gemma)
set -uo pipefail
OUT=${1:?usage: bench/gpu/next_lease.sh OUT_DIR [STAGES]}; STAGES=${2:-check lora hybrid}
K=${KILN:-.device/kiln}; export KILN=$K
has() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if has check; then
  timeout 200 "$K" dev cuda-check -o "$OUT/cuda-check.json" > "$OUT/check.log" 2>&1; echo "cuda-check rc=$?"
  grep -E "^FAIL" "$OUT/check.log" | cut -c1-140 | head -20
  grep -E "lora_|recurrent|gated_delta|deepseek|mla_" "$OUT/check.log" | cut -c1-140 | head -60
  echo "ok lines: $(grep -c '^ok' "$OUT/check.log")"
fi
if has lora; then
  MODES="base lora lora-x8" REPS="1 2" timeout 270 bench/gpu/lora_embed_round.sh "$OUT/lora" throughput 2>&1 | grep -v '^==' | tail -6
  rm -rf "${WORK:-/tmp/kiln-round}/ck8b" "${WORK:-/tmp/kiln-round}"/lora8b-*
fi
if has hybrid; then
  timeout 120 bench/gpu/hybrid_round.sh "$OUT/tiny" tinydiag 2>&1 | tail -12
  timeout 330 bench/gpu/hybrid_round.sh "$OUT/h" serve 2>&1 | tail -16
  rm -rf "${WORK:-$PWD/target/kiln-w}/qwen3_5-9b" "$OUT"/tiny/*.npy
fi
if has chunk; then
  # The delta rule's chunk-parallel form in a whole model: the tiny Qwen3.5's rows with every
  # prefill through it (KILN_DELTA_CHUNK_ROWS=1) against the CPU's and the token-order kernel's.
  IDS=1,17,93,5,64,11,33,8,77,90,45,3,88,19,56,60,27,71,9,42,7,7,13,21,34,55,89,2,4,8,16,32
  M=crates/kiln-models/tests/data/hybrid/qwen3_5
  timeout 60 "$K" dev logits -m $M --device cpu --ids $IDS --prefill 20 -o "$OUT/ch-cpu.npy" > /dev/null 2>&1
  timeout 60 "$K" dev logits -m $M --device cuda --ids $IDS --prefill 20 -o "$OUT/ch-tok.npy" > /dev/null 2>&1
  KILN_DELTA_CHUNK_ROWS=1 timeout 60 "$K" dev logits -m $M --device cuda --ids $IDS --prefill 20 -o "$OUT/ch-chunk.npy" > /dev/null 2> "$OUT/ch.err" || tail -3 "$OUT/ch.err"
  python3 - "$OUT" <<'PY'
import sys
import numpy as np
o = sys.argv[1]
cpu, tok, ch = (np.load(f"{o}/ch-{n}.npy").astype(np.float64) for n in ("cpu", "tok", "chunk"))
cos = lambda a, b: (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
print("chunk tiny qwen3_5: chunked vs cpu min cosine", round(cos(ch, cpu).min(), 5), "token-order vs cpu",
      round(cos(tok, cpu).min(), 5), "chunked vs token-order max|d|", f"{np.abs(ch - tok).max():.2e}")
PY
  # Real head sizes (qwen3_5-small): 1,200 tokens in one prefill step, in steps of 7, 64 and 1,000
  # (chunk-parallel where a step has 64 or more), and token-order steps of 1,000; every row
  # against the one step. Then against transformers (parity.py: a 200-token prefill, chunk-parallel).
  W=${WORK:-$PWD/target/kiln-w}; S=$W/qwen3_5-small
  [ -d "$S" ] || python3 bench/gpu/hybrid_ckpt.py qwen3_5-small "$S" > /dev/null 2> "$OUT/ckpt-small.err" || tail -3 "$OUT/ckpt-small.err"
  IDS=$(python3 -c "import random; r = random.Random(5); print(','.join(str(r.randrange(8192)) for _ in range(1200)))")
  for st in 1200 7 64 1000 tok1000; do
    rows=64; n=${st#tok}; [ "$st" != "$n" ] && rows=1000000
    KILN_DELTA_CHUNK_ROWS=$rows timeout 60 "$K" dev logits -m "$S" --device cuda --ids $IDS --prefill $n --step $n \
      -o "$OUT/st-$st.npy" > /dev/null 2> "$OUT/st.err" || tail -2 "$OUT/st.err"
  done
  python3 - "$OUT" <<'PY'
import sys
import numpy as np
o = sys.argv[1]
ref = np.load(f"{o}/st-1200.npy").astype(np.float64)
cos = lambda a, b: (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
for st in ("7", "64", "1000", "tok1000"):
    a = np.load(f"{o}/st-{st}.npy").astype(np.float64)
    print(f"chunk small steps of {st}: min cosine vs one step {cos(a, ref).min():.6f}, argmax agreement",
          round(float((a.argmax(1) == ref.argmax(1)).mean()), 4), f"max|d| {np.abs(a - ref).max():.3e}")
PY
  rm -f "$OUT"/st-*.npy
  timeout 240 python3 bench/gpu/parity.py --kiln "$K" --ckpt "$S" --out "$OUT/parity-small.json" \
    --tokens 300 --prefill 200 --cpu 2> "$OUT/parity-small.err" | sed "s/^/chunk parity /"; tail -2 "$OUT/parity-small.err"
fi
if has hprof; then
  W=${WORK:-$PWD/target/kiln-w}
  # With an MTP head (not read by plain decoding, nor counted in its roofline) for the mtp stage.
  [ -d "$W/qwen3_5-9b" ] || python3 bench/gpu/hybrid_ckpt.py qwen3_5-9b "$W/qwen3_5-9b" --mtp 2> "$OUT/ckpt-9b.err" || tail -3 "$OUT/ckpt-9b.err"
  # Decode, and the 4,096-token prefill token by token and chunk-parallel (the default).
  for rows in 1000000 64; do
    KILN_DELTA_CHUNK_ROWS=$rows timeout 120 "$K" bench --device cuda -m "$W/qwen3_5-9b" \
      --prompt-tokens 4096 --gen-tokens 128 --runs 2 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin)
print('9b chunk rows $rows: decode', round(d['decode_tokens_per_second']['median'], 1), 'fraction',
      round(d['decode_fraction_of_bandwidth'], 4), 'prefill 4096', round(d['prefill_tokens_per_second']['median'], 1))"
  done
  # Op by op with every launch synchronous (the profile's times are then each op's own).
  CUDA_LAUNCH_BLOCKING=1 timeout 100 "$K" bench --device cuda -m "$W/qwen3_5-9b" --prompt-tokens 4096 \
    --gen-tokens 4 --runs 1 --profile 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin); p = d['profile']['prefill']
print('9b sync prefill 4096', round(d['prefill_tokens_per_second']['median'], 1), 'wall', round(p['wall_seconds'], 4))
for o in p['ops'][:7]: print('  ', o['op'], round(o['seconds'], 4), o['calls'], round(o['share_of_wall'], 3))"
  # The recurrent mixer's kernels, one layer at 4,096 tokens.
  NCU=$(ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] && KILN_CUDA_GRAPHS=0 timeout 100 "$NCU" --kernel-name regex:"recurrent_conv|gated_delta" --launch-count 6 \
    --metrics gpu__time_duration.sum "$K" bench --device cuda -m "$W/qwen3_5-9b" --prompt-tokens 4096 --gen-tokens 2 --runs 1 2>&1 \
    | grep -E "^  [a-z_]+ \(|gpu__time_duration" | paste - - | awk '{print "  ncu", $1, $(NF-1), $NF}'
fi
if has mtp; then
  W=${WORK:-$PWD/target/kiln-w}
  # The 9B shape's head at batch 1: what a guess costs (random weights: nearly none is taken, so
  # requests soon rest from guessing — the figure is the cost of the probes and the head's passes).
  [ -d "$W/qwen3_5-9b" ] && timeout 200 "$K" bench-spec --device cuda -m "$W/qwen3_5-9b" --workload repeat \
    --methods off,mtp --gen-tokens 256 --prompt-tokens 512 --concurrency 1,8 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin)
for m, v in d['methods'].items():
    for c, l in v.items():
        print('mtp 9b', m, 'x' + c, 'decode', round(l['decode_tokens_per_second_median'], 1), 'vs off',
              round(l.get('throughput_vs_off') or 0, 3), 'equal', l.get('outputs_equal_plain'),
              'drafts', l.get('draft_tokens'), 'accepted', l.get('accepted_draft_tokens'))"
  timeout 90 "$K" bench-spec --device cuda -m crates/kiln-models/tests/data/hybrid/qwen3_5_mtp --workload repeat \
    --methods off,mtp --gen-tokens 32 --prompt-tokens 64 --concurrency 1,4 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin)
for m, v in d['methods'].items():
    for c, l in v.items():
        print('mtp tiny cuda', m, 'x' + c, 'equal to plain', l.get('outputs_equal_plain'), 'drafts', l.get('draft_tokens'))"
fi

# Sparse families with DeepSeek-style routing (glm: GLM-4.5; deepseek: DeepSeek-V3/V2 and
# GLM-4.7-Flash with latent attention): each tiny random checkpoint's rows on CUDA against the CPU,
# MTP speculation against plain decoding where it ships a head, and a 1024-wide checkpoint with
# real head sizes against transformers (parity.py).
tiny_vs_cpu() {  # NAME DIR
  local IDS=1,17,93,5,64,11,33,8,77,90,45,3,88,19,56,60,27,71,9,42,7,7,13,21,34,55,89,2,4,8,16,32
  for d in cpu cuda; do
    timeout 60 "$K" dev logits -m "$2" --device $d --ids $IDS --prefill 20 -o "$OUT/$1-$d.npy" > /dev/null 2> "$OUT/$1.err" || tail -3 "$OUT/$1.err"
  done
  python3 - "$OUT" "$1" <<'PY'
import sys
import numpy as np
o, n = sys.argv[1], sys.argv[2]
cpu, cu = (np.load(f"{o}/{n}-{d}.npy").astype(np.float64) for d in ("cpu", "cuda"))
cos = (cpu * cu).sum(1) / np.linalg.norm(cpu, axis=1) / np.linalg.norm(cu, axis=1)
print(n, "tiny cuda vs cpu: min cosine", round(cos.min(), 5), "argmax agreement",
      round(float((cpu.argmax(1) == cu.argmax(1)).mean()), 4))
PY
}
mtp_vs_plain() {  # NAME DIR
  timeout 90 "$K" bench-spec --device cuda -m "$2" --workload repeat --methods off,mtp --gen-tokens 32 \
    --prompt-tokens 64 --concurrency 1,4 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin)
for m, v in d['methods'].items():
    for c, l in v.items():
        print('$1 mtp tiny cuda', m, 'x' + c, 'equal to plain', l.get('outputs_equal_plain'), 'drafts', l.get('draft_tokens'))"
}
parity_small() {  # SHAPE
  local W=${WORK:-$PWD/target/kiln-w}; local G=$W/$1
  [ -d "$G" ] || python3 bench/gpu/hybrid_ckpt.py $1 "$G" > /dev/null 2> "$OUT/ckpt-$1.err" || tail -3 "$OUT/ckpt-$1.err"
  timeout 200 python3 bench/gpu/parity.py --kiln "$K" --ckpt "$G" --out "$OUT/parity-$1.json" \
    --tokens 300 --prefill 200 --cpu 2> "$OUT/parity-$1.err" | sed "s/^/$1 parity /"; tail -2 "$OUT/parity-$1.err"
  rm -rf "$G"
}
D=crates/kiln-models/tests/data/moe
if has glm; then
  tiny_vs_cpu glm $D/glm4_moe
  mtp_vs_plain glm $D/glm4_moe
  parity_small glm4_moe-small
fi
if has deepseek; then
  for c in deepseek_v3 deepseek_v2 glm4_moe_lite; do tiny_vs_cpu $c $D/$c; done
  mtp_vs_plain deepseek_v3 $D/deepseek_v3
  parity_small deepseek-small
fi

if has gemma; then
  NCU_SKIP=3000 NCU_COUNT=700 timeout 420 bench/gpu/decode_prof.sh "$OUT/gemma" gemma3-1b 1024 2>&1 | tail -24
fi

[ -n "${KEEP_CKPT:-}" ] || rm -rf "${WORK:-$PWD/target/kiln-w}/qwen3_5-9b"
