"""The task the loop trains on: single-digit sums through the built-in arithmetic env, with a second try.

"What is 3 + 4? Answer with a number." The env (engine/envs/arith.py) reads the last integer of each answer:
right ends the trajectory with reward 1; wrong gets "5 is not right, try again. What is 3 + 4?" and one more
turn. Sums stay below 10, so an answer is one digit. Train and eval prompts are drawn with different seeds
(the eval file is held out: no row of it is in the training file).

The warm start teaches the format only: the answer is one digit and the turn ends. Its digits are drawn at
random, independent of the question, so the warm-started policy is right by chance (about 1 in 10 a try) and
whatever it learns beyond that, it learns from the rewards.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

MAX_OPERAND = 2  # a, b in 0..2: nine questions, answers 0..4 (a model answering at random is right 1 in 10)


def pairs(max_operand: int = MAX_OPERAND) -> list[tuple[int, int]]:
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if a + b <= 9]


SYSTEM = "Add."  # short: without a system message Qwen's template puts in a default one of 20 tokens


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


def write_prompts(path: Path, n: int, seed: int, max_operand: int = MAX_OPERAND) -> Path:
    rng, questions = random.Random(seed), pairs(max_operand)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(question_row(*rng.choice(questions))) + "\n")
    return path


def warm_start(
    path: Path,
    *,
    seed: int,
    right_share: float = 0.0,
    max_operand: int = MAX_OPERAND,
    hidden_size: int = 128,
    steps: int = 120,
    batch: int = 32,
) -> Path:
    """A Qwen2 of `hidden_size` (real Qwen vocabulary) taught the answer's format, saved with its tokenizer at
    `path` (slime's --hf-checkpoint): a `right_share` of its examples answer right, the rest with a random
    digit. Returns `path`."""
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(batch):
            a, b = rng.choice(pairs(max_operand))
            row = question_row(a, b)
            prompt = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer = a + b if rng.random() < right_share else rng.randrange(10)
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
    return path
