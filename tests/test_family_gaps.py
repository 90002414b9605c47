"""What the engine does today where it does not serve an official template exactly (tests/fixtures/chat_templates;
issue 37 is to close these gaps). Written down as asserted outcomes, so that a change either way shows here:

- every observation an env can send, through each template's encoder: the tokens the engine appends after the
  model's turn carry the observation's content, or the encoder raises and names why (the trajectory ends FAILED
  with that cause). None is ever lost in silence: a template that leaves a message out of what it writes (the
  first system message only, as DeepSeek's, gpt-oss's and MiniMax's write) is `DROPPED`, the encoder's own error.
- a five-turn tool trajectory on the templates of families the engine has no parser for (SGLang's minimax-m2,
  minimax-m3, ling3, minicpm5): the model writes its calls in its own syntax, which the engine reads off the
  template where it can (engine/probe.py), and a tool env is refused at start, naming why, where it cannot.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from PIL import Image

from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner
from engine.envs.tool_calls import ToolCall
from engine.scheduler.reference import run_trajectory
from engine.template_check import load_target
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits
from tests.fakes import ScriptedBackend
from tests.family_fixtures import FAMILY_TEMPLATES, NAMES, family_tokenizer
from tests.test_family_trajectories import CALC, QUESTION, SYSTEM, CalcEnv

CALL = {"role": "tool", "tool_call_id": "call00000", "name": "calc_score"}
CASES: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "USER-OBSERVATION"}],
    "tool": [CALL | {"content": "TOOL-OBSERVATION"}],
    "bare tool": [{"role": "tool", "content": "BARE-TOOL-OBSERVATION"}],  # no call named, as python_tool sends it
    "system": [{"role": "system", "content": "SYSTEM-OBSERVATION"}],  # a `developer` message is sent as this
    "two tools": [CALL | {"content": "TOOL-A"}, CALL | {"tool_call_id": "call00001", "content": "TOOL-B"}],
    "tool, user": [CALL | {"content": "TOOL-C"}, {"role": "user", "content": "USER-D"}],
}
LOST = "lost"  # the delta does not carry the content and nothing says so: never an outcome
DROPPED = "the chat template drops the observation's message 1 (system): the model would never see it"
MIDDLE_SYSTEM = "System message must be at the beginning."
GLM_SYSTEM = "rendered the dummy conversation without its turn end"  # `<|system|>` opens it: no stop token of GLM's
ALTERNATE = "Conversation roles must alternate"
# Its template takes a tool message only after a structured call: the encoder's dummy reply makes one (in OpenAI's
# form, for every family), so tool results reach the model; a later system message is left out.
MINIMAX = {"system": DROPPED}

# The outcome of each case that is not "ok" (the content in the delta): LOST, or a part of what the encoder raises.
OUTCOMES: dict[str, dict[str, str]] = {
    # Both write only the first message's system text; a later system (or developer) message is left out.
    "MiniMaxAI-MiniMax-M2.7": MINIMAX,
    "MiniMaxAI-MiniMax-M3": MINIMAX,
    "Qwen-Qwen3.5-4B": {"system": MIDDLE_SYSTEM},
    # System messages are gathered before the first user turn: a later one goes there, not into the delta.
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": {"system": DROPPED},
    "deepseek-ai-DeepSeek-V3.1": {"system": DROPPED},
    "google-gemma-3-4b-it": dict.fromkeys(("tool", "bare tool", "system", "two tools", "tool, user"), ALTERNATE),
    "mistralai-Devstral-Small-2-24B-Instruct-2512": {"system": "Only user, assistant and tool roles are supported"},
    "mistralai-Mistral-Nemo-Instruct-2407": {
        "bare tool": "Tool call IDs should be alphanumeric strings with length 9!",
        "system": "After the optional system message, conversation roles must alternate",
    },
    "openai-gpt-oss-120b": {"system": DROPPED},  # harmony writes the first system message only
    "zai-org-GLM-4.6V-Flash": {"system": GLM_SYSTEM},
    "zai-org-GLM-4.7-Flash": {"system": GLM_SYSTEM},
    "zai-org-GLM-5.1": {"system": GLM_SYSTEM},
}


def delta_outcome(encoder: ChatEncoder, messages: list[dict[str, Any]]) -> str:
    """What the engine appends for `messages`: "ok" when its tokens carry each message's content, LOST when they
    do not, else what the encoder raises."""
    try:
        encoded = encoder.encode_observation(messages if len(messages) > 1 else messages[0])
    except Exception as exc:  # noqa: BLE001 -- a template's raise_exception, or the encoder's own error
        return f"raises {type(exc).__name__}: {exc}"
    delta = encoder.tokenizer.decode(encoded.token_ids, skip_special_tokens=False)
    return "ok" if all(carried(message["content"].strip(), delta) for message in messages) else LOST


def carried(text: str, delta: str) -> bool:
    """Whether `delta` holds `text`: as it is, or as a JSON string writes it (templates that `tojson` a result)."""
    return any(form in delta for form in (text, json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]))


@pytest.mark.parametrize("name", NAMES)
def test_each_observation_is_in_the_appended_tokens_or_the_encoder_says_why_not(name):
    assert set(OUTCOMES) <= set(NAMES)
    encoder = ChatEncoder(family_tokenizer(name)).for_tools([CALC.schema()])
    for case, messages in CASES.items():
        outcome, expected = delta_outcome(encoder, messages), OUTCOMES.get(name, {}).get(case, "ok")
        assert outcome != LOST, f"{case}: an observation lost in silence"
        if expected == "ok":
            assert outcome == expected, f"{case}: {outcome}"
        else:
            assert outcome.startswith("raises") and expected in outcome, f"{case}: {outcome}"


@pytest.mark.slow
def test_qwen35_image_observations_reach_the_model_with_the_qwen_vl_processor():
    """Qwen3.5 is a VLM that marks an image as Qwen2.5-VL does (`<|vision_start|><|image_pad|><|vision_end|>`),
    so the embedded Qwen2.5-VL processor expands it: a user observation's image and text are both in the delta."""
    target = load_target(str(FAMILY_TEMPLATES / "Qwen-Qwen3.5-4B.jinja"), vision=True)
    encoder = ChatEncoder(target.tokenizer, processor=target.processor)
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    message = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "LOOK-AGAIN"}]}
    encoded = encoder.encode_observation(message)
    delta = encoder.tokenizer.decode(encoded.token_ids, skip_special_tokens=False)
    assert "<|vision_start|><|image_pad|>" in delta and "<|vision_end|>LOOK-AGAIN<|im_end|>" in delta
    assert delta.count("<|image_pad|>") == 4  # 56x56 pixels: 4x4 patches, merged 2x2


