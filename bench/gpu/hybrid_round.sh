#!/usr/bin/env bash
# Issue 21 on the GPU, first round: the recurrent mixers' kernels (ops/recurrent) against the CPU
# reference (`kiln dev cuda-check`'s "recurrent ..." checks: Qwen3.5's head shape and a small
# odd one, LFM2's short convolution; fresh, continued and restored sequences, mid-step
# snapshots; outputs and every slot's state), then the random hybrid checkpoints of
# crates/kiln-models/tests/data/hybrid (the dense ones: the CUDA backend runs no MoE yet) —
# CUDA logits against Kiln CPU's, 20 tokens in one prefill step then 12 decode steps, with the
# kernels on (KILN_CUDA_RECURRENT, on by default since this round passed on an H100).
# Then random checkpoints at real releases' head sizes (bench/gpu/hybrid_ckpt.py: Qwen3.5's
# 256-wide attention heads and 128-wide DeltaNet heads, LFM2's 64-wide heads) against
# transformers on the GPU (bench/gpu/parity.py: 300 tokens, past two state checkpoints;
# CUDA prefill, CUDA prefill + decode steps, Kiln CPU), and batch-1 decode of a
# Qwen3.5-9B-shaped checkpoint made on the GPU (STAGES: check tiny tinydiag parity decode; `moe`: the
# Qwen3.5-35B-A3B-shaped MoE hybrid's decode on 8 of its layers).
#   KILN=.device/kiln bench/gpu/hybrid_round.sh OUT_DIR [STAGES]
set -uo pipefail
OUT=${1:?usage: bench/gpu/hybrid_round.sh OUT_DIR [STAGES]}; K=${KILN:-.device/kiln}
STAGES=${2:-check tiny parity decode serve}; W=${WORK:-$PWD/target/kiln-w}
has() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if has check; then
timeout 300 "$K" dev cuda-check -o "$OUT/cuda-check.json" > "$OUT/check.log" 2>&1; echo "cuda-check rc=$?"
python3 - "$OUT/cuda-check.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); cs = d.get("checks", [])
print("checks", len(cs), "failed", [(c["op"], round(c["rel_err"], 4)) for c in cs if not c["pass"]][:30])
for c in cs:
    if c["op"].startswith("recurrent"):
        print("  ", c["op"], round(c["rel_err"], 6), c["pass"])
PY
fi
if has tiny; then
IDS=1,17,93,5,64,11,33,8,77,90,45,3,88,19,56,60,27,71,9,42,7,7,13,21,34,55,89,2,4,8,16,32
for c in qwen3_5 lfm2; do
  for d in cpu cuda; do
    KILN_CUDA_RECURRENT=1 timeout 60 "$K" dev logits -m "crates/kiln-models/tests/data/hybrid/$c" --device $d \
      --ids $IDS --prefill 20 -o "$OUT/logits-$c-$d.npy" > /dev/null 2> "$OUT/logits-$c-$d.err" || tail -2 "$OUT/logits-$c-$d.err"
  done
  python3 - "$OUT" "$c" <<'PY'
import sys
import numpy as np
out, c = sys.argv[1:3]
a = np.load(f"{out}/logits-{c}-cpu.npy").astype(np.float64)
b = np.load(f"{out}/logits-{c}-cuda.npy").astype(np.float64)
cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
print(f"{c}: CUDA vs CPU logits cosine min {cos.min():.6f} (prefill rows {cos[:20].min():.6f}, "
      f"decode rows {cos[20:].min():.6f}), argmax agreement {(a.argmax(1) == b.argmax(1)).mean():.3f}")
PY
done
fi
if has tinydiag; then
# Where the tiny qwen3_5's CUDA prefill rows part from the CPU: the same ids with the first
# 1, 4 and 20 tokens in the prefill step (the rest decoded), each against the CPU's rows.
IDS=1,17,93,5,64,11,33,8,77,90,45,3,88,19,56,60,27,71,9,42,7,7,13,21,34,55,89,2,4,8,16,32
for c in qwen3_5 lfm2; do
  for pf in 1 4 20; do
    for d in cpu cuda; do
      KILN_CUDA_RECURRENT=1 timeout 60 "$K" dev logits -m "crates/kiln-models/tests/data/hybrid/$c" --device $d \
        --ids $IDS --prefill $pf -o "$OUT/diag-$c-$d-$pf.npy" > /dev/null 2> "$OUT/diag-$c-$d-$pf.err" || tail -2 "$OUT/diag-$c-$d-$pf.err"
    done
  done
  python3 - "$OUT" "$c" <<'PY'
