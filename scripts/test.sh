#!/usr/bin/env bash
# Run Kiln's whole test suite: fetch the real models the tests check against
# (once; later runs only verify hashes), NVRTC for the kernel-compile tests
# and the OpenAI/Anthropic Python SDKs, then run every crate's tests, the
# SDK conformance suite against `kiln serve` and the hub cache
# interoperability test against huggingface_hub.
#
#   scripts/test.sh [extra cargo test args]
#
# Models are kept in $KILN_MODELS_CACHE (default ~/.cache/kiln/models) and
# linked as ./models, so a fresh clone does not download them again.
set -uo pipefail
cd "$(dirname "$0")/.."
cache=${KILN_MODELS_CACHE:-$HOME/.cache/kiln/models}
if [ ! -e models ]; then
  mkdir -p "$cache"
  ln -s "$cache" models
fi
scripts/fetch-models.sh models smollm2 qwen2.5-coder qwen2.5-coder-1.5b gemma3 embeddinggemma minilm || exit 1
# tmux drives `kiln chat` on a real terminal (crates/kiln/tests/chat_tmux.rs).
if ! command -v tmux >/dev/null; then
  apt-get install -y tmux >&2 || { apt-get update >&2 && apt-get install -y tmux >&2; } || {
    echo "test.sh: tmux is missing and could not be installed (apt-get install -y tmux)" >&2; exit 1; }
fi
# Headless Chromium drives the chat page (tests/web/chat_page.py).
if ! command -v chromium >/dev/null; then
  apt-get install -y chromium >&2 || { apt-get update >&2 && apt-get install -y chromium >&2; } || {
    echo "test.sh: chromium is missing and could not be installed (apt-get install -y chromium)" >&2; exit 1; }
fi
# NVRTC and the CUDA headers, so the kernel-compile tests run without a GPU.
KILN_CUDA_HOME=$(scripts/install-nvrtc.sh) || exit 1
export KILN_CUDA_HOME
export LD_LIBRARY_PATH="$KILN_CUDA_HOME/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
# The server through the official OpenAI and Anthropic SDKs, on the binary cargo just built:
# the pinned versions and the newest ones tested.
pysdk=$(scripts/install-sdks.sh pinned) || exit 1
pysdk_newest=$(scripts/install-sdks.sh newest) || exit 1
for sdk in "$pysdk" "$pysdk_newest"; do
  only=$([ "$sdk" = "$pysdk_newest" ] && echo --sdk-only)
  PYTHONPATH="$sdk" python3 tests/sdk/sdk_conformance.py "${CARGO_TARGET_DIR:-target}/debug/kiln" \
    models/SmolLM2-135M-Instruct.Q4_1.gguf $only 2>&1 | tee -a "$log" || status=1
done
# /v1/embeddings through the OpenAI SDK (both sets) on all-MiniLM-L6-v2 and EmbeddingGemma-300M.
for sdk in "$pysdk" "$pysdk_newest"; do
  PYTHONPATH="$sdk" python3 tests/sdk/embeddings_sdk.py "${CARGO_TARGET_DIR:-target}/debug/kiln" models 2>&1 \
    | tee -a "$log" || status=1
done
# Ollama's API through the official `ollama` Python client (SmolLM2; a tool call on Qwen2.5-Coder).
pyollama=$(scripts/install-ollama-client.sh) || exit 1
PYTHONPATH="$pyollama:$pysdk" python3 tests/sdk/ollama_client.py "${CARGO_TARGET_DIR:-target}/debug/kiln" models 2>&1 \
  | tee -a "$log" || status=1
# Structured output: 30 JSON schemas on SmolLM2 and Qwen2.5-Coder, validated by `jsonschema`.
PYTHONPATH="$pysdk" python3 tests/structured/schema_suite.py "${CARGO_TARGET_DIR:-target}/debug/kiln" \
  models/SmolLM2-135M-Instruct.Q4_1.gguf models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 2>&1 | tee -a "$log" || status=1
# Tool calls on Qwen2.5-Coder through the SDKs: auto/required/named, streamed = whole.
PYTHONPATH="$pysdk" python3 tests/tools/qwen_tools.py "${CARGO_TARGET_DIR:-target}/debug/kiln" \
  models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 2>&1 | tee -a "$log" || status=1
# bench/serve_bench.py (the vllm-bench-serve-style client) against `kiln serve`: what it counts.
python3 tests/bench/serve_bench_test.py "${CARGO_TARGET_DIR:-target}/debug/kiln" \
  models/SmolLM2-135M-Instruct.Q4_1.gguf 2>&1 | tee -a "$log" || status=1
# The chat page at / in headless Chromium: key, model list, a streamed answer, Stop, reload.
python3 tests/web/chat_page.py "${CARGO_TARGET_DIR:-target}/debug/kiln" \
  models/SmolLM2-135M-Instruct.Q4_1.gguf "${CARGO_TARGET_DIR:-target}/chat-page.png" 2>&1 | tee -a "$log" || status=1
# `kiln get` and the official huggingface_hub package share one cache (mock hub on loopback).
pyhub=$(scripts/install-hfhub.sh) || exit 1
PYTHONPATH="$pyhub" python3 tests/hub/hub_interop.py "${CARGO_TARGET_DIR:-target}/debug/kiln" 2>&1 | tee -a "$log" || status=1
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit $status
