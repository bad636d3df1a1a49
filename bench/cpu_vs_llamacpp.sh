#!/usr/bin/env bash
# Kiln vs llama.cpp on CPU, side by side on the same GGUF files and machine:
# 512-token prefill and 128 greedy decode steps, 2 threads, engines run
# alternately. Writes one JSON file under bench/results/.
#
#   bench/cpu_vs_llamacpp.sh [REPS]
#
# llama.cpp is node-llama-cpp's prebuilt CPU build (npm), driven by the
# anchor script in ../shared/bench (or $ANCHOR_SCRIPT); it is installed into
# $ANCHOR_DIR (default ~/.cache/kiln/nlc) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-3}
anchor_dir=${ANCHOR_DIR:-$HOME/.cache/kiln/nlc}
anchor_script=${ANCHOR_SCRIPT:-../shared/bench/llamacpp_cpu_bench.mjs}
if [ ! -d "$anchor_dir/node_modules/node-llama-cpp" ]; then
  mkdir -p "$anchor_dir"
  (cd "$anchor_dir" && echo '{"private":true,"type":"module"}' > package.json &&
   NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --ignore-scripts --omit=optional \
     node-llama-cpp@3.22.1 @node-llama-cpp/linux-x64@3.22.1 >&2)
fi
cargo build --release -p kiln >&2
commit=$(git rev-parse --short HEAD)
out=bench/results/$(date -u +%Y-%m-%d)_cpu-vs-llamacpp_$(hostname -s)_$commit.json
tmp=$(mktemp -d)
models=${MODELS:-"SmolLM2-135M-Instruct.Q4_1.gguf qwen2.5-coder-0.5b-instruct-q4_k_m.gguf qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
for m in $models; do
  "${CARGO_TARGET_DIR:-target}/release/kiln" --threads 2 bench -m "models/$m" --prompt-tokens 512 --gen-tokens 128 \
    --runs "$reps" --profile > "$tmp/kiln_$m.json"
  NODE_LLAMA_CPP_DIR="$anchor_dir" NODE_LLAMA_CPP_SKIP_DOWNLOAD=true \
    node "$anchor_script" --model "models/$m" --threads 2 --reps "$reps" --pp 512 --tg 128 \
    --chat-prompt "Write a very long and detailed essay about the history of the printing press." \
    > "$tmp/llama_$m.json"
  "${CARGO_TARGET_DIR:-target}/release/kiln" --threads 2 --cpu-matmul fast bench -m "models/$m" --prompt-tokens 512 \
    --gen-tokens 128 --runs "$reps" --profile > "$tmp/kilnfast_$m.json"
done
python3 - "$tmp" "$out" "$commit" "$models" <<'PY'
import json, os, platform, sys
tmp, out, commit, models = sys.argv[1:]
report = {"what": "Kiln CPU backend (exact path: GGUF blocks repacked at load into 16-row groups, f32 activations) vs llama.cpp (node-llama-cpp 3.22.1 prebuilt CPU), "
                  "same GGUF, 512-token prompt, 128 greedy decode steps, 2 threads, engines alternated (Kiln exact, llama.cpp, Kiln --cpu-matmul fast: prefill products in bf16 on AMX tiles or AVX512-BF16 vdpbf16ps, the kernel named in kiln_cpu_matmul_fast.cpu_matmul_fast_kernel, weights and activations in bf16)",
          "commit": commit, "machine": platform.node(), "cpu": None, "models": {}}
for m in models.split():
    k = json.load(open(os.path.join(tmp, f"kiln_{m}.json")))
    l = json.load(open(os.path.join(tmp, f"llama_{m}.json")))
    report["cpu"] = k["cpu"]
    kp, kd = k["prefill_tokens_per_second"]["median"], k["decode_tokens_per_second"]["median"]
    lp, ld = l["prefill_tok_s_median"], l["decode_tok_s_median"]
    f = json.load(open(os.path.join(tmp, f"kilnfast_{m}.json")))
    fp, fd = f["prefill_tokens_per_second"]["median"], f["decode_tokens_per_second"]["median"]
    report["models"][m] = {
        "kiln": k, "llamacpp": l, "kiln_cpu_matmul_fast": f,
        "ratio_prefill_kiln_over_llamacpp": kp / lp, "ratio_decode_kiln_over_llamacpp": kd / ld,
        "ratio_prefill_kiln_fast_over_llamacpp": fp / lp, "ratio_decode_kiln_fast_over_llamacpp": fd / ld,
        # Both engines read the same weight bytes per decode step (same file).
        "decode_gbs": {"kiln": k["decode_achieved_gbs"],
                       "llamacpp": ld * k["decode_weight_bytes_per_token"] / 1e9,
                       "read_bandwidth_measured": k["bandwidth_gbs"]},
    }
    print(f"{m}: kiln prefill {kp:.0f} / decode {kd:.1f} tok/s; llama.cpp {lp:.0f} / {ld:.1f}; "
          f"ratio {kp/lp:.2f} / {kd/ld:.2f}; kiln decode {k['decode_achieved_gbs']:.1f} GB/s of "
          f"{k['bandwidth_gbs']:.1f} measured, llama.cpp {ld * k['decode_weight_bytes_per_token'] / 1e9:.1f}; "
          f"--cpu-matmul fast prefill {fp:.0f} ({fp/lp:.2f}x) decode {fd:.1f}")
json.dump(report, open(out, "w"), indent=1)
print("wrote", out)
PY
rm -rf "$tmp"
