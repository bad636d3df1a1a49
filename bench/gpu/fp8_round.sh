#!/usr/bin/env bash
# Issue 18 on the GPU, FP8 past the decode rows and the FP8 KV cache, on the
# Llama-3-8B-shaped random bf16 checkpoint (`kiln dev random-checkpoint --preset llama3-8b
# --proj-std 0.01`, as bench/gpu/quant_round.sh's):
#   * cuda-check (the FP8 products on cuBLASLt's block-scaled GEMM against the CPU on
#     activations rounded as the device rounds them; the FP8 cache's kernels);
#   * 4,096-token prefill and 64 concurrent requests (128-token prompts, 128 new tokens,
#     `kiln bench-engine`) with bf16 weights and `--quantize fp8`, in the same lease;
#   * the FP8 KV cache (`kv`): `kiln fit`'s pool with and without it, CUDA logits of 300
#     random tokens (200 in one prefill step, then decode steps) against the bf16 cache's;
#     (`kv32k`) batch-1 decode at a 32,768-token context with each cache;
#   * FP8 weights' logits against Kiln CPU (bench/gpu/quant_parity.py), activations rounded to
#     E4M3 past the decode rows (the default) and exact (KILN_FP8_ACTIVATIONS=0);
#   * batch-1 decode at a 512-token context: bf16, FP8, Q4_K (`kiln quantize --type q4_k`);
#   * Q4_K prefill's per-op profile against bf16's (`kiln bench --profile`);
#   * (`big`) a Qwen2.5-32B-shaped Q4_K_M file fitted to a 24 GiB card and run with the KV pool
#     capped to what such a card leaves.
#   KILN=.device/kiln bench/gpu/fp8_round.sh OUT_DIR [STAGES]
# STAGES (default "check prefill engine kv kv32k parity decode profile") picks the parts; WORK (default
# target/kiln-w) keeps the checkpoint between calls on a warm machine.
set -uo pipefail
OUT=${1:?usage: bench/gpu/fp8_round.sh OUT_DIR [STAGES]}; STAGES=${2:-check prefill engine kv kv32k parity decode profile}
K=${KILN:-.device/kiln}; W=${WORK:-$PWD/target/kiln-w}
mkdir -p "$OUT" "$W"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
bench_line() { python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print(sys.argv[2], 'prefill', round(d['prefill_tokens_per_second']['median']), 'decode', round(d['decode_tokens_per_second']['median'],1), 'fraction', round(d.get('decode_fraction_of_bandwidth',0),3), 'copy GB/s', round(d.get('bandwidth_gbs',0)))" "$1" "$2"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if has check; then
  timeout 240 "$K" dev cuda-check -o "$OUT/cuda-check.json" > "$OUT/check.log" 2>&1; el "cuda-check rc=$?"
  python3 - "$OUT/cuda-check.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); cs = d.get("checks", [])
print("checks", len(cs), "failed", [(c["op"], round(c["rel_err"], 4)) for c in cs if not c["pass"]][:20])
for c in cs:
    if "fp8" in c["op"]:
        print("  ", c["op"], round(c["rel_err"], 5), c["pass"])
PY
fi
# (Trained context 32,768, so the 32k decode fits it.)
echo '{"max_position_embeddings": 32768}' > "$W/ctx32k.json"
[ -f "$W/ck8b/config.json" ] || { timeout 150 "$K" dev random-checkpoint --preset llama3-8b --proj-std 0.01 --config "$W/ctx32k.json" --tokenizer bench/smollm2-tokenizer -o "$W/ck8b" > /dev/null 2>&1; el "checkpoint rc=$?"; }
if has prefill; then
  for q in bf16 fp8; do
    a=(); [ $q = bf16 ] || a=(--quantize $q)
    timeout 200 "$K" bench --device cuda -m "$W/ck8b" "${a[@]}" --prompt-tokens 4096 --gen-tokens 2 --runs 2 > "$OUT/prefill4096-$q.json" 2> "$OUT/prefill4096-$q.err"; el "prefill $q rc=$?"
    bench_line "$OUT/prefill4096-$q.json" "prefill4096 $q"
  done
fi
if has engine; then
  for q in bf16 fp8; do
    a=(); [ $q = bf16 ] || a=(--quantize $q)
    timeout 200 "$K" bench-engine --device cuda -m "$W/ck8b" "${a[@]}" --concurrency 64 --prompt-tokens 128 --gen-tokens 128 > "$OUT/engine64-$q.json" 2> "$OUT/engine64-$q.err"; el "engine64 $q rc=$?"
    tail -c 700 "$OUT/engine64-$q.json"; echo
  done
fi
if has kv; then
  for kv in auto fp8; do
    "$K" --kv-cache-dtype $kv fit "$W/ck8b" --device cuda --json 2>/dev/null > "$OUT/fit-kv-$kv.json"
    python3 -c "import json; d=json.load(open('$OUT/fit-kv-$kv.json')); print('fit kv=$kv max_context', d['max_context'], 'kv_bytes_per_token', d['kv_bytes_per_token'], 'pool bytes', d['kv_pool_bytes'])"
  done
  python3 - "$K" "$W/ck8b" "$OUT" <<'PY'
import json, random, subprocess, sys
import numpy as np
k, m, out = sys.argv[1:4]
rng = random.Random(3); ids = ",".join(str(rng.randrange(100, 49000)) for _ in range(300))
res = {}
for kv in ["auto", "fp8"]:
    f = f"{out}/logits-kv-{kv}.npy"
    subprocess.run([k, "--kv-cache-dtype", kv, "dev", "logits", "-m", m, "--device", "cuda", "--ids", ids,
                    "--prefill", "200", "-o", f], check=True, stderr=subprocess.DEVNULL)
    res[kv] = np.load(f).astype(np.float64)
a, b = res["auto"], res["fp8"]
cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
r = {"cosine_min": cos.min(), "cosine_mean": cos.mean(), "prefill_rows_cosine_min": cos[:200].min(),
     "decode_rows_cosine_min": cos[200:].min(), "argmax_agreement": (a.argmax(1) == b.argmax(1)).mean()}
r = {k: round(float(v), 6) for k, v in r.items()}
print("fp8 KV logits against bf16 KV:", r)
json.dump(r, open(f"{out}/kv-fp8-logits.json", "w"), indent=1)
PY
  el "kv logits"
fi
if has kv32k; then
  # (32,512 prompt tokens + 128 new ones: the trained 32,768.) The FP8 cache also with 8 keys
  # in flight a thread (KILN_DECODE_FP8_U; 4 by default).
  for v in auto fp8 fp8-u8; do
    kv=${v%-u8}; defs=""; [ "$v" = fp8-u8 ] && defs="KILN_DECODE_FP8_U=8"
    KILN_KERNEL_DEFINES=$defs timeout 240 "$K" --kv-cache-dtype $kv bench --device cuda -m "$W/ck8b" --prompt-tokens 32512 --gen-tokens 128 --runs 2 > "$OUT/decode32k-kv-$v.json" 2> "$OUT/decode32k-kv-$v.err"; el "decode 32k kv=$v rc=$?"
    bench_line "$OUT/decode32k-kv-$v.json" "decode32k kv=$v" || tail -c 600 "$OUT/decode32k-kv-$v.err"
  done
fi
if has parity; then
  # W8A8 (the default: prefill rows on the FP8 tensor cores) and W8A16 (KILN_FP8_ACTIVATIONS=0).
  for act in 1 0; do
    KILN_FP8_ACTIVATIONS=$act timeout 240 python3 bench/gpu/quant_parity.py --kiln "$K" --model "$W/ck8b" --quantize fp8 --out "$OUT/parity-fp8-act$act.json" > /dev/null 2> "$OUT/parity-act$act.err"; el "parity fp8 activations=$act rc=$?"
    python3 -c "import json; d=json.load(open('$OUT/parity-fp8-act$act.json')); print('parity fp8 act=$act', {k: round(v['cosine'], 6) for k, v in d.items() if isinstance(v, dict) and 'cosine' in v})"
  done
fi
if has decode; then
  # DECODE (default "bf16 fp8 q4_k"): also q8_0 or q4_k_m (`kiln quantize`), awq
  # (bench/gpu/awq_checkpoint.py).
  for m in ${DECODE:-bf16 fp8 q4_k}; do
    case $m in
      bf16) a=(-m "$W/ck8b");;
      fp8) a=(-m "$W/ck8b" --quantize fp8);;
      awq) [ -f "$W/awq/config.json" ] || { timeout 300 python3 bench/gpu/awq_checkpoint.py "$W/ck8b" "$W/awq" > /dev/null 2>&1; el "awq rc=$?"; }
           a=(-m "$W/awq");;
      *) [ -f "$W/$m.gguf" ] || { timeout 200 "$K" quantize "$W/ck8b" "$W/$m.gguf" --type $m > /dev/null 2>&1; el "quantize $m rc=$?"; }
         a=(-m "$W/$m.gguf");;
    esac
    timeout 150 "$K" bench --device cuda "${a[@]}" --prompt-tokens 512 --gen-tokens 128 --runs 3 > "$OUT/decode512-$m.json" 2> "$OUT/decode512-$m.err"; el "decode $m rc=$?"
    bench_line "$OUT/decode512-$m.json" "decode512 $m"
  done
