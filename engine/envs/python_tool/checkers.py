"""How a final answer is judged: a number compared with the expected one, or a function run against
test cases in the sandbox. The verdict is computed here, in the env's process, never taken from what
the sandboxed code prints about itself, so an answer cannot claim its own success.

    checker = FunctionTests(name="add", cases=(((1, 2), 3),))
    verdict = await checker.check("def add(a, b):\\n    return a + b", SandboxLimits())
    verdict.passed, verdict.detail        # True, "1 of 1 test cases pass"
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.envs.python_tool.sandbox import SandboxLimits, run_python

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?")
_FENCE = re.compile(r"^```[a-zA-Z0-9]*\n(.*?)\n?```$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool
    detail: str


class NumberAnswer(BaseModel):
    """The answer's last number (commas ignored, `a/b` read as a fraction) equals `value`, within
    `tolerance` (absolute)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["number"] = "number"
    value: float
    tolerance: float = Field(0.0, ge=0)

    async def check(self, answer: str, limits: SandboxLimits) -> Verdict:
        numbers = _NUMBER.findall(answer.replace(",", ""))
        if not numbers:
            return Verdict(False, "the answer holds no number")
        given = _to_float(numbers[-1])
        if math.isclose(given, self.value, rel_tol=0.0, abs_tol=max(self.tolerance, 1e-9)):
            return Verdict(True, f"{numbers[-1]} is right")
        return Verdict(False, f"{numbers[-1]} is not the expected number")


class FunctionTests(BaseModel):
    """The answer is Python code defining `name`; each case `(args, expected)` calls `name(*args)` in the
    sandbox and compares the result's repr with `expected`'s. Every case must pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["function"] = "function"
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    cases: tuple[tuple[tuple[Any, ...], Any], ...] = Field(min_length=1)

    async def check(self, answer: str, limits: SandboxLimits) -> Verdict:
        marker = f"results-{secrets.token_hex(8)}:"
        result = await run_python(self._harness(_code_of(answer), marker), limits)
        reported = [line for line in result.stdout.splitlines() if line.startswith(marker)]
        if not reported:
            return Verdict(False, f"the code did not run to the tests: {result.observation()}")
        try:
            outcomes = json.loads(reported[-1].removeprefix(marker))
        except json.JSONDecodeError:
            return Verdict(False, "the test results did not come back whole")
        expected = [_digest(repr(want)) for _, want in self.cases]
        num_passed = sum(got == want for got, want in zip(outcomes, expected, strict=False))
        detail = f"{num_passed} of {len(self.cases)} test cases pass"
        return Verdict(num_passed == len(self.cases) and len(outcomes) == len(expected), detail)

    def _harness(self, code: str, marker: str) -> str:
        """The answer, then one call per case, the SHA-256 of each result's repr (or the exception's name)
        printed as a JSON list on one line after `marker` (a fresh one each check): short, however long
        the results, so the line is never cut from the output."""
        calls = ", ".join(repr(args) for args, _ in self.cases)
        return (
            f"{code}\n\n"
            "def _turnstile_results(calls):\n"
            "    import hashlib, json\n"
            "    out = []\n"
            "    for args in calls:\n"
            "        try:\n"
            f"            out.append(hashlib.sha256(repr({self.name}(*args)).encode()).hexdigest())\n"
            "        except Exception as exc:\n"
            "            out.append('raised ' + type(exc).__name__)\n"
            f"    print('\\n{marker}' + json.dumps(out))\n\n"
            f"_turnstile_results([{calls}])\n"
        )


Checker = Annotated[NumberAnswer | FunctionTests, Field(discriminator="kind")]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _code_of(answer: str) -> str:
    """The answer's code, without a Markdown fence around it."""
    text = answer.strip()
    fenced = _FENCE.match(text)
    return fenced.group(1) if fenced else text


def _to_float(text: str) -> float:
    if "/" in text:
        top, bottom = text.split("/")
        return float(top) / float(bottom) if float(bottom) else math.nan
    return float(text)
