#!/usr/bin/env bash
# Mixture-of-Experts layers on CUDA (composed of the device's products, routing and sums on the
# host: Ops::moe's first CUDA form) on the GPU machine lent:
#   * (`check`) kiln dev cuda-check, its moe entries against the CPU reference printed;
#   * (`parity`) random Qwen3-MoE and Mixtral checkpoints at real head sizes (bench/gpu/moe_ckpt.py,
#     transformers on the GPU) against transformers bf16 and f32 (bench/gpu/parity.py: one prefill,
#     and prefill + one token a step);
#   * (`tp`) the Qwen3-MoE one split over two ranks on the one GPU (host collectives), experts split
#     and expert-parallel, against the whole model's logits;
#   * (`bench`) its batch-1 decode (tok/s);
#   * (`big`) Qwen3-30B-A3B's layer on 12 layers (bench/gpu/moe_ckpt.py qwen3_moe-30b-a3b-12l):
#     batch-1 decode against its active-weight roofline (kiln bench's decode_fraction_of_bandwidth:
#     the bytes a token reads — attention, router, 8 of 128 experts, lm_head — over the copy
#     bandwidth of the same run) and a 4,096-token prefill; with KILN_BASE set, that binary's decode
#     too, alternated (an A/B in one lease);
#   * (`prof`) ncu's time per kernel over a few decode steps of that checkpoint, summed by kernel;
#   * (`gptoss`) gpt-oss end to end on CUDA: a random checkpoint written by Kiln itself
#     (bench/gpu/shapes/gpt_oss-small.json: 64-wide heads, sinks, 128-token windows, 8 biased experts
#     with the clamped SwiGLU; transformers 5.17 on the machine predates gpt-oss's layout) against
#     Kiln's CPU f32 logits (the CPU's gpt-oss is checked against transformers in CI), 300 positions
#     across the windows; then gpt-oss-20b's layer on 6 of its 24 layers, batch-1 decode against its
#     active-weight roofline; both again with MXFP4 experts (bench/gpu/mxfp4_experts.py, the released
#     checkpoints' layout), CUDA against Kiln's CPU on the same blocks.
#   KILN=.device/kiln bench/gpu/moe_round.sh OUT_DIR [STAGES]
set -uo pipefail
OUT=${1:?usage: bench/gpu/moe_round.sh OUT_DIR [STAGES]}; STAGES=${2:-check parity tp bench}
K=${KILN:-.device/kiln}; W=${WORK:-$PWD/target/kiln-w}
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if has check; then
  timeout 240 "$K" dev cuda-check -o "$OUT/cuda-check.json" > "$OUT/check.log" 2>&1; el "cuda-check rc=$?"
  python3 - "$OUT/cuda-check.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); cs = d.get("checks", [])
print("checks", len(cs), "failed", [(c["op"], round(c["rel_err"], 4)) for c in cs if not c["pass"]][:20])
for c in cs:
    if c["op"].startswith("moe"):
        print("  ", c["op"], round(c["rel_err"], 5), c["pass"])
PY
fi
for s in qwen3_moe-small mixtral-small; do
  [ -f "$W/$s/config.json" ] || { timeout 120 python3 bench/gpu/moe_ckpt.py $s "$W/$s" > "$OUT/ckpt-$s.log" 2>&1; el "checkpoint $s rc=$?"; tail -n 2 "$OUT/ckpt-$s.log"; }
done
if has parity; then
  for s in qwen3_moe-small mixtral-small; do
    timeout 200 python3 bench/gpu/parity.py --kiln "$K" --ckpt "$W/$s" --tokens 160 --prefill 100 --out "$OUT/parity-$s.json" > "$OUT/parity-$s.log" 2>&1; el "parity $s rc=$?"
    grep -E "vs_hf|decode_vs_prefill|error" "$OUT/parity-$s.log" | head -8
  done
