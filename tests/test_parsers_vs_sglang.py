"""Our output parsers against SGLang's own, the code that reads these turns when SGLang serves the model: each
family's documented outputs (tests/parser_outputs.py) go through SGLang 0.5.23's `ReasoningParser` and then
`FunctionCallParser(...).parse_non_stream`, in the SGLang venv (tests/sglang_cpu/parsers_probe.py), and the
calls' names and arguments, the content and the reasoning must be ours.

SGLang keeps only the text before the first call as content and does not strip it; the cases put text only
there, and both sides are compared stripped. Where SGLang reads a documented form differently, `SGLANG_DIFFERS`
says why, and the test checks that it still does (so the note goes when SGLang changes).
Skips (fails under TURNSTILE_REQUIRE_SGLANG=1) without the SGLang venv (`make sglang`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.parsers import get_parser
from tests.parser_outputs import DOCUMENTED, TOOLS, Documented

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).parent / "sglang_cpu" / "parsers_probe.py"
# SGLang's --reasoning-parser for each family (deepseekv31's is "deepseek-v3"; llama3 and mistral have none)
REASONING_PARSERS = {
    "qwen25": "qwen3", "qwen3_coder": "qwen3", "glm45": "glm45", "glm47": "glm45", "kimi_k2": "kimi_k2",
    "gpt-oss": "gpt-oss", "deepseekv31": "deepseek-v3", "llama3": None, "mistral": None,
}  # fmt: skip
SGLANG_DIFFERS = {
    "gpt-oss-one-call": "SGLang's GptOssDetector.has_tool_call looks for `<|start|>assistant<|channel|>commentary`; "
    "a turn whose first message is the call has its <|start|>assistant in the prompt, so SGLang finds no call",
    "gpt-oss-recipient-in-role": "SGLang's GptOssDetector reads the recipient only as `to=... <|constrain|>json"
    "<|message|>` after <|channel|>; harmony lets it stand in the role header, before <|channel|>",
    "gpt-oss-no-call-token": "SGLang's harmony parser holds a commentary message without <|call|> or <|end|> as "
    "unfinished; a turn ends without <|call|> when the stop token is stripped",
}


@pytest.fixture(scope="module")
def sglang_parsed() -> dict[str, dict]:
    """SGLang's reading of every documented case, by case id."""
    from tests.sglang_cpu.server import is_installed, venv_dir, venv_python

    if not is_installed():
        reason = f"no SGLang venv at {venv_dir()}: run `python -m tests.sglang_cpu.server install`"
        if os.environ.get("TURNSTILE_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    cases = [
        {
            "parser": case.family,
            "reasoning_parser": REASONING_PARSERS[case.family],
            "force_reasoning": case.in_reasoning,  # the prompt opened the reasoning block
            "text": case.text,
            "tools": TOOLS,
        }
        for case in DOCUMENTED
    ]
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(venv_python()), str(PROBE)], input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=600
    )
    if done.returncode != 0:
        pytest.fail(f"SGLang's parsers failed:\n{done.stderr[-3000:]}")
    return dict(zip((case.id for case in DOCUMENTED), json.loads(done.stdout), strict=True))


def reading(case: Documented) -> dict:
    """Our parse of a case, in the probe's shape, compared stripped as SGLang's is."""
    turn = get_parser(case.family).parse(case.text, tools=TOOLS, in_reasoning=case.in_reasoning)
    calls = [{"name": call.name, "arguments": call.arguments} for call in turn.tool_calls]
    return {"reasoning": turn.reasoning, "content": turn.content, "calls": calls}


def stripped(parsed: dict) -> dict:
    return parsed | {"reasoning": parsed["reasoning"].strip(), "content": parsed["content"].strip()}


@pytest.mark.parametrize("case", DOCUMENTED, ids=lambda case: case.id)
def test_our_parse_of_a_documented_turn_is_sglangs(case, sglang_parsed):
    theirs = stripped(sglang_parsed[case.id])
    if case.id in SGLANG_DIFFERS:
        assert theirs["calls"] != reading(case)["calls"], f"SGLang now agrees; drop the note: {SGLANG_DIFFERS[case.id]}"
        return
    assert reading(case) == theirs


def test_every_family_is_checked_against_sglang():
    assert {case.family for case in DOCUMENTED} == set(REASONING_PARSERS)
    assert SGLANG_DIFFERS.keys() <= {case.id for case in DOCUMENTED}
