#!/usr/bin/env bash
# Kiln's main job with no set-up: fetch the default model (SmolLM2-135M-Instruct)
# if it is missing, build the release binary, and run `kiln` with ARGS
# (default: `serve --temperature 0`, the APIs for the default model on
# 127.0.0.1:8080, greedy unless a request sets a temperature: the 135M demo
# model's first token is "The" at 15 % and "L" at 14 %, so sampled answers
# to the README's question drift into broken French a third of the time).
#
#   scripts/run.sh [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${KILN_MODELS_CACHE:-$HOME/.cache/kiln/models}
if [ ! -e models ]; then
  mkdir -p "$cache"
  ln -s "$cache" models
fi
scripts/fetch-models.sh models smollm2 >&2
[ $# -eq 0 ] && set -- serve --temperature 0
# Cargo's own progress stays visible: the first build takes a few minutes.
echo "run.sh: building kiln (release; the first build takes a few minutes)" >&2
cargo build --release -p kiln
exec cargo run --quiet --release -p kiln -- "$@"