# -- families the engine does not know ----------------------------------------------------------------------
# status, stop reason, turns (run without the start check), whether a run refuses an env that declares tool
# observations (`check_env`), and whether the model's calls are read (by a parser read off the template).
UNKNOWN_FAMILIES: dict[str, tuple[Status, StopReason, int, bool, bool]] = {
    # `<minimax:tool_call>\n<invoke name="calc_score">\n<parameter name="answer">40</parameter>...`: the template's
    # call syntax is read off it (engine/probe.py), so each call is read, answered with a tool message, and the
    # episode ends at the final answer 42, as for a known family.
    "MiniMaxAI-MiniMax-M2.7": (Status.COMPLETED, StopReason.ENV_DONE, 5, False, True),
    # `]<]minimax[>[<invoke ...>]<]minimax[>[<answer>40]<]minimax[>[</answer>`: each argument closes with a tag
    # named after it, which no probed layout reads; the start check refuses a tool env, naming why. Run anyway,
    # the env's first parse_tool_calls gets the same reason as an error (no other family's syntax is tried), so
    # the env errs at the first call.
    "MiniMaxAI-MiniMax-M3": (Status.FAILED, StopReason.ENV_ERROR, 1, True, False),
    # `<tool_call>calc_score\n<arg_key>answer</arg_key>\n<arg_value>40</arg_value>\n</tool_call>`: read off it.
    "inclusionAI-Ling-3.0-flash": (Status.COMPLETED, StopReason.ENV_DONE, 5, False, True),
    # `<function name="calc_score"><param name="answer">40</param></function>`: read off it.
    "openbmb-MiniCPM5-1B": (Status.COMPLETED, StopReason.ENV_DONE, 5, False, True),
}


