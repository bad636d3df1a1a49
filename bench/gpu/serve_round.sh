#!/usr/bin/env bash
# Issue 19's serving comparison on the GPU: bench/serve_bench.py (closed-loop clients, 512
# random prompt tokens, 256 output tokens with EOS ignored; vLLM's metric names) against
# `kiln serve --device cuda` on the Llama-3-8B-shaped random checkpoint, and — when LLAMA_SERVER
# names a llama-server binary (built by hand from the llama-cpp-python sdist, as
# ../shared/bench/README.md says) and LLAMA_GGUF the F16 GGUF of the same checkpoint made by
# its convert_hf_to_gguf.py — against llama-server in the same lease. SWEEP=1 adds the
# InferenceX grid (1k/1k, 1k/8k, 8k/1k at concurrency 1..64) for Kiln, with its plot.
#   KILN=.device/kiln bench/gpu/serve_round.sh OUT_DIR [CKPT_DIR]
set -uo pipefail
OUT=${1:?usage: bench/gpu/serve_round.sh OUT_DIR [CKPT_DIR]}; K=${KILN:-.device/kiln}
W=${WORK:-$PWD/target/kiln-w}; CK=${2:-$W/ck8b}; LEVELS=${LEVELS:-1,4,16,64}
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f "$CK/config.json" ] || "$K" dev random-checkpoint --preset llama3-8b --proj-std 0.01 --tokenizer bench/smollm2-tokenizer -o "$CK" > /dev/null
wait_up() { for _ in $(seq 600); do curl -sf "$1/health" > /dev/null && return 0; sleep 0.5; done; return 1; }
"$K" serve "$CK" --device cuda --port 18080 > "$OUT/kiln-serve.log" 2>&1 &
kp=$!
wait_up http://127.0.0.1:18080 || { echo "kiln serve did not come up"; tail "$OUT/kiln-serve.log"; }
python3 bench/serve_bench.py --base-url http://127.0.0.1:18080 --label kiln --input-len 512 --output-len 256 \
  --concurrency "$LEVELS" --out "$OUT/serve-kiln.json"
if [ -n "${SWEEP:-}" ]; then
  python3 bench/serve_bench.py --base-url http://127.0.0.1:18080 --label kiln --sweep inferencex \
    --out "$OUT/inferencex-kiln.json" --plot "$OUT/inferencex-kiln.png"
fi
kill $kp; wait $kp 2>/dev/null
if [ -n "${LLAMA_SERVER:-}" ] && [ -n "${LLAMA_GGUF:-}" ]; then
  "$LLAMA_SERVER" -m "$LLAMA_GGUF" -ngl 99 -fa on -np 64 -c 65536 --port 18081 > "$OUT/llama-server.log" 2>&1 &
  lp=$!
  wait_up http://127.0.0.1:18081 || { echo "llama-server did not come up"; tail "$OUT/llama-server.log"; }
  python3 bench/serve_bench.py --base-url http://127.0.0.1:18081 --label llama-server --input-len 512 --output-len 256 \
    --concurrency "$LEVELS" --out "$OUT/serve-llama-server.json"
  kill $lp; wait $lp 2>/dev/null
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = {json.load(open(f))["label"]: json.load(open(f)) for f in sorted(glob.glob(os.path.join(sys.argv[1], "serve-*.json")))}
for label, r in runs.items():
    for m in r["levels"]:
        print(f"{label:13s} c={m['max_concurrency']:3d} out tok/s {m['output_throughput']:8.1f}  TTFT p50 {m['median_ttft_ms']:7.1f} ms  TPOT p50 {m['median_tpot_ms']:6.2f} ms  failed {m['failed']}")
if len(runs) == 2:
    k, l = runs["kiln"]["levels"], runs["llama-server"]["levels"]
    print("kiln / llama-server output tok/s:", [round(a["output_throughput"] / b["output_throughput"], 2) for a, b in zip(k, l)])
PY
