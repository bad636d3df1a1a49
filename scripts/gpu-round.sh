#!/usr/bin/env bash
# One GPU round on a CUDA machine, from the repo root: cross-backend op checks,
# kernel checks against PyTorch, logits parity against transformers on random
# SmolLM2-135M- and Llama-3-8B-shaped checkpoints, and Kiln's benchmarks next to
# the PyTorch anchor (bench/gpu/hf_bench.py) in the same run. Writes JSON parts
# and one combined report into OUT_DIR.
#
#   scripts/gpu-round.sh OUT_DIR [PHASE...]
#
# Phases (default: all, in this order): check ckpt parity staging bench structured fit profile anchors.
# "check ckpt parity bench anchors" — the report issue 4 asks for — fits one 10-minute device call
# on an H200 (~8 min: anchors ~2.5 min of it).
# structured: bench-engine at 32 concurrent 8B requests, with none and half of
# them under a JSON schema (structured-0.json, structured-0.5.json).
# fit: `kiln fit`'s predicted peak against nvidia-smi's measured peak of a
# bench-engine run in the same configuration (KV pinned to fit's KV term) on
# the 8B checkpoint, at each CONTEXTxBATCH of FIT_SETTINGS (default
# "4096x16 8192x32 2048x64 8192x4"); one fit-CxB.json each (needs the ckpt phase's checkpoint).
# staging: weights through pinned buffers (on unless KILN_PINNED_STAGING=0) — 8B parity with it on, and
# the 8B load time with it off and on (load-staging0.json, load-staging1.json).
# variants (not in the default list): 8B batch-1 decode under each NAME:ENV... of VARIANTS
# (default: base, no PDL, 16-column direct GEMV tiles only, decode attention without its pre-wait
# slot lookup and L2 prefetch, values loaded with keys in every decode kernel, split steps' values
# loaded apart from their keys), one variant-NAME.json each; ENV entries are VAR=VALUE joined by
# commas (several kernel defines: A=1+B=2). `kiln dev cuda-options` lists every variable.
# sweep (not in the default list): bench/gpu/gemv_sweep.py over the direct GEMV's tuning macros.
# KILN (default .device/kiln, else target/release/kiln) is the binary to test;
# WORK (default /tmp/kiln-round) holds the checkpoints.
set -uo pipefail
OUT=${1:?usage: scripts/gpu-round.sh OUT_DIR [PHASE...]}
shift
PHASES=${*:-check ckpt parity staging bench structured fit profile anchors}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
KILN=${KILN:-$( [ -x .device/kiln ] && echo .device/kiln || echo target/release/kiln )}
WORK=${WORK:-/tmp/kiln-round}
TOK=bench/smollm2-tokenizer
mkdir -p "$WORK"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
note() { echo "== $(date +%T) $*" | tee -a "$OUT/round.log"; }
run() { note "$*"; "$@" 2>&1 | tee -a "$OUT/round.log"; local rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { note "FAILED ($rc): $*"; status=1; }; return 0; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

which nsys ncu >> "$OUT/round.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null
if has check; then
  run "$KILN" dev cuda-check -o "$OUT/cuda-check.json"
fi
if has ckpt; then
  [ -f "$WORK/ck135m/config.json" ] || run "$KILN" dev random-checkpoint --preset smollm2-135m --tokenizer "$TOK" -o "$WORK/ck135m"
  [ -f "$WORK/ck8b/READY" ] || run python3 bench/gpu/hf_bench.py --stages save8b --cfg-dir "$TOK" --save-dir "$WORK/ck8b" --out "$OUT/save8b.json"
fi
if has bench; then
  b() { local name=$1; shift; note "bench $name: $*"; "$KILN" "$@" > "$OUT/bench-$name.json" 2>> "$OUT/round.log" || { note "FAILED bench $name"; status=1; }; }
  b 8b-decode bench --device cuda -m "$WORK/ck8b" --prompt-tokens 512 --gen-tokens 128 --runs 3
  b 8b-prefill4096 bench --device cuda -m "$WORK/ck8b" --prompt-tokens 4096 --gen-tokens 2 --runs 3
  b 8b-batch64 bench-engine --device cuda -m "$WORK/ck8b" --concurrency 1,8,32,64 --prompt-tokens 128 --gen-tokens 128 --prefix-tokens 1000
  b 135m-decode bench --device cuda -m "$WORK/ck135m" --prompt-tokens 512 --gen-tokens 256 --runs 3
  KILN_CUDA_GRAPHS=0 b 135m-decode-nographs bench --device cuda -m "$WORK/ck135m" --prompt-tokens 512 --gen-tokens 256 --runs 3
fi
if has structured; then
  # Structured output under load: 32 concurrent 8B requests, none and half
  # under a JSON schema (masks computed alongside the forward passes).
  for f in 0 0.5; do
    note "structured json_fraction=$f"
    "$KILN" bench-engine --device cuda -m "$WORK/ck8b" --concurrency 32 --prompt-tokens 128 --gen-tokens 128 \
      --prefix-tokens 16 --json-fraction "$f" > "$OUT/structured-$f.json" 2>> "$OUT/round.log" || { note "FAILED structured $f"; status=1; }
  done
fi
if has fit; then
  [ -f "$WORK/ck8b/READY" ] || note "fit: no $WORK/ck8b (run the ckpt phase first)"
  for setting in ${FIT_SETTINGS:-4096x16 8192x32 2048x64 8192x4}; do
    run python3 bench/fit_check.py --kiln "$KILN" --model "$WORK/ck8b" --device cuda \
      --context "${setting%x*}" --batch "${setting#*x}" --out "$OUT/fit-$setting.json"
  done
fi
if has anchors; then
  run python3 bench/gpu/hf_bench.py --stages ceil,eager8b,comp8b --deadline "${ANCHOR_DEADLINE:-400}" --cfg-dir "$TOK" --save-dir "$WORK/ck8b" --out "$OUT/hf-8b.json"
  run timeout "${ANCHOR135_TIMEOUT:-150}" python3 bench/gpu/hf_bench.py --stages comp135m --cfg-dir "$TOK" --out "$OUT/hf-135m.json"
fi
if has parity; then
  run python3 bench/gpu/parity.py --kiln "$KILN" --ckpt "$WORK/ck135m" --cpu --out "$OUT/parity-135m.json"
  run python3 bench/gpu/parity.py --kiln "$KILN" --ckpt "$WORK/ck8b" --tokens 160 --prefill 80 --out "$OUT/parity-8b.json"
fi
if has variants; then
  for v in ${VARIANTS:-base: nopdl:KILN_PDL=0 cols16:KILN_DIRECT_COLS=16 noprewait:KILN_KERNEL_DEFINES=KILN_DECODE_PREWAIT=0 vpre:KILN_KERNEL_DEFINES=KILN_DECODE_VPRE=1 novpre:KILN_DECODE_VPRE_SPLIT=0}; do
    name=${v%%:*}; envs=${v#*:}
    note "variant $name: $envs"
    # shellcheck disable=SC2046
    env $(echo "$envs" | tr ',' ' ') \
      "$KILN" bench --device cuda -m "$WORK/ck8b" --prompt-tokens 512 --gen-tokens 96 --runs 2 \
      > "$OUT/variant-$name.json" 2>> "$OUT/round.log" || { note "FAILED variant $name"; status=1; }
  done
fi
if has sweep; then
  run python3 bench/gpu/gemv_sweep.py --out "$OUT/gemv-sweep.json" ${SWEEP:-2,4,4 2,4,8 2,3,6 3,3,6}
fi
if has staging; then
  KILN_PINNED_STAGING=1 run python3 bench/gpu/parity.py --kiln "$KILN" --ckpt "$WORK/ck8b" --tokens 160 --prefill 80 --out "$OUT/parity-8b-staging.json"
  for s in 0 1; do
    note "load with KILN_PINNED_STAGING=$s"
    KILN_PINNED_STAGING=$s "$KILN" bench --device cuda -m "$WORK/ck8b" --prompt-tokens 16 --gen-tokens 2 --runs 1 \
      > "$OUT/load-staging$s.json" 2>> "$OUT/round.log" || { note "FAILED load staging $s"; status=1; }
  done
fi
if has profile && command -v ncu >/dev/null; then
  # Per-kernel times of steady decode steps of the 8B shape (kernels inside
  # the recorded graphs are profiled one by one).
  note "ncu 8b decode kernels"
  timeout 150 ncu --csv --metrics gpu__time_duration.sum --launch-skip 1500 --launch-count 330 \
    "$KILN" bench --device cuda -m "$WORK/ck8b" --prompt-tokens 512 --gen-tokens 24 --runs 0 \
    > "$OUT/ncu-8b-decode.csv" 2>> "$OUT/round.log" || note "ncu FAILED"
fi
python3 - "$OUT" <<'PY'
import json, os, subprocess, sys
out = sys.argv[1]
rep = {"gpu": open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else None}
try:
    rep["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except Exception:
    pass
for f in sorted(os.listdir(out)):
    if f.endswith(".json") and f != "round.json":
        try:
            rep[f[:-5]] = json.load(open(os.path.join(out, f)))
        except Exception as e:
            rep[f[:-5]] = {"unreadable": str(e)}
json.dump(rep, open(os.path.join(out, "round.json"), "w"), indent=1)
print("wrote", os.path.join(out, "round.json"))
PY
exit $status