import sys
import numpy as np
out, c = sys.argv[1:3]
cos = lambda a, b: (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
ref = np.load(f"{out}/diag-{c}-cpu-20.npy").astype(np.float64)
for pf in (1, 4, 20):
    a = np.load(f"{out}/diag-{c}-cpu-{pf}.npy").astype(np.float64)
    b = np.load(f"{out}/diag-{c}-cuda-{pf}.npy").astype(np.float64)
    print(f"{c} prefill {pf}: cpu vs cpu-20 max|d| {np.abs(a - ref).max():.2e}; cuda vs cpu cosine per row",
          " ".join(f"{x:.3f}" for x in cos(a, b)))
PY
  # Whether transformers in bf16 parts from its f32 at the same rows.
  timeout 120 python3 bench/gpu/tiny_bf16.py "crates/kiln-models/tests/data/hybrid/$c" $IDS \
    "$OUT/diag-$c-cuda-20.npy" "$OUT/diag-$c-cpu-20.npy" 2>&1 | tail -4 | sed "s/^/$c /"
done
fi
export KILN_CUDA_RECURRENT=1
if has parity; then
  for s in qwen3_5-small lfm2-small qwen3_5_moe-small; do
    [ -d "$W/$s" ] || python3 bench/gpu/hybrid_ckpt.py $s "$W/$s" > /dev/null 2> "$OUT/ckpt-$s.err" || tail -3 "$OUT/ckpt-$s.err"
    timeout 240 python3 bench/gpu/parity.py --kiln "$K" --ckpt "$W/$s" --out "$OUT/parity-$s.json" \
      --tokens 300 --prefill 200 --cpu 2> "$OUT/parity-$s.err" | sed "s/^/$s /"; echo "parity $s rc=$?"
    tail -2 "$OUT/parity-$s.err"
  done
fi
if has moe; then
  # The MoE hybrid's decode: Qwen3.5-35B-A3B's layer on 8 of its 40 layers.
  B=qwen3_5_moe-35b-a3b-8l
  [ -d "$W/$B" ] || python3 bench/gpu/hybrid_ckpt.py $B "$W/$B" > /dev/null 2> "$OUT/ckpt-$B.err" || tail -3 "$OUT/ckpt-$B.err"
  timeout 200 "$K" bench --device cuda -m "$W/$B" --prompt-tokens 512 --gen-tokens 128 --runs 2 \
    > "$OUT/decode512-$B.json" 2> "$OUT/decode512-$B.err"; echo "decode $B rc=$?"
  python3 -c "
import json; d=json.load(open('$OUT/decode512-$B.json'))
print('$B decode', round(d['decode_tokens_per_second']['median'],1), 'fraction', round(d['decode_fraction_of_bandwidth'],3))" || tail -3 "$OUT/decode512-$B.err"
fi
if has decode; then
  [ -d "$W/qwen3_5-9b" ] || python3 bench/gpu/hybrid_ckpt.py qwen3_5-9b "$W/qwen3_5-9b" 2> "$OUT/ckpt-9b.err" || tail -3 "$OUT/ckpt-9b.err"
  timeout 200 "$K" bench --device cuda -m "$W/qwen3_5-9b" --prompt-tokens 512 --gen-tokens 128 --runs 3 \
    > "$OUT/decode512-qwen3_5-9b.json" 2> "$OUT/decode512-qwen3_5-9b.err"; echo "decode 9b rc=$?"
  tail -c 1500 "$OUT/decode512-qwen3_5-9b.json"; tail -3 "$OUT/decode512-qwen3_5-9b.err"
  # The same binary with decode steps run eagerly (KILN_CUDA_GRAPHS=0), against the recorded ones.
  for r in 1 2; do
    for g in 0 1; do
      KILN_CUDA_GRAPHS=$g timeout 120 "$K" bench --device cuda -m "$W/qwen3_5-9b" --prompt-tokens 512 --gen-tokens 128 --runs 1 \
        > "$OUT/ab-graphs$g-$r.json" 2>/dev/null
      python3 -c "
import json; d=json.load(open('$OUT/ab-graphs$g-$r.json'))
print('9b graphs=$g rep $r decode', round(d['decode_tokens_per_second']['median'],2), 'fraction', round(d['decode_fraction_of_bandwidth'],4))" || echo "ab graphs=$g $r failed"
    done
  done
fi
if has serve; then
  # The 9B hybrid under load: 64 concurrent requests (prompt 256, 128 generated), and the time to
  # first token of a request after a 4,096-token prefix, uncached and cached (state snapshots).
  [ -d "$W/qwen3_5-9b" ] || python3 bench/gpu/hybrid_ckpt.py qwen3_5-9b "$W/qwen3_5-9b" 2> "$OUT/ckpt-9b.err" || tail -3 "$OUT/ckpt-9b.err"
  timeout 300 "$K" bench-engine --device cuda -m "$W/qwen3_5-9b" --concurrency 1,64 --prompt-tokens 256 --gen-tokens 128 \
    --prefix-tokens 4096 > "$OUT/engine-9b.json" 2> "$OUT/engine-9b.err"; echo "engine 9b rc=$?"
  python3 - "$OUT/engine-9b.json" <<'PY' || tail -c 800 "$OUT/engine-9b.err"
import json, sys
d = json.load(open(sys.argv[1]))
def walk(o, path=""):
    if isinstance(o, dict):
        for k, v in o.items():
            walk(v, f"{path}.{k}" if path else k)
    elif isinstance(o, list):
        for i, v in enumerate(o):
            walk(v, f"{path}[{i}]")
    elif any(w in path for w in ("tokens_per_second", "ttft", "concurrency", "hit_tokens", "wall")):
        print(path, round(o, 4) if isinstance(o, float) else o)
walk(d)
PY
fi
