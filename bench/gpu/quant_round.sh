#!/usr/bin/env bash
# Issue 18 on the GPU: GGUF block weights kept as stored on the device.
# cuda-check (every block format's GEMV, slab GEMM, residual/norm/gated
# forms and embedding lookups against the CPU backend), then a Llama-3-8B-shaped
# random bf16 checkpoint (`kiln dev random-checkpoint --preset llama3-8b --proj-std 0.01`, as
# bench/gpu/hf_bench.py's: at 0.02 the 32-layer random network is chaotic and bf16 logits part
# from f32 ones to cosine 0.998 whatever the engine)
# quantized by Kiln's own quantizer (`kiln quantize --type` each of TYPES),
# each file's CUDA logits (prefill, and prefill + decode steps) against Kiln CPU
# on the same blocks (bench/gpu/quant_parity.py), and batch-1 decode at a
# 512-token context and a 4,096-token prefill of bf16 and each type, each with
# its bytes-roofline fraction (`kiln bench`: bytes read per token over the copy
# bandwidth measured in the same run).
#   KILN=.device/kiln bench/gpu/quant_round.sh OUT_DIR
# NO_CHECK=1 skips cuda-check; NO_PARITY=1 the logits; GGUFPY=1 reads each file back with
# gguf-py (bench/gpu/carry-pygguf.sh first); TYPES (default "q8_0 q4_k"); AWQ=1 adds an AWQ g128
# checkpoint of the same weights (bench/gpu/awq_checkpoint.py; Kiln loads it as Q4_Z blocks);
# FP8=1 the bf16 checkpoint with `--quantize fp8` (Kiln's FP8 blocks, made at load on both sides).
set -uo pipefail
OUT=${1:?usage: bench/gpu/quant_round.sh OUT_DIR}; KILN=${KILN:-.device/kiln}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
TYPES=${TYPES:-q8_0 q4_k}
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/quant.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null
if [ -z "${NO_CHECK:-}" ]; then
  log cuda-check; "$KILN" dev cuda-check -o "$OUT/cuda-check.json" >> "$OUT/quant.log" 2>&1 || log "FAILED cuda-check"
fi
if [ ! -f "$W/ck8b/config.json" ]; then
  log checkpoint; "$KILN" dev random-checkpoint --preset llama3-8b --proj-std 0.01 --tokenizer "$TOK" -o "$W/ck8b" >> "$OUT/quant.log" 2>&1 || log "FAILED checkpoint"
fi
for t in $TYPES; do
  [ -f "$W/$t.gguf" ] || { log "quantize $t"; "$KILN" quantize "$W/ck8b" "$W/$t.gguf" --type "$t" >> "$OUT/quant.log" 2>&1 || log "FAILED quantize $t"; }
done
MODELS=""
for t in $TYPES; do MODELS="$MODELS $t.gguf"; done
if [ -n "${AWQ:-}" ]; then
  [ -f "$W/awq/config.json" ] || { log awq; python3 bench/gpu/awq_checkpoint.py "$W/ck8b" "$W/awq" >> "$OUT/quant.log" 2>&1 || log "FAILED awq"; }
  MODELS="$MODELS awq"
fi
if [ -n "${GGUFPY:-}" ]; then
  # Each file read back by gguf-py's dequantizers against the bf16 checkpoint
  # (bench/gpu/carry-pygguf.sh puts the package in .device/pygguf).
  for t in $TYPES; do
    log "gguf-py $t"; PYTHONPATH=${PYGGUF:-.device/pygguf} python3 bench/gguf_py_check.py "$W/$t.gguf" "$W/ck8b" > "$OUT/ggufpy-$t.json" 2>> "$OUT/quant.log" || log "FAILED gguf-py $t"
  done
fi
if [ -z "${NO_PARITY:-}" ]; then
  # The floor: the bf16 checkpoint itself, CUDA (bf16 activations) against CPU (f32).
  log "parity bf16"; python3 bench/gpu/quant_parity.py --kiln "$KILN" --model "$W/ck8b" --out "$OUT/parity-bf16.json" >> "$OUT/quant.log" 2>&1 || log "FAILED parity bf16"
  for m in $MODELS; do
    log "parity $m"; python3 bench/gpu/quant_parity.py --kiln "$KILN" --model "$W/$m" --out "$OUT/parity-${m%.gguf}.json" >> "$OUT/quant.log" 2>&1 || log "FAILED parity $m"
  done
  if [ -n "${FP8:-}" ]; then
    log "parity fp8"; python3 bench/gpu/quant_parity.py --kiln "$KILN" --model "$W/ck8b" --quantize fp8 --out "$OUT/parity-fp8.json" >> "$OUT/quant.log" 2>&1 || log "FAILED parity fp8"
  fi
