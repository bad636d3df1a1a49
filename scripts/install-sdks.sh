#!/usr/bin/env bash
# Install the official OpenAI and Anthropic Python SDKs and the `jsonschema`
# validator into a folder for the server conformance and structured-output
# suites, and print the folder. Two pinned sets are tested:
#
#   scripts/install-sdks.sh [pinned]   openai 2.54.0, anthropic 0.125.0  (~/.cache/kiln/pysdk)
#   scripts/install-sdks.sh newest     openai 3.57.0, anthropic 2.15.0   (~/.cache/kiln/pysdk-newest)
#
# "newest" is the newest release of each on 2026-12-01; bump it (and the
# README's "tested with" line) when new ones come out.
set -euo pipefail
set_name=${1:-pinned}
case $set_name in
  pinned) openai=2.54.0 anthropic=0.125.0 dir=${KILN_PYSDK:-$HOME/.cache/kiln/pysdk} ;;
  newest) openai=3.57.0 anthropic=2.15.0 dir=$HOME/.cache/kiln/pysdk-newest ;;
  *) echo "usage: $0 [pinned|newest]" >&2; exit 2 ;;
esac
jsonschema=4.25.1
if ! PYTHONPATH="$dir" python3 -c "import openai, anthropic, importlib.metadata as m; assert openai.__version__ == '$openai' and anthropic.__version__ == '$anthropic' and m.version('jsonschema') == '$jsonschema'" 2>/dev/null; then
  rm -rf "$dir"
  mkdir -p "$dir"
  python3 -m pip install --quiet --upgrade --target "$dir" "openai==$openai" "anthropic==$anthropic" "jsonschema==$jsonschema" >&2
fi
echo "$dir"