fi
if has tp; then
  IDS=$(python3 -c "import random; random.seed(20); print(','.join(str(random.randrange(3, 8192)) for _ in range(96)))")
  timeout 120 "$K" dev logits --device cuda -m "$W/qwen3_moe-small" --ids "$IDS" --prefill 64 -o "$OUT/moe-tp1.npy" > /dev/null 2> "$OUT/moe-tp1.err"; el "tp=1 rc=$?"
  timeout 200 "$K" dev logits --device cuda -m "$W/qwen3_moe-small" --ids "$IDS" --prefill 64 --tensor-parallel 2 --tp-transport host -o "$OUT/moe-tp2.npy" > /dev/null 2> "$OUT/moe-tp2.err"; el "tp=2 rc=$?"
  timeout 200 "$K" dev logits --device cuda -m "$W/qwen3_moe-small" --ids "$IDS" --prefill 64 --tensor-parallel 2 --tp-transport host --expert-parallel -o "$OUT/moe-ep2.npy" > /dev/null 2> "$OUT/moe-ep2.err"; el "tp=2 expert-parallel rc=$?"
  tail -n 2 "$OUT/moe-tp2.err" "$OUT/moe-ep2.err"
  python3 - "$OUT" <<'PY' | tee "$OUT/tp.json"
import json, os, sys
import numpy as np
sys.path.insert(0, "bench/gpu")
from logit_compare import compare
d = sys.argv[1]
a = np.load(os.path.join(d, "moe-tp1.npy"))
out = {}
for k in ("tp2", "ep2"):
    p = os.path.join(d, f"moe-{k}.npy")
    if os.path.exists(p):
        out[f"{k}_vs_tp1"] = compare(np.load(p), a)
print(json.dumps(out))
PY
fi
if has bench; then
  timeout 200 "$K" bench --device cuda -m "$W/qwen3_moe-small" --prompt-tokens 256 --gen-tokens 64 --runs 2 > "$OUT/bench-qwen3_moe.json" 2> "$OUT/bench-qwen3_moe.err"; el "bench rc=$?"
  python3 -c "
import json; d=json.load(open('$OUT/bench-qwen3_moe.json'))
print('qwen3_moe-small decode', round(d['decode_tokens_per_second']['median'],1), 'prefill', round(d['prefill_tokens_per_second']['median']))" || tail -c 600 "$OUT/bench-qwen3_moe.err"
fi
if has big; then
  B=qwen3_moe-30b-a3b-12l
  [ -f "$W/$B/config.json" ] || { timeout 300 python3 bench/gpu/moe_ckpt.py $B "$W/$B" > "$OUT/ckpt-$B.log" 2>&1; el "checkpoint $B rc=$?"; tail -n 1 "$OUT/ckpt-$B.log"; }
  timeout 240 "$K" bench --device cuda -m "$W/$B" --prompt-tokens 512 --gen-tokens 128 --runs 2 > "$OUT/bench-$B.json" 2> "$OUT/bench-$B.err"; el "bench $B rc=$?"
  if [ -n "${KILN_BASE:-}" ]; then
    for r in 1 2; do
      for v in base new; do
        bin=$K; [ $v = base ] && bin=$KILN_BASE
        timeout 120 "$bin" bench --device cuda -m "$W/$B" --prompt-tokens 512 --gen-tokens 128 --runs 1 > "$OUT/ab-$v-$r.json" 2>/dev/null
        python3 -c "import json; d=json.load(open('$OUT/ab-$v-$r.json')); print('ab $v $r decode', round(d['decode_tokens_per_second']['median'],1), 'fraction', round(d['decode_fraction_of_bandwidth'],3))" || echo "ab $v $r failed"
      done
    done
  fi
  timeout 200 "$K" bench --device cuda -m "$W/$B" --prompt-tokens 4096 --gen-tokens 4 --runs 2 > "$OUT/prefill-$B.json" 2> "$OUT/prefill-$B.err"; el "prefill $B rc=$?"
  python3 - "$OUT" $B <<'PY' || tail -c 800 "$OUT/bench-$B.err"
import json, os, sys
d, b = sys.argv[1], sys.argv[2]
r = json.load(open(os.path.join(d, f"bench-{b}.json")))
out = {"decode_tok_s": r["decode_tokens_per_second"]["median"],
       "active_bytes_per_token": r["decode_weight_bytes_per_token"],
       "bandwidth_gbs": r["bandwidth_gbs"], "fraction_of_roofline": r["decode_fraction_of_bandwidth"]}
