#!/usr/bin/env bash
# Runs slime's own plugin contract tests against Turnstile's bridge:
#   scripts/slime_contracts.sh /path/to/slime-checkout
# slime's contract tests need slime's light dependencies (aiohttp, pybase64, omegaconf, pylatexenc, pillow,
# httpx[http2]), installed here into the project's .venv when missing. transformers is imported before the
# tests, so their stand-in for it is not used: the bridge's embedded default needs the real one.
set -euo pipefail
slime=${1:?usage: scripts/slime_contracts.sh /path/to/slime-checkout}
repo=$(cd "$(dirname "$0")/.." && pwd)
python="$repo/.venv/bin/python"
"$python" -c "import pybase64, omegaconf, pylatexenc, aiohttp, PIL, httpx, h2" 2>/dev/null \
  || "$python" -m pip install -qq pybase64 omegaconf pylatexenc aiohttp pillow 'httpx[http2]'
cd "$slime"
export SLIME_CONTRACT_ROLLOUT_FUNCTION_PATH=bridge.slime.generate_rollout
export SLIME_CONTRACT_CUSTOM_GENERATE_FUNCTION_PATH=bridge.slime.generate
PYTHONPATH="$repo:$slime${PYTHONPATH:+:$PYTHONPATH}" "$python" -c "
import sys, transformers, pytest
sys.exit(pytest.main(['tests/plugin_contracts/test_plugin_rollout_contracts.py',
                      'tests/plugin_contracts/test_plugin_generate_contracts.py', '-q', '-p', 'no:cacheprovider']))
"
