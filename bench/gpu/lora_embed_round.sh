#!/usr/bin/env bash
# Issue 23 on CUDA (one GPU round in two parts, each one device call):
#   part "parity": cuda-check (layer_norm, gelu_erf and lora_add against the CPU among the rest);
#     LoRA logits against transformers with each adapter merged (bench/gpu/lora_parity.py) on a
#     random SmolLM2-135M-shaped checkpoint (3 adapters, rank 8, every projection) and a random
#     Qwen2.5-0.5B-shaped one (q/k/v biases; 3 adapters of rank 16, one rsLoRA); a batch mixing
#     the base and three adapters against each sequence alone (kiln dev lora-mix); sentence
#     embeddings of random MiniLM- and EmbeddingGemma-shaped encoders against transformers
#     (bench/gpu/embed_parity.py).
#   part "throughput": the Llama-3-8B shape (bench/gpu/hf_bench.py save8b), 8 random rank-16
#     adapters on every projection; kiln bench-engine at 64 concurrent requests without adapters
#     and with request i on adapter i mod 8, alternated twice, same binary, same KV pool.
#   KILN=.device/kiln bench/gpu/lora_embed_round.sh OUT_DIR parity|throughput
#   (throughput: REPS and MODES, default "1 2" and "base lora lora-mma128 lora-mma1", pick runs;
#   lora-x8: the 8-column expands, KILN_LORA_EXPAND8=1)
set -uo pipefail
OUT=${1:?usage: bench/gpu/lora_embed_round.sh OUT_DIR parity|throughput}; PART=${2:?part}
KILN=${KILN:-.device/kiln}; W=${WORK:-/tmp/kiln-round}; TOK=bench/smollm2-tokenizer
mkdir -p "$OUT" "$W"; OUT=$(cd "$OUT" && pwd)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0} PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LOG="$OUT/$PART.log"
log() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
run() { log "$*"; "$@" >> "$LOG" 2>&1 || log "FAILED ($?): $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null
if [ "$PART" = parity ]; then
  run "$KILN" dev cuda-check -o "$OUT/cuda-check.json"
  run "$KILN" dev random-checkpoint --preset smollm2-135m --tokenizer "$TOK" -o "$W/ck135m"
  run python3 bench/gpu/make_lora.py --ckpt "$W/ck135m" --out "$W/lora135m-" --count 3 --rank 8 --alpha 16
  run python3 - "$W/ckqwen" "$TOK" <<'PY'
import sys, shutil, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
d, tok = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
c = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=49152, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=True)
m = Qwen2ForCausalLM(c).to(torch.bfloat16)
with torch.no_grad():  # biases as trained models have them, not zeros
    for l in m.model.layers:
        for p in (l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj):
            p.bias.normal_(0, 0.1)
m.save_pretrained(d)
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(f"{tok}/{f}", d)
PY
  run python3 bench/gpu/make_lora.py --ckpt "$W/ckqwen" --out "$W/loraqwen-" --count 2 --rank 16 --alpha 32 --seed 1
  run python3 bench/gpu/make_lora.py --ckpt "$W/ckqwen" --out "$W/loraqwen-rs" --count 1 --rank 16 --alpha 16 --rslora --seed 2 --targets q_proj,v_proj,down_proj
  run python3 bench/gpu/lora_parity.py --kiln "$KILN" --ckpt "$W/ck135m" --adapters "$W/lora135m-0,$W/lora135m-1,$W/lora135m-2" --out "$OUT/lora-parity-135m.json"
  run python3 bench/gpu/lora_parity.py --kiln "$KILN" --ckpt "$W/ckqwen" --adapters "$W/loraqwen-0,$W/loraqwen-1,$W/loraqwen-rs0" --out "$OUT/lora-parity-qwen.json"
  IDS=$(python3 -c "import random; random.seed(3); print(','.join(str(random.randrange(100, 49000)) for _ in range(40)))")
  run "$KILN" dev lora-mix --device cuda -m "$W/ck135m" --ids "$IDS" --lora "$W/lora135m-0" --lora "$W/lora135m-1" --lora "$W/lora135m-2" -o "$OUT/lora-mix-135m.json"
  run "$KILN" dev lora-mix --device cuda -m "$W/ckqwen" --ids "$IDS" --lora "$W/loraqwen-0" --lora "$W/loraqwen-1" --lora "$W/loraqwen-rs0" -o "$OUT/lora-mix-qwen.json"
  run "$KILN" dev random-checkpoint --preset tiny --config bench/gpu/shapes/embeddinggemma-300m.json --tokenizer "$TOK" -o "$W/ck-egemma"
  run python3 bench/gpu/embed_parity.py --kiln "$KILN" --work "$W" --egemma "$W/ck-egemma" --out "$OUT/embed-parity.json"
fi
if [ "$PART" = throughput ]; then
  [ -f "$W/ck8b/READY" ] || run python3 bench/gpu/hf_bench.py --stages save8b --cfg-dir "$TOK" --save-dir "$W/ck8b" --out "$OUT/save8b.json"
  run python3 bench/gpu/make_lora.py --ckpt "$W/ck8b" --out "$W/lora8b-" --count 8 --rank 16 --alpha 32
  L=""; for i in 0 1 2 3 4 5 6 7; do L="$L --lora $W/lora8b-$i"; done
  # lora: the CUDA-core kernels throughout (the default until the tensor-core pair is checked);
  # lora-mma128: prefill steps (128 rows and more) on the tensor cores; lora-mma1: every step.
  for rep in ${REPS:-1 2}; do
    for mode in ${MODES:-base lora lora-mma128 lora-mma1}; do
      log "bench-engine $mode rep $rep"
      # shellcheck disable=SC2086
      env $( case $mode in lora-mma*) echo KILN_LORA_MMA_ROWS=${mode#lora-mma};; lora-x8) echo KILN_LORA_EXPAND8=1;; esac ) \
      "$KILN" bench-engine --device cuda -m "$W/ck8b" --concurrency 64 --prompt-tokens 256 --gen-tokens 128 \
        --prefix-tokens 16 --kv-mib 16384 $( [ $mode != base ] && echo $L ) \
        > "$OUT/engine-$mode-$rep.json" 2>> "$LOG" || log "FAILED bench-engine $mode $rep"
      python3 -c "
import json; d=json.load(open('$OUT/engine-$mode-$rep.json'))['levels'][0]
print('$mode $rep', {k: round(d[k], 4) for k in ('generated_tokens_per_second', 'decode_tokens_per_second', 'ttft_median_seconds', 'wall_seconds', 'forward_seconds') if k in d})" || true
    done
  done
fi
log done