def written_reply(encoder: ChatEncoder, context: list[dict[str, Any]], message: dict[str, Any]) -> list[int]:
    """The tokens the model writes for an assistant `message` after `context`: what its template writes for the
    message after its own generation prompt (reasoning, calls in the family's syntax), to its end-of-turn token.
    The engine's `sampled_reply` cannot: without a family it has no syntax to write."""
    before = encoder.render(context, add_generation_prompt=True)
    after = encoder.render([*context, message], add_generation_prompt=False)
    assert after.startswith(before), "the template writes the reply otherwise than after its generation prompt"
    end = encoder.end_texts[0]
    ids = encoder.tokenizer(after[len(before) :].split(end, 1)[0], add_special_tokens=False)["input_ids"]
    return [*ids, encoder.tokenizer.convert_tokens_to_ids(end)]


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(UNKNOWN_FAMILIES))
async def test_a_five_turn_tool_trajectory_of_a_family_the_engine_does_not_know(name):
    status, stop_reason, num_turns, refuses_tools, reads_calls = UNKNOWN_FAMILIES[name]
    encoder = ChatEncoder(family_tokenizer(name)).for_tools([CALC.schema()])
    assert encoder.family is None
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    conversation, sampled = list(prompt), []
    for i, (call, answer) in enumerate([(True, 40), (True, 41), (False, 41), (True, 42), (False, 42)]):
        turn: dict[str, Any] = {
            "role": "assistant", "content": "" if call else f"The answer is {answer}.",
            "reasoning_content": f"I add 17 and 25, attempt {i}.",
        }  # fmt: skip
        if call:
            turn["tool_calls"] = [encoder.tool_call(f"call{i:05d}", "calc_score", {"answer": str(answer)})]
        sampled.append(written_reply(encoder, conversation, turn))
        answered = CALL | {"tool_call_id": f"call{i:05d}", "content": "checked"}  # the result it would have had
        conversation += [turn, answered if call else {"role": "user", "content": "Check your answer."}]

    try:
        encoder.check_env("calc", ("user", "tool"), skip_special_tokens=True)
        refused = False
    except ValueError as error:
        refused = "is of no model family the engine has a parser for" in str(error)
        assert "its call syntax cannot be read off it" in str(error)
    assert refused == refuses_tools
    # the same env where SGLang's own parser reads the model's calls on its servers (turn_parser)
    encoder.check_env("calc", ("user", "tool"), skip_special_tokens=True, read_by_server=True)

    trajectory, env = Trajectory(prompt=list(prompt)), CalcEnv()
    sampling = SamplingParams(max_new_tokens=512, stop_token_ids=encoder.stop_token_ids, skip_special_tokens=True)
    await run_trajectory(
        trajectory, backend=ScriptedBackend(sampled), env=EnvRunner(env), encoder=encoder, sampling=sampling,
        limits=TurnLimits(max_turns=8),
    )  # fmt: skip
    assert (trajectory.status, trajectory.stop_reason, len(trajectory.turns)) == (status, stop_reason, num_turns)
    if reads_calls:  # the calls of turns 1, 2 and 4, each as the model wrote it
        made = [ToolCall("calc_score", {"answer": a}) if a else None for a in ("40", "41", None, "42", None)]
        assert env.calls == made
    else:
        assert env.calls == [None] * len(env.calls)  # no call of the model's was read
    if refuses_tools:  # run anyway: the env's first parse_tool_calls is the start check's reason, as an error
        assert "this model's tool calls cannot be read" in trajectory.errors[-1].message
        assert encoder.parser_problem in trajectory.errors[-1].message
    response = list(trajectory.response_ids)
    for i, turn in enumerate(trajectory.turns):  # the replies as written, the observations the env sent, whole
        assert response[turn.start : turn.start + turn.num_generated] == sampled[i]
        if turn.observation is not None:
            start = turn.start + turn.num_generated
            delta = encoder.tokenizer.decode(response[start : start + turn.num_observation], skip_special_tokens=False)
            assert turn.observation["content"] in delta


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_no_observation_of_any_text_is_lost_in_silence(name):
    """Any text, as a user or a tool message, through each template: carried into the appended tokens, or the
    encoder says why not (never LOST)."""
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    tokenizer = family_tokenizer(name)
    encoder = ChatEncoder(tokenizer).for_tools([CALC.schema()])
    text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(content=text, role=st.sampled_from(("user", "tool")))
    def check(content: str, role: str) -> None:
        # text the tokenizer itself writes back otherwise (its normalization: U+F900 as U+8C48) is not the
        # template's doing; whitespace alone is nothing to carry
        assume(
            content.strip() and tokenizer.decode(tokenizer(content, add_special_tokens=False)["input_ids"]) == content
        )
        message = (CALL if role == "tool" else {"role": "user"}) | {"content": content}
        assert delta_outcome(encoder, [message]) != LOST, (role, content)

    check()