fi
if has profile; then
  # PROFILE (default "bf16 q4_k"; also fp8): a 4,096-token prefill's per-op times.
  for m in ${PROFILE:-bf16 q4_k}; do
    case $m in
      bf16) a=(-m "$W/ck8b");;
      fp8) a=(-m "$W/ck8b" --quantize fp8);;
      *) [ -f "$W/$m.gguf" ] || { timeout 200 "$K" quantize "$W/ck8b" "$W/$m.gguf" --type $m > /dev/null 2>&1; el "quantize $m rc=$?"; }
         a=(-m "$W/$m.gguf");;
    esac
    timeout 150 "$K" bench --device cuda "${a[@]}" --prompt-tokens 4096 --gen-tokens 2 --runs 1 --profile > "$OUT/profile-$m.json" 2> "$OUT/profile-$m.err"; el "profile $m rc=$?"
    python3 - "$OUT/profile-$m.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].split("/")[-1], "prefill tok/s", round(d["prefill_tokens_per_second"]["median"]))
for o in d["profile"]["prefill"]["ops"][:8]:
    print("   ", o["op"], round(o["seconds"] * 1e3, 1), "ms", o["calls"])
PY
  done
fi
if has big; then
  # Issue 18's 24 GB card: a Qwen2.5-32B-shaped Q4_K_M GGUF (random blocks in llama.cpp's mix,
  # `kiln dev random-gguf`; the SmolLM2 tokenizer's 49,152-row vocabulary instead of 152,064,
  # so about 0.7 GB lighter than the real file), planned by `kiln fit` for a 24 GiB card at an
  # 8k context, then run on this GPU with the KV pool capped to 2,560 MiB (8k tokens of this
  # shape need 2.1 GB) — batch-1 decode at a 512-token context.
  [ -f "$W/q32b.gguf" ] || { timeout 300 "$K" dev random-gguf --config bench/gpu/shapes/qwen2.5-32b.json --tokenizer bench/smollm2-tokenizer --type q4_k_m -o "$W/q32b.gguf" 2>&1 | tail -1; el "random-gguf 32b"; }
  "$K" fit "$W/q32b.gguf" --device cuda --memory-bytes $((24 << 30)) --context 8192 --json > "$OUT/fit-32b-24gib.json" 2>/dev/null
  python3 -c "import json; d=json.load(open('$OUT/fit-32b-24gib.json')); print('fit 32b q4_k_m on 24 GiB: fits', d['fits'], 'weights', d['weights_bytes'], 'total', d['total_bytes'])"
  timeout 240 "$K" bench-engine --device cuda -m "$W/q32b.gguf" --kv-mib 2560 --concurrency 1 --prompt-tokens 512 --gen-tokens 128 > "$OUT/engine1-32b.json" 2> "$OUT/engine1-32b.err"; el "32b bench rc=$?"
  python3 -c "import json; d=json.load(open('$OUT/engine1-32b.json')); m=d['levels'][0]; print('32b q4_k_m batch-1 decode', round(m['decode_tokens_per_second'],1), 'tok/s; device peak bytes', d['device_memory']['peak_active_bytes'])"
fi
el done
