#!/usr/bin/env bash
# Install the official `ollama` Python client (pinned) into DIR (default
# ~/.cache/kiln/pyollama) for tests/sdk/ollama_client.py. Prints DIR.
set -euo pipefail
dir=${1:-${KILN_PYOLLAMA:-$HOME/.cache/kiln/pyollama}}
if ! PYTHONPATH="$dir" python3 -c "import importlib.metadata as m; assert m.version('ollama') == '0.6.3'" 2>/dev/null; then
  rm -rf "$dir"
  mkdir -p "$dir"
  python3 -m pip install --quiet --upgrade --target "$dir" ollama==0.6.3 >&2
fi
echo "$dir"
