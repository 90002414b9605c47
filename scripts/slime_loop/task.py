"""The task the loop trains on: single-digit sums through the built-in arithmetic env, with a second try.

"What is 2 + 3? Answer with a number." The env (engine/envs/arith.py, through `build_env` below) reads the last
integer of each answer: right ends the trajectory with reward 1 (after a wrong answer, `--later-credit`, default 1);
wrong gets "5 is not right, try again. What is 2 + 3?" and one more turn. The ten questions are 0 + 0, 0 + 1,
1 + 1, 1 + 2, ... 4 + 5: their sums are 0..9, each once, so an answer that ignores the question is right 1 time
in 10 whatever it is (no answer is worth more than another on average: a policy must learn the table to gain).
Train and eval prompts are drawn with different seeds.

The warm start stands for a base model that can sometimes solve the task, as RL on language models starts from
one: a quarter of its answers are the sum, the rest the question's first number, its second or a random digit, a
third each. It leaves a policy that reads the question and answers right about one time in three on the first try
(more where a sum equals an operand, 0 + 0 and 0 + 1); what it gains beyond that it gains from the rewards. A warm
start of operand and random answers alone left a model of this size answering the same spread of digits whatever
the question (it learns the answers' overall spread first), which RL in 20 steps did not get past.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from engine.envs import arith
from engine.envs.arith import ArithEnv

QUESTIONS = [(k // 2, (k + 1) // 2) for k in range(10)]  # 0+0, 0+1, 1+1, 1+2, ..., 4+5: sums 0..9 once each
SYSTEM = "Add."  # short: without a system message Qwen's template puts in a default one of 20 tokens
HIDDEN_SIZE = 256
WARM_START_FILE = "loop_warm_start.json"  # beside the weights: what the warm start learned (report.py reads it)


def question_row(a: int, b: int) -> dict[str, Any]:
    question = f"{a} + {b}"
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {question}? Answer with a number."},
        ],
        "label": str(a + b),
        "metadata": {"question": question},
    }


def write_prompts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(question_row(*rng.choice(QUESTIONS))) + "\n")
    return path


def warm_start(
    path: Path,
    *,
    seed: int,
    hidden_size: int = HIDDEN_SIZE,
    steps: int = 400,
    batch: int = 32,
    right_share: float = 0.25,
) -> Path:
    """A Qwen2 of `hidden_size` (real Qwen vocabulary) taught the answer's format, to read the question and to
    answer the sum `right_share` of the time (see the module's docstring), saved with its tokenizer at `path`
    (slime's --hf-checkpoint), with what it learned in `WARM_START_FILE`: each question's probability of a right
    first answer (the mixture's best is 0.35 on average; 150 steps left 0.21 to 0.24). Returns `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.models import QWEN_FIRST_ADDED_ID, QWEN_VOCAB_SIZE, load_tokenizer

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = load_tokenizer("qwen2.5")
    config = Qwen2Config(
        vocab_size=QWEN_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=QWEN_FIRST_ADDED_ID, eos_token_id=QWEN_FIRST_ADDED_ID + 2,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    prompts = {q: prompt_ids(tokenizer, *q) for q in QUESTIONS}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # 3e-3 stalls on the answers' overall spread
    model.train()
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(batch):
            a, b = rng.choice(QUESTIONS)
            p_ids = prompts[a, b]
            answer = a + b if rng.random() < right_share else rng.choice([a, b, rng.randrange(10)])
            a_ids = tokenizer(f"{answer}<|im_end|>", add_special_tokens=False)["input_ids"]
            ids.append(p_ids + a_ids)
            labels.append([-100] * len(p_ids) + a_ids)
        width = max(map(len, ids))  # right-padded; padding is masked out of attention and of the loss
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        ids_t = torch.tensor([x + [0] * (width - len(x)) for x in ids])
        labels_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        hidden = model.model(input_ids=ids_t, attention_mask=mask).last_hidden_state[:, :-1]
        targets = labels_t[:, 1:]
        keep = targets != -100  # only the answer's positions go through the 151,936-way output layer
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]), targets[keep])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    right = right_first_answer(model, tokenizer, prompts)
    learned = {"steps": steps, "right_share": right_share, "p_right_first": right, "mean": sum(right) / len(right)}
    (path / WARM_START_FILE).write_text(json.dumps(learned))
    return path


def prompt_ids(tokenizer: Any, a: int, b: int) -> list[int]:
    """The question's prompt as slime renders it (`--apply-chat-template`), as token ids."""
    prompt = tokenizer.apply_chat_template(question_row(a, b)["messages"], tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def right_first_answer(model: Any, tokenizer: Any, prompts: dict[tuple[int, int], list[int]]) -> list[float]:
    """Each question's probability that `model`'s first answer is its sum (a one-digit answer's first token),
    from `prompts` (each question's `prompt_ids`)."""
    right = []
    for a, b in QUESTIONS:
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([prompts[a, b]])).logits[0, -1].float(), -1)
        right.append(probs[tokenizer(str(a + b), add_special_tokens=False)["input_ids"][0]].item())
    return right


class CreditedArith(ArithEnv):
    """The arithmetic env with a right answer after a wrong one worth `later_credit` (the env's own: 1.0).

    slime's loss gives a trajectory's reward to every answer in it, so with full credit a wrong first answer
    followed by a right second one is reinforced as much as a right first answer; `later_credit` 0 leaves the
    second try in the trajectory (its feedback and answer are still generated, masked and trained on) but rewards
    only a right first answer."""

    def __init__(self, *args: Any, later_credit: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.later_credit = later_credit

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        observation, done, info = super().step(response_text)
        if self.num_attempts > 1 and info.get("reward"):
            info = info | {"reward": info["reward"] * self.later_credit}
        return observation, done, info


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> CreditedArith:
    """`--rollout-interaction-env-path scripts.slime_loop.task`: the arithmetic env of `arith.build_env`, with
    `later_credit` from slime's args (`loop_later_credit` in the custom config)."""
    env = arith.build_env(sample, args, **kw)
    return CreditedArith(
        env.question, env.answer, max_attempts=env.max_attempts, vision=env.vision,
        later_credit=float(getattr(args, "loop_later_credit", 1.0)),
    )  # fmt: skip
