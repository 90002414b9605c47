"""A scripted SGLang server for the reward checks: tests/sglang_double.py's SGLangDouble, answering each
/generate from what the request holds, as a geo3k policy would.

First turn (no tool call in the context yet): a calc_score tool call whose answer follows the problem's
plan, by arrival order within the problem (the group's samples share a prompt, so the k-th request of a
problem gets plan[k % n]). Later turns: the final answer, `\\boxed{<the answer tried>}`, with no tool
call, which ends slime's geo3k episode. `prompt_tokens` counts each image expanded, as SGLang does.

With `hold_one_group` (the partial-rollout run), the later turns of one problem at a time are held until
they are aborted (SGLang's reply: finish "abort", no tokens): the first problem to ask for a later turn
while none is held, and never one held before. Its group cannot finish, so the step ends without it and
its trajectories are paused mid-episode, envs alive; once the step's pause aborts them the problem is
answered as any other, and the next new problem to reach a later turn is held in turn.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import threading
from collections import Counter
from typing import Any

from PIL import Image

from scripts.slime_train_path.fixtures import BY_ID
from tests.sglang_double import Generate, SGLangDouble, error_body

PROBLEM_RE = re.compile(r"Problem (G\d+)")
ANSWER_RE = re.compile(r'"answer":\s*"((?:[^"\\]|\\.)*)"')


class Geo3kServer(SGLangDouble):
    def __init__(self, tokenizer: Any, processor: Any, *, hold_one_group: bool = False):
        super().__init__()
        self.hold_one_group = hold_one_group
        self.holding: str | None = None  # the problem whose later turns wait for an abort
        self.held_problems: list[str] = []  # every problem held so far, in order
        self.aborted: Counter[str] = Counter()  # problem -> its requests answered "abort"
        self.tokenizer, self.processor = tokenizer, processor
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.image_pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.first_turns: Counter[str] = Counter()
        self.errors: list[str] = []
        self.replies: list[tuple[str, int, str]] = []  # (problem, turn, text)
        self._plan_lock = threading.Lock()
        self._pads: dict[str, int] = {}

    def generate_reply(self, spec: Generate, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            return super().generate_reply(self._scripted(request), request)
        except Exception as exc:  # an answer the bridge can see, and a note for the report
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return 500, error_body(500, f"scripted geo3k server: {exc!r}")

    def _scripted(self, request: dict[str, Any]) -> Generate:
        """The scripted answer to one request: a tool call with the plan's answer first, then the boxed answer."""
        ids = list(request.get("input_ids") or [])
        text = self.tokenizer.decode(ids, skip_special_tokens=False) if ids else str(request.get("text") or "")
        match = PROBLEM_RE.search(text)
        if match is None or match.group(1) not in BY_ID:
            raise ValueError(f"no known 'Problem G<n>' in the request ({len(ids)} ids)")
        problem = BY_ID[match.group(1)]
        tried = [json.loads(f'"{a}"') for a in ANSWER_RE.findall(text)]
        if not tried:
            with self._plan_lock:
                k = self.first_turns[problem.id]
                self.first_turns[problem.id] += 1
            answer = problem.answer if problem.plan[k % len(problem.plan)] else problem.wrong
            call = json.dumps({"name": "calc_score", "arguments": {"answer": answer}})
            reply = f"Let me check my answer.\n<tool_call>\n{call}\n</tool_call>"
        else:
            if self.hold_one_group and self._holds(problem.id):
                with self._plan_lock:
                    self.aborted[problem.id] += 1
                prompt_tokens = self._prompt_tokens(ids, request.get("image_data") or [])
                return Generate(token_ids=[], hold=True, prompt_tokens=prompt_tokens)
            reply = f"The final answer is \\boxed{{{tried[-1]}}}."
        self.replies.append((problem.id, len(tried), reply))
        tokens = self.tokenizer.encode(reply, add_special_tokens=False) + [self.end_id]
        max_new = (request.get("sampling_params") or {}).get("max_new_tokens")
        finish = "stop"
        if max_new is not None and len(tokens) > max_new:
            tokens, finish = tokens[:max_new], "length"
        return Generate(
            token_ids=tokens,
            text=self.tokenizer.decode(tokens, skip_special_tokens=False),
            finish=finish,
            prompt_tokens=self._prompt_tokens(ids, request.get("image_data") or []),
        )

    def _holds(self, problem: str) -> bool:
        with self._plan_lock:
            if self.holding is None and problem not in self.held_problems:
                self.holding = problem
                self.held_problems.append(problem)
            return self.holding == problem

    def control_reply(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """SGLang's control endpoints; once an abort leaves nothing held, the held problem is let go."""
        reply = super().control_reply(method, path, body)
        if path in ("/abort_request", "/pause_generation") and self.num_held == 0:
            with self._plan_lock:
                self.holding = None
        return reply

    def _prompt_tokens(self, ids: list[int], images: list[Any]) -> int:
        """SGLang expands each single image pad to the image's tokens; ids sent already expanded stay."""
        runs = [
            len(m.group()) for m in re.finditer(r"P+", "".join("P" if t == self.image_pad_id else "." for t in ids))
        ]
        if not images or len(runs) != len(images) or any(r != 1 for r in runs):
            return len(ids)
        return len(ids) - len(images) + sum(self._pads_of(image) for image in images)

    def _pads_of(self, image: Any) -> int:
        key = hashlib.sha1(str(image).encode()).hexdigest()
        if key not in self._pads:
            data = str(image).split(",", 1)[1] if str(image).startswith("data:") else str(image)
            try:
                pil = Image.open(io.BytesIO(base64.b64decode(data)))
            except Exception:
                pil = Image.open(data)  # a path
            grid = self.processor.image_processor(images=[pil.convert("RGB")], return_tensors="pt")["image_grid_thw"]
            merge = getattr(self.processor.image_processor, "merge_size", 2)
            self._pads[key] = int(grid.prod(-1).sum()) // (merge * merge)
        return self._pads[key]
