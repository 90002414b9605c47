#!/usr/bin/env bash
# Proves with slime's own code that what bridge.slime.generate_rollout returns can be trained on:
#   scripts/slime_train_path.sh /path/to/slime-checkout [--slime-commit SHA] [--runs NAME,...] [--keep-tmp]
# slime's data source, geo3k env, reward functions, dynamic filter, RolloutManager post-processing,
# build_dp_schedule and rollout/eval metrics run from the checkout on the bridge's output (see
# scripts/slime_train_path/__init__.py). slime's light pure-Python dependencies are installed into the
# project's .venv when missing; what cannot be installed (sglang, wandb) is stubbed, and each stub is printed.
# The checkout's commit is read with git when it is a repo, else from --slime-commit or $SLIME_COMMIT.
set -euo pipefail
slime=${1:?usage: scripts/slime_train_path.sh /path/to/slime-checkout [--slime-commit SHA] [--runs NAME,...]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
python="$repo/.venv/bin/python"
"$python" -c "import pybase64, omegaconf, pylatexenc, aiohttp, PIL, sympy, pyarrow, httpx, h2" 2>/dev/null \
  || "$python" -m pip install -qq pybase64 omegaconf pylatexenc aiohttp pillow sympy pyarrow 'httpx[http2]'
cd "$repo"
exec "$python" -m scripts.slime_train_path "$slime" "$@"
