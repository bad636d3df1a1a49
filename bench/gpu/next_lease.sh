#!/usr/bin/env bash
# One device call for the checks and figures the open issues wait on, in priority order, each
# stage under its own time limit, compact summaries on stdout (the machine returns few files),
# checkpoints deleted between stages (the machine's disk is 64 GiB):
#   1. kiln dev cuda-check: failures and the LoRA / recurrent lines (the kernels last changed);
#   2. issue 23: the 8B shape with 8 rank-16 adapters against none, with each CUDA-core expand
#      (KILN_LORA_EXPAND8; bench/gpu/lora_embed_round.sh);
#   3. issue 21: the tiny hybrids' rows against the CPU and transformers in bf16 (tinydiag), the
#      Qwen3.5-9B shape's serving figures (hybrid_round.sh "serve"), its batch-1 decode with each
#      delta-rule kernel (KILN_DELTA_REGISTERS), and serving again with the register one.
#   4. (`hprof`) the 9B shape's decode with each delta-rule kernel and its 4,096-token prefill
#      token by token and chunk-parallel, timed op by op (`kiln bench --profile`);
#   5. (`mtp`) `--speculative mtp` on CUDA: the tiny Qwen3.5 with its head, outputs against plain.
#   6. (`chunk`) the delta rule's chunk-parallel form in the tiny Qwen3.5 against the CPU (hprof
#      times it on the 9B shape's 4,096-token prefill).
#   KILN=.device/kiln bench/gpu/next_lease.sh OUT_DIR [STAGES]   (STAGES: check lora hybrid chunk hprof mtp)
set -uo pipefail
OUT=${1:?usage: bench/gpu/next_lease.sh OUT_DIR [STAGES]}; STAGES=${2:-check lora hybrid}
K=${KILN:-.device/kiln}; export KILN=$K
has() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if has check; then
  timeout 150 "$K" dev cuda-check -o "$OUT/cuda-check.json" > "$OUT/check.log" 2>&1; echo "cuda-check rc=$?"
  grep -E "^FAIL" "$OUT/check.log" | cut -c1-140 | head -20
  grep -E "lora_|recurrent|gated_delta" "$OUT/check.log" | cut -c1-140 | head -60
  echo "ok lines: $(grep -c '^ok' "$OUT/check.log")"
fi
if has lora; then
  MODES="base lora lora-x8" REPS="1 2" timeout 270 bench/gpu/lora_embed_round.sh "$OUT/lora" throughput 2>&1 | grep -v '^==' | tail -6
  rm -rf "${WORK:-/tmp/kiln-round}/ck8b" "${WORK:-/tmp/kiln-round}"/lora8b-*
fi
if has hybrid; then
  timeout 120 bench/gpu/hybrid_round.sh "$OUT/tiny" tinydiag 2>&1 | tail -12
  timeout 330 bench/gpu/hybrid_round.sh "$OUT/h" serve 2>&1 | tail -16
  W=${WORK:-$PWD/target/kiln-w}
  # The 9B shape's decode and 512-token prefill with each delta-rule kernel, then its serving
  # figures with the register one.
  for r in 0 1; do
    [ -d "$W/qwen3_5-9b" ] && KILN_DELTA_REGISTERS=$r timeout 120 "$K" bench --device cuda -m "$W/qwen3_5-9b" \
      --prompt-tokens 512 --gen-tokens 128 --runs 2 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin)
print('9b delta registers=$r: decode', round(d['decode_tokens_per_second']['median'], 1), 'fraction',
      round(d['decode_fraction_of_bandwidth'], 4), 'prefill 512', round(d['prefill_tokens_per_second']['median'], 1))"
  done
  KILN_DELTA_REGISTERS=1 timeout 200 bench/gpu/hybrid_round.sh "$OUT/h-reg" serve 2>&1 | tail -14
  rm -rf "$W/qwen3_5-9b" "$OUT"/tiny/*.npy
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
fi
if has hprof; then
  W=${WORK:-$PWD/target/kiln-w}
  # With an MTP head (not read by plain decoding, nor counted in its roofline) for the mtp stage.
  [ -d "$W/qwen3_5-9b" ] || python3 bench/gpu/hybrid_ckpt.py qwen3_5-9b "$W/qwen3_5-9b" --mtp 2> "$OUT/ckpt-9b.err" || tail -3 "$OUT/ckpt-9b.err"
  # Decode with each token-order kernel; the 4,096-token prefill token by token and chunk-parallel.
  for cfg in "KILN_DELTA_REGISTERS=0" "KILN_DELTA_REGISTERS=1" "KILN_DELTA_REGISTERS=1 KILN_DELTA_CHUNK_ROWS=64"; do
    env $cfg timeout 120 "$K" bench --device cuda -m "$W/qwen3_5-9b" \
      --prompt-tokens 4096 --gen-tokens 128 --runs 2 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin)
print('9b $cfg: decode', round(d['decode_tokens_per_second']['median'], 1), 'fraction',
      round(d['decode_fraction_of_bandwidth'], 4), 'prefill 4096', round(d['prefill_tokens_per_second']['median'], 1))"
  done
  for rows in "" 64; do
    KILN_DELTA_REGISTERS=1 KILN_DELTA_CHUNK_ROWS=$rows timeout 150 "$K" bench --device cuda -m "$W/qwen3_5-9b" \
      --prompt-tokens 4096 --gen-tokens 8 --runs 1 --profile > "$OUT/prof-9b.json" 2> "$OUT/prof-9b.err"
    python3 - "$OUT/prof-9b.json" "$rows" <<'PY' || tail -c 600 "$OUT/prof-9b.err"
import json, sys
d = json.load(open(sys.argv[1]))
print("9b prefill 4096 (chunk rows '%s'):" % sys.argv[2], round(d["prefill_tokens_per_second"]["median"], 1), "tok/s")
p = d["profile"]["prefill"]
print("prefill wall", round(p["wall_seconds"], 4))
for o in p["ops"][:8]:
    print("  ", o["op"], round(o["seconds"], 4), o["calls"], round(o["share_of_wall"], 3))
PY
  done
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

[ -n "${KEEP_CKPT:-}" ] || rm -rf "${WORK:-$PWD/target/kiln-w}/qwen3_5-9b"
