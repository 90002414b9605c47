"""Built-in env and reward: an LLM judge that scores a conversation with a second model.

    turnstile run --env judge                                  # the env: answer, critique, revise, score
    --custom-rm-path engine.envs.judge.rm.judge_rm             # slime's reward hook
    RolloutEngine(..., reward_fn=JudgeReward(judge, encoder))  # a Turnstile reward function

The judge (client.py) renders the conversation into a rubric prompt (prompt.py, rubric.md), asks SGLang's
/generate or an OpenAI-compatible /v1/chat/completions (transports.py) in batches, with a timeout and a
retry budget, and reads a score from the reply; with no judge URL it runs the embedded default's tiny
local model. Its settings (settings.py) come from TURNSTILE_JUDGE_* variables or a `judge:` mapping.
docs/envs/judge.md has the whole story.
"""

from engine.envs.judge.client import Judge, JudgeStatistics, Verdict
from engine.envs.judge.env import QUESTIONS, JudgeEnv, build_env, make_prompts
from engine.envs.judge.errors import JudgeError, UnparseableScore
from engine.envs.judge.rm import JudgeReward, judge_rm
from engine.envs.judge.settings import JudgeSettings

__all__ = [
    "QUESTIONS",
    "Judge",
    "JudgeEnv",
    "JudgeError",
    "JudgeReward",
    "JudgeSettings",
    "JudgeStatistics",
    "UnparseableScore",
    "Verdict",
    "build_env",
    "judge_rm",
    "make_prompts",
]
