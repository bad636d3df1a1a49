#!/usr/bin/env bash
# Install the official OpenAI and Anthropic Python SDKs and the `jsonschema`
# validator (pinned) into DIR (default ~/.cache/kiln/pysdk) for the server
# conformance and structured-output suites. Prints DIR.
set -euo pipefail
dir=${1:-${KILN_PYSDK:-$HOME/.cache/kiln/pysdk}}
if ! PYTHONPATH="$dir" python3 -c "import openai, anthropic, importlib.metadata as m; assert openai.__version__ == '2.54.0' and anthropic.__version__ == '0.125.0' and m.version('jsonschema') == '4.25.1'" 2>/dev/null; then
  mkdir -p "$dir"
  python3 -m pip install --quiet --upgrade --target "$dir" openai==2.54.0 anthropic==0.125.0 jsonschema==4.25.1 >&2
fi
echo "$dir"
