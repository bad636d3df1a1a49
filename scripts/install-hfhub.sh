#!/usr/bin/env bash
# Install the official huggingface_hub Python package (pinned) into DIR
# (default ~/.cache/kiln/pyhfhub) for the cache interoperability test
# (tests/hub/hub_interop.py). Prints DIR.
set -euo pipefail
dir=${1:-${KILN_PYHFHUB:-$HOME/.cache/kiln/pyhfhub}}
if ! PYTHONPATH="$dir" python3 -c "import huggingface_hub; assert huggingface_hub.__version__ == '2.4.0'" 2>/dev/null; then
  mkdir -p "$dir"
  python3 -m pip install --quiet --upgrade --target "$dir" huggingface_hub==2.4.0 >&2
fi
echo "$dir"
