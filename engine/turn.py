"""What one turn does, and the sequential reference loop built from it.

`run_trajectory` is the seed's five steps, numbered in the loop:
  1. encode the prompt;
  2. generate (tokens appended with loss mask 1);
  3. check whether generation ended the trajectory (abort, context length, token budget);
  4. step the env (done? out of turns?);
  5. append the observation (loss mask 0; images on the rollout and the training side).

The turn-level scheduler dispatches `generate_turn` and `env_turn` separately, holding a generation
slot or an env slot for each; this loop runs them back to back for one trajectory. The token budget
(`max_tokens`, response side) shrinks with generated and observation tokens and caps each turn's
`max_new_tokens`. A turn that hits the per-turn cap ends there: it is closed with the end-of-turn
token (mask 0) and the env still answers it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

import anyio

from engine.backends.base import Backend, GenerateResult, SamplingParams
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner
from engine.errors import Stage, TurnError
from engine.trajectory import Status, StopReason, Trajectory, Turn

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


def encode_prompt(trajectory: Trajectory, encoder: ChatEncoder) -> None:
    """Step 1: the prompt's tokens, and its images on both sides."""
    encoded = encoder.encode_prompt(trajectory.prompt, trajectory.prompt_images)
    trajectory.set_prompt(encoded.token_ids)
    trajectory.image_data.extend(encoded.image_data)
    trajectory.train_inputs.add(encoded.train_inputs)


async def generate_turn(
    trajectory: Trajectory, backend: Backend, sampling: SamplingParams, limits: TurnLimits, *, rid: str | None = None
) -> GenerateResult:
    """Step 2: one generation request, its tokens appended with loss mask 1.

    A turn whose generation was aborted (finish reason `abort`) is continued with what is left of its
    `max_new_tokens`, not started anew: partial rollout resumes trajectories mid-turn."""
    turn = _open_turn(trajectory)
    left = min(sampling.max_new_tokens - turn.num_generated, limits.remaining(trajectory))
    if left <= 0:
        raise ValueError(f"trajectory {trajectory.id}: no room left to generate (check out_of_room first)")
    params = replace(sampling, max_new_tokens=left)
    started = time.monotonic()
    result = await backend.generate(
        trajectory.tokens.tolist(),
        params,
        trajectory.image_data or None,
        rid=rid or uuid.uuid4().hex,
        session_id=trajectory.session_id,
    )
    turn.generate_seconds += time.monotonic() - started
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
    aborted_at_cap = result.finish_reason == "abort" and turn.num_generated >= sampling.max_new_tokens
    turn.finish_reason = "length" if aborted_at_cap else result.finish_reason
    return result


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
    """Step 3: does this generation end the trajectory?"""
    if result.finish_reason == "abort":
        return StopReason.ABORTED
    return out_of_room(trajectory, limits)


async def env_turn(
    trajectory: Trajectory,
    env: EnvRunner,
    encoder: ChatEncoder,
    limits: TurnLimits,
    *,
    skip_special_tokens: bool = True,
) -> StopReason | None:
    """Steps 4 and 5: the env answers the model's last turn (decoded as SGLang's `text` would be, with
    or without special tokens); its observation is appended with loss mask 0."""
    turn = trajectory.turns[-1]
    generated = trajectory.generated_ids(turn).tolist()
    started = time.monotonic()
    step = await env.step(encoder.response_text(generated, skip_special_tokens=skip_special_tokens))
    turn.env_seconds = time.monotonic() - started
    if "reward" in step.info:
        trajectory.reward = step.info["reward"]
    if step.done:
        return StopReason.ENV_DONE
    if len(trajectory.turns) >= limits.max_turns:
        return StopReason.MAX_TURNS
    message = env.message(step.observation)
    encoded = encoder.encode_observation(message)
    token_ids = encoder.closing_ids(generated) + encoded.token_ids
    if len(token_ids) >= limits.remaining(trajectory):  # no room left to answer it
        return StopReason.TOKEN_BUDGET
    trajectory.append_observation(token_ids)
    trajectory.image_data.extend(encoded.image_data)
    trajectory.train_inputs.add(encoded.train_inputs)
    turn.num_observation = len(token_ids)
    turn.observation = message
    return None


async def run_trajectory(
    trajectory: Trajectory,
    *,
    backend: Backend,
    env: EnvRunner,
    encoder: ChatEncoder,
    sampling: SamplingParams,
    limits: TurnLimits,
) -> Trajectory:
    """Run one trajectory to its end, turn after turn. It always ends in exactly one terminal status:
    a backend or env failure ends it FAILED with the error recorded; cancellation ends it ABORTED."""
    stop: StopReason | None = None
    try:
        encode_prompt(trajectory, encoder)  # 1
        trajectory.transition(Status.RUNNING)
        await env.reset()
        stop = out_of_room(trajectory, limits)  # a prompt may fill the window on its own
        while stop is None:
            result = await generate_turn(trajectory, backend, sampling, limits)  # 2
            stop = stop_after_generation(trajectory, result, limits)  # 3
            if stop is None:
                stop = await env_turn(trajectory, env, encoder, limits)  # 4, 5
    except TurnError as exc:
        stop = record_failure(trajectory, exc)
    except anyio.get_cancelled_exc_class():
        stop = StopReason.ABORTED
        raise
    finally:
        await close_env(env, trajectory)
        trajectory.finish(stop or StopReason.ABORTED)
        trajectory.check_invariant()
    return trajectory


def record_failure(trajectory: Trajectory, error: TurnError) -> StopReason:
    """Keep the error on the trajectory; the stop reason it ends with."""
    trajectory.errors.append(error.record(len(trajectory.turns)))
    return _STOP_OF_STAGE.get(error.stage, StopReason.ENV_ERROR)


_STOP_OF_STAGE = {Stage.BACKEND: StopReason.BACKEND_ERROR, Stage.REWARD: StopReason.REWARD_ERROR}


async def close_env(env: EnvRunner, trajectory: Trajectory) -> None:
    """Close the env (shielded, bounded); a failing close is recorded on the trajectory but does not
    change its outcome."""
    try:
        await env.close()
    except TurnError as exc:
        trajectory.errors.append(exc.record(len(trajectory.turns)))
