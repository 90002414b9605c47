#!/usr/bin/env bash
# slime's own loop trains on Turnstile: slime's train.py and train_async.py, run as they are, with
# --rollout-function-path bridge.slime.generate_rollout, a local Ray with a logical GPU, and a CPU trainer
# actor (scripts/slime_loop/trainer.py: slime's advantage and loss code on a Hugging Face model) given to
# slime's create_training_models. Weights go by slime's disk path every step; the embedded model loads them, or
# with --backend sglang two SGLang CPU servers (the SGLang venv of `make sglang`) behind the router slime starts.
#   scripts/slime_loop.sh /path/to/slime-checkout [--out DIR] [--drivers train,train_async] [--seeds 0,1,2]
#                         [--controls none,inverted_mask] [--steps 20] [--backend embedded|sglang]
#                         [--slime-commit SHA]
# Writes DIR/report.json and DIR/report.png (eval reward and slime's mismatch metric per step, per run), and
# exits 1 when a run fails, loses a prompt, does not learn, or the negative control learns unflagged.
# slime's light dependencies are installed into the project's .venv when missing; what cannot be installed
# (Megatron, sglang, wandb) is stubbed, and each stub is printed with its reason (scripts/slime_loop/stubs.py).
set -euo pipefail
slime=${1:?usage: scripts/slime_loop.sh /path/to/slime-checkout [options]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
python="$repo/.venv/bin/python"
"$python" -c "import pybase64, omegaconf, pylatexenc, aiohttp, PIL, sympy, pyarrow, httpx, h2, ray, matplotlib" 2>/dev/null \
  || "$python" -m pip install -qq pybase64 omegaconf pylatexenc aiohttp pillow sympy pyarrow 'httpx[http2]' 'ray>=2.40' matplotlib
cd "$repo"
exec "$python" -m scripts.slime_loop.main "$slime" "$@"
