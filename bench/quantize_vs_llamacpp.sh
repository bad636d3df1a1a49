#!/usr/bin/env bash
# `kiln quantize` round trip, checked by llama.cpp: each model's GGUF is
# exported to a bf16 Hugging Face directory (`kiln convert`), quantized back
# to GGUF by `kiln quantize --type q8_0|q4_k`, read by gguf-py
# (bench/gguf_py_check.py: every tensor dequantized, compared with its bf16
# source), and run by
# Kiln (`kiln dev logits`, exact path) and by the llama.cpp anchor
# (node-llama-cpp's prebuilt CPU build, bench/llamacpp_logits.mjs) on the
# same tokens (llama.cpp's tokenization of one text, teacher-forced). Writes
# one JSON file under bench/results/: next-token logit agreement between the
# engines on every position (beside the same on the original file, the floor
# set by the engines' own numerics: llama.cpp quantizes activations), and
# each file's distance from the bf16 model.
#
#   bench/quantize_vs_llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
anchor_dir=${ANCHOR_DIR:-$HOME/.cache/kiln/nlc}
if [ ! -d "$anchor_dir/node_modules/node-llama-cpp" ]; then
  mkdir -p "$anchor_dir"
  (cd "$anchor_dir" && echo '{"private":true,"type":"module"}' > package.json &&
   NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --ignore-scripts --omit=optional \
     node-llama-cpp@3.22.1 @node-llama-cpp/linux-x64@3.22.1 >&2)
fi
# gguf-py (llama.cpp's Python reader), for an independent read of each file.
pygguf=${PYGGUF_DIR:-$HOME/.cache/kiln/pygguf}
[ -d "$pygguf/gguf" ] || python3 -m pip install --quiet --target "$pygguf" gguf==0.19.0 >&2
cargo build --release -p kiln >&2
kiln=${CARGO_TARGET_DIR:-target}/release/kiln
commit=$(git rev-parse --short HEAD)
out=bench/results/$(date -u +%Y-%m-%d)_quantize-vs-llamacpp_$(hostname -s)_$commit.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/text.txt" <<'TXT'
The printing press, invented by Johannes Gutenberg around 1440, changed how knowledge spread across Europe. def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)
TXT
models=${MODELS:-"SmolLM2-135M-Instruct.Q4_1.gguf qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
types=${TYPES:-"q8_0 q4_k"}
for m in $models; do
  name=${m%.gguf}
  "$kiln" convert "models/$m" "$tmp/$name-bf16" --dtype bf16 >&2
  # The floor: the two engines on the original file (llama.cpp's own converter's).
  NODE_LLAMA_CPP_DIR="$anchor_dir" NODE_LLAMA_CPP_SKIP_DOWNLOAD=true node bench/llamacpp_logits.mjs \
    --model "models/$m" --text-file "$tmp/text.txt" --out "$tmp/$name-original.llama.f32" > "$tmp/$name-original.llama.json"
  ids=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['tokens'])))" "$tmp/$name-original.llama.json")
  "$kiln" --threads 2 dev logits --device cpu -m "models/$m" --ids "$ids" -o "$tmp/$name-original.kiln.npy" >&2
  for t in $types; do
    start=$(date +%s.%N)
    "$kiln" --threads 2 quantize "$tmp/$name-bf16" "$tmp/$name-$t.gguf" --type "$t" 2> "$tmp/$name-$t.quantize.log"
    end=$(date +%s.%N)
    echo "$end - $start" | bc > "$tmp/$name-$t.seconds"
    cat "$tmp/$name-$t.quantize.log" >&2
    PYTHONPATH="$pygguf" python3 bench/gguf_py_check.py "$tmp/$name-$t.gguf" "$tmp/$name-bf16" > "$tmp/$name-$t.ggufpy.json"
    NODE_LLAMA_CPP_DIR="$anchor_dir" NODE_LLAMA_CPP_SKIP_DOWNLOAD=true node bench/llamacpp_logits.mjs \
      --model "$tmp/$name-$t.gguf" --text-file "$tmp/text.txt" --out "$tmp/$name-$t.llama.f32" \
      > "$tmp/$name-$t.llama.json"
    ids=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['tokens'])))" "$tmp/$name-$t.llama.json")
    "$kiln" --threads 2 dev logits --device cpu -m "$tmp/$name-$t.gguf" --ids "$ids" -o "$tmp/$name-$t.kiln.npy" >&2
    [ -f "$tmp/$name-bf16.kiln.npy" ] ||
      "$kiln" --threads 2 dev logits --device cpu -m "$tmp/$name-bf16" --ids "$ids" -o "$tmp/$name-bf16.kiln.npy" >&2
    ls -l "$tmp/$name-$t.gguf" | awk '{print $5}' > "$tmp/$name-$t.bytes"
  done