fi
if [ -n "${FP8:-}" ]; then
  log "decode fp8"; "$KILN" bench --device cuda -m "$W/ck8b" --quantize fp8 --prompt-tokens 512 --gen-tokens 128 --runs 3 > "$OUT/decode-fp8.json" 2>> "$OUT/quant.log" || log "FAILED decode fp8"
  [ -n "${NO_PREFILL:-}" ] || { log "prefill fp8"; "$KILN" bench --device cuda -m "$W/ck8b" --quantize fp8 --prompt-tokens 4096 --gen-tokens 2 --runs 2 > "$OUT/prefill-fp8.json" 2>> "$OUT/quant.log" || log "FAILED prefill fp8"; }
fi
for m in ck8b $MODELS; do
  f="$W/$m"; m=${m%.gguf}
  log "decode $m"; "$KILN" bench --device cuda -m "$f" --prompt-tokens 512 --gen-tokens 128 --runs 3 > "$OUT/decode-$m.json" 2>> "$OUT/quant.log" || log "FAILED decode $m"
  [ -n "${NO_PREFILL:-}" ] || { log "prefill $m"; "$KILN" bench --device cuda -m "$f" --prompt-tokens 4096 --gen-tokens 2 --runs 2 > "$OUT/prefill-$m.json" 2>> "$OUT/quant.log" || log "FAILED prefill $m"; }
done
if [ -z "${NO_NCU:-}" ] && command -v ncu >/dev/null; then
  # Per-kernel times of q4_k decode steps (serialized by ncu, no cache flush, clocks free).
  log "ncu q4_k decode"
  timeout 240 ncu --csv --cache-control none --clock-control none --metrics gpu__time_duration.sum \
    --launch-skip 3000 --launch-count 600 "$KILN" bench --device cuda -m "$W/q4_k.gguf" \
    --prompt-tokens 512 --gen-tokens 24 --runs 0 > "$OUT/ncu-q4_k.csv" 2>> "$OUT/quant.log" || log "ncu FAILED"
fi
log done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "unreadable", e); continue
    name = os.path.basename(f)
    if name.startswith("ggufpy"):
        print(name, "compared", d["compared"], "worst", d["worst_rel_rms_by_type"], "failures", d["failures"][:3])
    elif name.startswith("parity"):
        print(name, {k: round(v["cosine"], 6) for k, v in d.items() if isinstance(v, dict) and "cosine" in v})
    elif name.startswith(("decode", "prefill")):
        print(name, "decode", round(d["decode_tokens_per_second"]["median"], 1), "prefill", round(d["prefill_tokens_per_second"]["median"]),
              "fraction", round(d["decode_fraction_of_bandwidth"], 4), "bytes/token", d["decode_weight_bytes_per_token"], "copy GB/s", round(d["bandwidth_gbs"]))
    elif name == "cuda-check.json":
        print(name, d.get("num_checks"), "failed:", d.get("failed"))
import csv, collections
f = os.path.join(sys.argv[1], "ncu-q4_k.csv")
if os.path.exists(f):
    rows = [r for r in csv.reader(l for l in open(f) if l.startswith('"'))]
    head, rows = rows[0], rows[1:]
    k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    g = head.index("Grid Size") if "Grid Size" in head else None
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
    tot, cnt = collections.Counter(), collections.Counter()
    for r in rows:
        # By kernel and grid: the same kernel on different shapes apart.
        name = r[k].split("(")[0] + (f" grid {r[g]}" if g is not None else "")
        tot[name] += float(r[v].replace(",", "")) * scale.get(r[u], 1.0)
        cnt[name] += 1
    print("ncu: us total / launches over", len(rows), "launches")
    for name, t in tot.most_common(20):
        print(f"  {name:56s} {t:9.1f} us {cnt[name]:5d}  {t / cnt[name]:7.2f} us each")
PY
