#!/usr/bin/env bash
# slime's own reward path calling the judge's --custom-rm-path entry point:
#   scripts/slime_judge_rm.sh /path/to/slime-checkout
# Imports slime.rollout.rm_hub from the checkout (it needs aiohttp, installed into the project's .venv when
# missing) and, against a local judge server in SGLang's reply format (tests/test_judge.py's JudgeDouble),
# awaits slime's `async_rm(args, sample)` and `batched_async_rm(args, samples)` with slime's own Sample and
# `args.custom_rm_path = "engine.envs.judge.rm.judge_rm"`, as slime/rollout/sglang_rollout.py does.
set -euo pipefail
slime=${1:?usage: scripts/slime_judge_rm.sh /path/to/slime-checkout}
repo=$(cd "$(dirname "$0")/.." && pwd)
python="$repo/.venv/bin/python"
"$python" -c "import aiohttp" 2>/dev/null || "$python" -m pip install -qq aiohttp
cd "$repo"
PYTHONPATH="$repo:$slime${PYTHONPATH:+:$PYTHONPATH}" "$python" - <<'PY'
import asyncio
from argparse import Namespace

from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.utils.types import Sample

from tests.test_judge import GOOD, JudgeDouble


async def main(url: str) -> None:
    args = Namespace(custom_rm_path="engine.envs.judge.rm.judge_rm", rm_type=None, judge={"url": url})
    one = Sample(prompt=[{"role": "user", "content": "Explain DNS."}], response=GOOD)
    reward = await async_rm(args, one)
    assert reward == 0.9, reward
    group = [Sample(prompt="Explain DNS.", response=answer) for answer in (GOOD, "meh")]
    rewards = await batched_async_rm(args, group)
    assert rewards == [0.9, 0.3], rewards
    print(f"slime's async_rm gave {reward}, batched_async_rm gave {rewards}: the judge entry point works under slime")


with JudgeDouble() as server:
    asyncio.run(main(server.url))
PY