try:
    p = json.load(open(os.path.join(d, f"prefill-{b}.json")))
    out["prefill_4096_tok_s"] = p["prefill_tokens_per_second"]["median"]
except Exception as e:
    out["prefill_error"] = str(e)
print(json.dumps(out))
PY
fi
if has prof; then
  B=qwen3_moe-30b-a3b-12l
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-skip 0 --launch-count 4000 "$K" bench --device cuda -m "$W/$B" --prompt-tokens 16 --gen-tokens 9 --runs 1 \
    > "$OUT/ncu.csv" 2> "$OUT/ncu.err"; el "ncu rc=$?"
  python3 bench/gpu/ncu_summary.py "$OUT/ncu.csv" 16 | tee "$OUT/ncu-summary.txt"
fi
if has gptoss; then
  for G in gpt_oss-small gpt_oss-20b-6l; do
    [ -f "$W/$G/config.json" ] || { timeout 240 "$K" dev random-checkpoint --config bench/gpu/shapes/$G.json --tokenizer bench/smollm2-tokenizer -o "$W/$G" > "$OUT/ckpt-$G.log" 2>&1; el "checkpoint $G rc=$?"; }
  done
  IDS=$(python3 -c "import random; random.seed(21); print(','.join(str(random.randrange(3, 49000)) for _ in range(300)))")
  # The same checkpoints with MXFP4 experts as the released ones store them (bench/gpu/mxfp4_experts.py):
  # CUDA (MXFP4 blocks kept, the MoE kernels' MXFP4 path) against Kiln's CPU on the same blocks.
  for G in gpt_oss-small gpt_oss-20b-6l; do
    [ -f "$W/$G-mxfp4/config.json" ] || { timeout 300 python3 bench/gpu/mxfp4_experts.py "$W/$G" "$W/$G-mxfp4" > "$OUT/mxfp4-$G.log" 2>&1; el "mxfp4 $G rc=$?"; tail -n 1 "$OUT/mxfp4-$G.log"; }
  done
  # gpt-oss-small on CUDA against Kiln's CPU: bf16 experts (gptoss.json), MXFP4 ones (gptoss-mxfp4.json).
  for C in "" -mxfp4; do
    timeout 120 "$K" dev logits --device cuda -m "$W/gpt_oss-small$C" --ids "$IDS" --prefill 200 -o "$OUT/goss$C-cuda.npy" > /dev/null 2> "$OUT/goss$C-cuda.err"; el "gpt-oss$C cuda rc=$?"
    timeout 200 "$K" dev logits --device cpu -m "$W/gpt_oss-small$C" --ids "$IDS" --prefill 200 -o "$OUT/goss$C-cpu.npy" > /dev/null 2> "$OUT/goss$C-cpu.err"; el "gpt-oss$C cpu rc=$?"
    python3 - "$OUT" "$C" <<'PY' | tee "$OUT/gptoss$C.json"
import json, os, sys
import numpy as np
sys.path.insert(0, "bench/gpu")
from logit_compare import compare
d, c = sys.argv[1], sys.argv[2]
a, b = np.load(os.path.join(d, f"goss{c}-cuda.npy")), np.load(os.path.join(d, f"goss{c}-cpu.npy"))
print(json.dumps({"prefill_rows": compare(a[:200], b[:200]), "decode_rows": compare(a[200:], b[200:])}))
PY
  done
  for B in gpt_oss-20b-6l gpt_oss-20b-6l-mxfp4; do
    timeout 200 "$K" bench --device cuda -m "$W/$B" --prompt-tokens 512 --gen-tokens 128 --runs 2 > "$OUT/bench-$B.json" 2> "$OUT/bench-$B.err"; el "bench $B rc=$?"
    python3 -c "
import json; d=json.load(open('$OUT/bench-$B.json'))
print('$B decode', round(d['decode_tokens_per_second']['median'],1), 'active GB', round(d['decode_weight_bytes_per_token']/1e9,3), 'fraction', round(d['decode_fraction_of_bandwidth'],3))" || tail -c 600 "$OUT/bench-$B.err"
  done
fi
