"""What one turn does: the seed's five steps, numbered where `Scheduler.drive` runs them.
  1. encode the prompt (`encode_prompt`);
  2. generate, tokens appended with loss mask 1 (`generate_turn`);
  3. check whether generation ended the trajectory: context length, token budget (`out_of_room`);
  4. step the env; done? out of turns? (`step_env`, `end_of_turn`);
  5. append the observation: loss mask 0, images on the rollout and the training side (`observe`).

The turn-level scheduler holds a generation slot for step 2 and an env slot for step 4, and retries
each within its budgets; `engine.scheduler.reference.run_trajectory`, the sequential reference, is the
same loop for one trajectory with one slot each and no retries. The token budget
(`max_tokens`, response side) shrinks with generated and observation tokens and caps each turn's
`max_new_tokens`. A turn that hits the per-turn cap ends there: it is closed with the end-of-turn
token (mask 0) and the env still answers it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.backends.base import (
    Backend,
    GenerateResult,
    SamplingParams,
    TokenListener,
    can_stream,
    takes_token_buffers,
)
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner, StepResult
from engine.errors import BackendError, ObservationError, PromptError, ResponseError, TurnError
from engine.parsers import OutputParser, ParsedTurn, use_parser
from engine.parsers.read import ReadTurn
from engine.trajectory import STOP_OF_STAGE, StopReason, Trajectory, Turn

log = logging.getLogger(__name__)

SPEC_KEYS = ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct", "completion_tokens")


@dataclass(frozen=True, slots=True)
class TurnLimits:
    max_turns: int = 8
    max_tokens: int = 4096  # response budget of a trajectory: generated + observation tokens
    max_context_len: int | None = None  # prompt + response, the model's window

    def remaining(self, trajectory: Trajectory) -> int:
        """Tokens the trajectory may still add."""
        left = self.max_tokens - trajectory.response_length
        if self.max_context_len is not None:
            left = min(left, self.max_context_len - len(trajectory.tokens))
        return left


async def encode_prompt(trajectory: Trajectory, encoder: ChatEncoder) -> None:
    """Step 1: the prompt's tokens, and its images on both sides (in a worker thread when it has images
    or long text). A prompt the template or the processor cannot encode is a BAD_PROMPT."""
    try:
        encoded = await encoder.aencode_prompt(trajectory.prompt, trajectory.prompt_images)
    except Exception as exc:
        where = f"group {trajectory.group_id}, member {trajectory.index}"
        raise PromptError(f"the prompt of {where} does not encode: {exc!r}") from exc
    trajectory.set_prompt(encoded.token_ids)
    trajectory.image_data.extend(encoded.image_data)
    trajectory.train_inputs.add(encoded.train_inputs)


async def generate_turn(
    trajectory: Trajectory,
    backend: Backend,
    sampling: SamplingParams,
    limits: TurnLimits,
    *,
    rid: str | None = None,
    encoder: ChatEncoder | None = None,
    on_listener_error: Callable[[Exception], None] | None = None,
) -> GenerateResult:
    """Step 2: one generation request, its tokens appended with loss mask 1.

    A turn whose generation was aborted (finish reason `abort`) is continued with what is left of its
    `max_new_tokens` (or the trajectory's tighter `turn_cap`), not started anew: partial rollout resumes
    trajectories mid-turn. With `encoder`,
    a token only its VLM processor writes (`ChatEncoder.vision_token_ids`: an early policy samples one
    now and then) is a BAD_RESPONSE: the turn keeps the tokens before it, and its trajectory ends.

    With the trajectory's `token_listener` set and a backend that streams, the listener gets the new tokens as
    they are generated (`_token_tap`): a continued turn streams only its new tokens, and a cut turn none past the
    cut. A listener that raises is cleared from the trajectory and reported to `on_listener_error`; the turn goes
    on."""
    turn = _open_turn(trajectory)
    cap = sampling.max_new_tokens if trajectory.turn_cap is None else min(sampling.max_new_tokens, trajectory.turn_cap)
    left = min(cap - turn.num_generated, limits.remaining(trajectory))
    if left <= 0:
        raise ValueError(f"trajectory {trajectory.id}: no room left to generate (check out_of_room first)")
    params = sampling if left == sampling.max_new_tokens else replace(sampling, max_new_tokens=left)
    if trajectory.turn_stop:
        params = replace(params, stop=tuple(dict.fromkeys((*params.stop, *trajectory.turn_stop))))
    forbidden = encoder.vision_token_ids if encoder is not None else frozenset()
    streaming = {}
    if trajectory.token_listener is not None and can_stream(backend):
        streaming["on_tokens"] = _token_tap(trajectory, forbidden, on_listener_error)
    started = time.monotonic()
    # a copy (the trajectory's array grows while a body may still be built from it in a worker thread)
    prompt = trajectory.tokens[:] if takes_token_buffers(backend) else trajectory.tokens.tolist()
    result = await backend.generate(
        prompt,
        params,
        trajectory.image_data or None,
        rid=rid or uuid.uuid4().hex,
        session_id=trajectory.session_id,
        **streaming,
    )
    turn.generate_seconds += time.monotonic() - started
    cut = next((i for i, token in enumerate(result.token_ids) if token in forbidden), None) if forbidden else None
    if cut is not None:  # sent back, the turn's tokens would not match the images
        sampled = result.token_ids[cut]
        error = ResponseError(
            f"turn {turn.index}: the model sampled {encoder.tokenizer.convert_ids_to_tokens(sampled)!r} "
            f"(token {sampled}) at its token {turn.num_generated + cut}, a token only the VLM processor "
            "writes; the turn is cut before it"
        )
        result = replace(result, token_ids=result.token_ids[:cut], logprobs=result.logprobs[:cut])
    trajectory.append_generation(result.token_ids, result.logprobs, result.weight_version)
    turn.num_generated += len(result.token_ids)
    turn.prompt_tokens += result.prompt_tokens
    turn.cached_tokens += result.cached_tokens
    if "spec_verify_ct" in result.meta:  # speculative decoding's counts, summed as slime's Sample.spec_info does
        spec = trajectory.metadata.setdefault("spec_info", dict.fromkeys(SPEC_KEYS, 0))
        for key in SPEC_KEYS:
            spec[key] += int(result.meta.get(key) or 0)
    turn.weight_version = result.weight_version
    # SGLang checks aborts before the length cap: an abort can carry the turn's last allowed token
    aborted_at_cap = result.finish_reason == "abort" and turn.num_generated >= cap
    turn.finish_reason = "length" if aborted_at_cap else result.finish_reason
    if cut is not None:
        raise error
    return result


def _token_tap(
    trajectory: Trajectory, forbidden: frozenset[int], on_error: Callable[[Exception], None] | None
) -> TokenListener:
    """The backend's listener for one generate call: each run of new tokens to the trajectory's `token_listener`
    (read at every run), up to the first `forbidden` token, where `generate_turn` cuts the turn. A listener that
    raises is cleared from the trajectory, logged, and reported to `on_error`."""
    is_cut = False

    def forward(token_ids: list[int]) -> None:
        nonlocal is_cut
        if is_cut:
            return
        if forbidden and (cut := next((i for i, t in enumerate(token_ids) if t in forbidden), None)) is not None:
            token_ids, is_cut = token_ids[:cut], True
        listener = trajectory.token_listener
        if listener is None or not token_ids:
            return
        try:
            listener(token_ids)
        except Exception as exc:  # noqa: BLE001 -- the listener's failure is its own, never the trajectory's
            if trajectory.token_listener is listener:
                trajectory.token_listener = None
            log.warning("trajectory %d: its token listener raised and was cleared", trajectory.id, exc_info=exc)
            if on_error is not None:
                on_error(exc)

    return forward


def _open_turn(trajectory: Trajectory) -> Turn:
    """The last turn when its generation was cut short (aborted, or failed before any reply), else a new turn."""
    if trajectory.turns and trajectory.turns[-1].finish_reason in (None, "abort"):
        return trajectory.turns[-1]
    turn = Turn(index=len(trajectory.turns), start=trajectory.response_length)
    trajectory.turns.append(turn)
    return turn


def out_of_room(trajectory: Trajectory, limits: TurnLimits) -> StopReason | None:
    """LENGTH when the model's window is full, TOKEN_BUDGET when the response budget is spent."""
    if limits.max_context_len is not None and len(trajectory.tokens) >= limits.max_context_len:
        return StopReason.LENGTH
    if limits.remaining(trajectory) <= 0:
        return StopReason.TOKEN_BUDGET
    return None


def stop_after_generation(trajectory: Trajectory, result: GenerateResult, limits: TurnLimits) -> StopReason | None:
    """Step 3 for a loop without pauses of its own (slime's, in benchmarks/longtail/slime.py): an abort
    ends the trajectory; otherwise, is it out of room?"""
    if result.finish_reason == "abort":
        return StopReason.ABORTED
    return out_of_room(trajectory, limits)


@dataclass(frozen=True, slots=True)
class ServerReader:
    """Turns read by SGLang's own parsers (the `turn_parser` setting), by the names slime passes SGLang as
    `--tool-call-parser` and `--reasoning-parser`: in this process where `sglang` is importable here, as in slime's
    image, else on its servers, `backend.read_turn` (both in engine/backends/sglang_read.py).
    Step 3b, between generating and stepping the env; the reading is kept on the turn (`Turn.reading`)."""

    backend: Any  # an SGLangBackend or a BackendPool of them
    tool_call_parser: str | None
    reasoning_parser: str | None
    in_process: Any = None  # SGLang's parsers in this process (InProcessParsers), where sglang is importable here

    @property
    def name(self) -> str:
        return self.tool_call_parser or self.reasoning_parser or "sglang"

    @property
    def where(self) -> str:
        """Where the parsers run: in this process, or on the servers."""
        return "in this process" if self.in_process is not None else "on the servers"

    async def read(self, generated: list[int], encoder: ChatEncoder) -> ParsedTurn:
        """The turn's tokens as SGLang's chat completions would read them: decoded with special tokens, its
        end-of-turn token dropped, and the `<think>` (or the template's own opener) the generation prompt opened
        put back in front."""
        text, opener = encoder.assistant_text(generated), encoder.reasoning_tags[0]
        if encoder.opens_reasoning and not text.lstrip().startswith(opener):
            text = opener + text
        return await self._ask(text, list(encoder.tools or ()))

    async def check(self) -> None:
        """One reading at start, so a server without these parsers (an older SGLang) is one error then."""
        named = " and ".join(f"{kind} {name!r}" for kind, name in self._named)
        try:
            await self._ask("", [])
        except BackendError as exc:
            raise exc.noted(f"SGLang cannot read turns with {named} {self.where} (turn_parser)") from exc
        log.info("turns read by SGLang's %s %s", named, self.where)

    async def _ask(self, text: str, tools: list[dict[str, Any]]) -> ParsedTurn:
        reader = self.in_process if self.in_process is not None else self.backend
        return await reader.read_turn(
            text, tools=tools, tool_call_parser=self.tool_call_parser, reasoning_parser=self.reasoning_parser
        )

    @property
    def _named(self) -> list[tuple[str, str]]:
        kinds = (("tool-call parser", self.tool_call_parser), ("reasoning parser", self.reasoning_parser))
        return [(kind, name) for kind, name in kinds if name is not None]


def turn_parser(turn: Turn, text: str, encoder: ChatEncoder, reader: ServerReader | None) -> OutputParser:
    """Who reads the turn `text` for the env: SGLang's reading where SGLang's parsers read it (ReadTurn), else the
    encoder's (its family's, one read off its template, or, where neither is found, one that names why when an
    env asks it for calls; an env that declares tool observations is refused at start then)."""
    if turn.reading is not None:
        return ReadTurn(reader.name if reader is not None else "sglang", text, turn.reading, encoder.parser)
    return encoder.reader


async def step_env(
    runner: EnvRunner,
    trajectory: Trajectory,
    *,
    encoder: ChatEncoder,
    skip_special_tokens: bool = True,
    reader: ServerReader | None = None,
) -> StepResult:
    """Step 4: the env answers the model's last turn (decoded as SGLang's `text` would be, with or
    without special tokens). While it steps, `engine.parsers.current_parser()` is the model family's, or the
    server's reading of this turn (`turn_parser`), and `reasoning_open()` says whether the turn started inside
    `<think>`, so the env's `parse_tool_calls(text, tools)` reads the family's syntax and skips the reasoning."""
    turn = trajectory.turns[-1]
    text = encoder.response_text(trajectory.generated_ids(turn).tolist(), skip_special_tokens=skip_special_tokens)
    started = time.monotonic()
    with use_parser(turn_parser(turn, text, encoder, reader), in_reasoning=encoder.opens_reasoning):
        step = await runner.step(text)  # env code parsing tool calls gets the family's parser
    turn.env_seconds = time.monotonic() - started
    return step


def end_of_turn(trajectory: Trajectory, step: StepResult, limits: TurnLimits) -> StopReason | None:
    """Does the env's answer end the trajectory (the env is done, or the turns are used up)? A reward
    the env gives is kept."""
    if "reward" in step.info:
        trajectory.reward = step.info["reward"]
    if step.done:
        return StopReason.ENV_DONE
    if len(trajectory.turns) >= limits.max_turns:
        return StopReason.MAX_TURNS
    return None


async def observe(
    trajectory: Trajectory, message: dict[str, Any] | list[dict[str, Any]], encoder: ChatEncoder, limits: TurnLimits
) -> StopReason | None:
    """Step 5: the env's message (or messages) appended with loss mask 0 (images on the rollout and the
    training side), after the token closing the model's turn (a tool message naming the call it answers,
    from the model's turn where the env did not); TOKEN_BUDGET when there is no room left for it.
    Encoded in a worker thread when the message has images or long text. A message the template or the
    processor cannot encode is a BAD_OBSERVATION."""
    turn = trajectory.turns[-1]
    generated = trajectory.generated_ids(turn).tolist()
    try:
        answered = sum(m.get("role") == "tool" for t in trajectory.turns[:-1] for m in t.observation_messages)
        message = encoder.naming_the_calls(message, generated, answered)
        encoded = await encoder.aencode_observation(message)
        closing = encoder.closing_ids(generated, message)
    except ObservationError:
        raise
    except Exception as exc:
        raise ObservationError(f"the observation after turn {turn.index} does not encode: {exc!r}") from exc
    token_ids = closing + encoded.token_ids
    if len(token_ids) >= limits.remaining(trajectory):  # no room left to answer it
        return StopReason.TOKEN_BUDGET
    trajectory.append_observation(token_ids)
    trajectory.image_data.extend(encoded.image_data)
    trajectory.train_inputs.add(encoded.train_inputs)
    turn.num_observation = len(token_ids)
    turn.observation = message
    return None


def record_failure(trajectory: Trajectory, error: TurnError) -> StopReason:
    """Keep the error on the trajectory; the stop reason it ends with."""
    trajectory.errors.append(error.record(trajectory.current_turn))
    return STOP_OF_STAGE[error.stage]


async def close_env(env: EnvRunner, trajectory: Trajectory) -> None:
    """Close the env (shielded, bounded); a failing close is recorded on the trajectory but does not
    change its outcome."""
    try:
        await env.close()
    except TurnError as exc:
        trajectory.errors.append(exc.record(trajectory.current_turn))
