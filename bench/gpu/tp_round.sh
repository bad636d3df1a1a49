#!/usr/bin/env bash
# Issue 25 (tensor parallelism) on the GPU machine lent (one GPU):
#   * (`nccl`) NCCL through cudarc on this machine's GPUs: `kiln dev nccl-check` (one rank a GPU;
#     each rank's all-reduce and column all-gather against the host's sums). NCCL comes from the
#     PyTorch install (its libnccl.so.2, linked as libnccl.so where cudarc looks);
#   * (`split`) the Llama-3-8B-shaped random bf16 checkpoint split over two ranks on the one GPU
#     (`--tensor-parallel 2 --tp-transport host`: the CUDA sharded path — half the heads, one KV
#     group of four, half the MLP, half the vocabulary a rank — with its collectives through host
#     memory) against the whole model: logits of 256 positions (200 in one prefill, then 56 decode
#     steps), cosine, max |Δ log-softmax| and argmax agreement; and NCCL's refusal of two ranks on
#     one GPU.
#   KILN=.device/kiln bench/gpu/tp_round.sh OUT_DIR [STAGES]
# STAGES (default "nccl split"); WORK (default target/kiln-w) keeps the checkpoint between calls.
set -uo pipefail
OUT=${1:?usage: bench/gpu/tp_round.sh OUT_DIR [STAGES]}; STAGES=${2:-nccl split}
K=${KILN:-.device/kiln}; W=${WORK:-$PWD/target/kiln-w}
mkdir -p "$OUT" "$W/lib"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
NCCL_SO=$(python3 - <<'PY'
import glob, os, sys
for p in sys.path:
    for f in sorted(glob.glob(os.path.join(p or ".", "nvidia", "nccl", "lib", "libnccl.so*"))):
        print(f); raise SystemExit
PY
)
[ -n "$NCCL_SO" ] && ln -sf "$NCCL_SO" "$W/lib/libnccl.so"
export LD_LIBRARY_PATH="$W/lib:$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "nccl library: ${NCCL_SO:-none found}"
if has nccl; then
  timeout 120 "$K" dev nccl-check > "$OUT/nccl-check.txt" 2>&1; el "nccl-check rc=$?"
  tail -n 5 "$OUT/nccl-check.txt"
fi
if has split; then
  [ -f "$W/ck8b/config.json" ] || { timeout 150 "$K" dev random-checkpoint --preset llama3-8b --proj-std 0.01 --tokenizer bench/smollm2-tokenizer -o "$W/ck8b" > /dev/null 2>&1; el "checkpoint rc=$?"; }
  IDS=$(python3 -c "import random; random.seed(25); print(','.join(str(random.randrange(49152)) for _ in range(256)))")
  timeout 200 "$K" dev logits --device cuda -m "$W/ck8b" --ids "$IDS" --prefill 200 -o "$OUT/tp1.npy" > /dev/null 2> "$OUT/tp1.err"; el "logits tp=1 rc=$?"
  timeout 300 "$K" dev logits --device cuda -m "$W/ck8b" --ids "$IDS" --prefill 200 --tensor-parallel 2 --tp-transport host -o "$OUT/tp2.npy" > /dev/null 2> "$OUT/tp2.err"; el "logits tp=2 (host) rc=$?"
  tail -n 3 "$OUT/tp2.err"
  python3 - "$OUT/tp1.npy" "$OUT/tp2.npy" <<'PY' | tee "$OUT/split.json"
import json, sys
import numpy as np
a, b = (np.load(p).astype(np.float64) for p in sys.argv[1:3])
def lsm(x):
    m = x.max(-1, keepdims=True); return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
la, lb = lsm(a), lsm(b)
cos = float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))
rows = lambda s: {"cosine": float(((a[s] * b[s]).sum(-1) / np.sqrt((a[s] ** 2).sum(-1) * (b[s] ** 2).sum(-1))).min()),
                  "max_abs_logprob_diff": float(np.abs(la[s] - lb[s]).max()),
                  "argmax_agreement": float((a[s].argmax(-1) == b[s].argmax(-1)).mean())}
print(json.dumps({"shape": list(a.shape), "cosine_all": cos, "prefill_rows": rows(slice(0, 200)),
                  "decode_rows": rows(slice(200, None))}))
PY
  timeout 120 "$K" dev logits --device cuda -m "$W/ck8b" --ids 1,2,3 --tensor-parallel 2 -o "$OUT/x.npy" > /dev/null 2> "$OUT/nccl-one-gpu.err"; el "tp=2 over NCCL on one GPU rc=$? (a refusal expected)"
  tail -n 2 "$OUT/nccl-one-gpu.err"
fi