done
python3 - "$tmp" "$out" "$commit" "$models" "$types" <<'PY'
import json, os, platform, sys
import numpy as np
tmp, out, commit, models, types = sys.argv[1:]
def logsoftmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
report = {"what": "kiln quantize round trip: GGUF -> kiln convert (bf16 HF dir) -> kiln quantize --type T -> "
                  "the written GGUF run by Kiln (exact path, f32 activations) and by llama.cpp (node-llama-cpp 3.22.1 "
                  "prebuilt CPU, quantized activations), teacher-forced on llama.cpp's tokenization of one text; "
                  "log-softmax compared at every position",
          "commit": commit, "machine": platform.node(), "models": {}}
for m in models.split():
    name = m[:-5]
    bf16 = logsoftmax(np.load(os.path.join(tmp, f"{name}-bf16.kiln.npy")).astype(np.float64))
    def agreement(tag):
        meta = json.load(open(os.path.join(tmp, f"{name}-{tag}.llama.json")))
        n, v = len(meta["tokens"]), meta["vocab"]
        kiln = logsoftmax(np.load(os.path.join(tmp, f"{name}-{tag}.kiln.npy")).astype(np.float64))
        llama = logsoftmax(np.fromfile(os.path.join(tmp, f"{name}-{tag}.llama.f32"), dtype=np.float32)
                           .reshape(n, v)[:, :kiln.shape[1]].astype(np.float64))
        p = np.exp(kiln)
        mask = p > 1e-3  # where the model puts real mass
        d = np.abs(kiln - llama)
        kl = (p * (kiln - llama)).sum(-1)
        return kiln, {
            "tokens": n,
            "max_abs_logprob_diff_where_p_gt_1e-3": float(d[mask].max()),
            "mean_abs_logprob_diff_where_p_gt_1e-3": float(d[mask].mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "argmax_agreement": float((kiln.argmax(-1) == llama.argmax(-1)).mean()),
        }
    _, floor = agreement("original")
    entry = {"original_file_kiln_vs_llamacpp": floor}
    print(f"{name} original file: Kiln vs llama.cpp mean |dlogp| {floor['mean_abs_logprob_diff_where_p_gt_1e-3']:.4f} "
          f"KL {floor['mean_kl']:.2e} argmax {floor['argmax_agreement']:.3f}")
    for t in types.split():
        kiln, k = agreement(t)
        kl_bf16 = (np.exp(bf16) * (bf16 - kiln)).sum(-1)
        e = {
            "file_bytes": int(open(os.path.join(tmp, f"{name}-{t}.bytes")).read()),
            "quantize_seconds": float(open(os.path.join(tmp, f"{name}-{t}.seconds")).read()),
            "quantize_log": open(os.path.join(tmp, f"{name}-{t}.quantize.log")).read().strip(),
            "gguf_py_read": json.load(open(os.path.join(tmp, f"{name}-{t}.ggufpy.json"))),
            "kiln_vs_llamacpp": k,
            "quantized_vs_bf16_kiln": {
                "mean_kl_bf16_to_quantized": float(kl_bf16.mean()),
                "argmax_agreement": float((kiln.argmax(-1) == bf16.argmax(-1)).mean()),
            },
        }
        entry[t] = e
        print(f"{name} {t}: Kiln vs llama.cpp max |dlogp| {k['max_abs_logprob_diff_where_p_gt_1e-3']:.4f} "
              f"mean {k['mean_abs_logprob_diff_where_p_gt_1e-3']:.4f} KL {k['mean_kl']:.2e} argmax {k['argmax_agreement']:.3f}; "
              f"vs bf16 KL {e['quantized_vs_bf16_kiln']['mean_kl_bf16_to_quantized']:.2e}; {e['quantize_seconds']:.1f} s")
    report["models"][m] = entry
json.dump(report, open(out, "w"), indent=1)
print("wrote", out)
PY
