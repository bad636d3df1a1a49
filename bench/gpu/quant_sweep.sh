#!/usr/bin/env bash
# Tuning sweep of the block-quantized decode products (issue 18): the 8B-shaped
# q4_k and q8_0 files as quant_round.sh makes them, batch-1 decode under each
# NAME:ENV of VARIANTS (ENV entries VAR=VALUE joined by commas), then the default's
# logits against Kiln CPU (quant_parity.py; NO_PARITY=1 skips it). TYPES: the files
# (default "q4_k q8_0"). One decode-<fmt>-<name>.json each.
#   KILN=.device/kiln bench/gpu/quant_sweep.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu/quant_sweep.sh OUT_DIR}; KILN=${KILN:-.device/kiln}
W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
VARIANTS=${VARIANTS:-"base: w16:KILN_KERNEL_DEFINES=KILN_QGEMV_RING_WORDS=16 w24:KILN_KERNEL_DEFINES=KILN_QGEMV_RING_WORDS=24 w64:KILN_KERNEL_DEFINES=KILN_QGEMV_RING_WORDS=64 grid3:KILN_QGEMV_BLOCKS_PER_SM=3,KILN_KERNEL_DEFINES=KILN_QGEMV_MIN_BLOCKS=3"}
TYPES=${TYPES:-q4_k q8_0}
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/sweep.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null
[ -f "$W/ck8b/config.json" ] || { log checkpoint; "$KILN" dev random-checkpoint --preset llama3-8b --proj-std 0.01 --tokenizer "$TOK" -o "$W/ck8b" >> "$OUT/sweep.log" 2>&1; }
for t in $TYPES; do
  [ -f "$W/$t.gguf" ] || { log "quantize $t"; "$KILN" quantize "$W/ck8b" "$W/$t.gguf" --type "$t" >> "$OUT/sweep.log" 2>&1; }
done
for v in $VARIANTS; do
  name=${v%%:*}; envs=${v#*:}
  for t in $TYPES; do
    log "decode $t $name ($envs)"
    env ${envs//,/ } "$KILN" bench --device cuda -m "$W/$t.gguf" --prompt-tokens 512 --gen-tokens 128 --runs 3 \
      > "$OUT/decode-$t-$name.json" 2>> "$OUT/sweep.log" || log "FAILED decode $t $name"
  done
done
[ -n "${NO_PARITY:-}" ] || python3 bench/gpu/quant_parity.py --kiln "$KILN" --model "$W/q4_k.gguf" --out "$OUT/parity-q4_k.json" >> "$OUT/sweep.log" 2>&1 || log "FAILED parity"
log done
grep -i "warn\|unavailable" "$OUT/sweep.log" | sort | uniq -c | head -5
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f)); n = os.path.basename(f)
    if n.startswith("decode"):
        print(n, round(d["decode_tokens_per_second"]["median"], 1), "fraction", round(d["decode_fraction_of_bandwidth"], 4))
    else:
        print(n, {k: round(v["cosine"], 6) for k, v in d.items() if isinstance(v, dict) and "cosine" in v})
PY
