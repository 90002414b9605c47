"""slime's side: Trajectory -> Sample conversion, the rollout function's contract, the custom generate
function, the rollout service across steps (partial rollout, weight updates), and nothing lost."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from types import SimpleNamespace

import anyio
import pytest

from bridge.convert import Sample, sample_class, settle, to_sample
from bridge.service import RolloutService
from bridge.settings import BridgeSettings, settings_from_args
from bridge.slime import SERVICE_ATTRIBUTE, RolloutFnEvalOutput, RolloutFnTrainOutput, generate, generate_rollout
from engine.backends.base import SamplingParams
from engine.errors import BackendError, ErrorClass
from engine.trajectory import Status, StopReason, Trajectory, Turn
from tests.envs import gated
from tests.fakes import DeterministicBackend

# slime's Sample fields on the rollout path and their types (SLIME_CONTRACT.md, slime/utils/types.py)
SLIME_FIELDS = {
    "group_index": "int | None", "index": "int | None", "rollout_id": "int | None",
    "prompt": "str | list[dict[str, Any]]", "tokens": "list[int]", "multimodal_inputs": "dict[str, Any] | None",
    "multimodal_train_inputs": "dict[str, Any] | None", "response": "str", "response_length": "int",
    "label": "str | None", "reward": "float | dict[str, Any] | None", "loss_mask": "list[int] | None",
    "weight_versions": "list[str]", "rollout_log_probs": "list[float] | None", "remove_sample": "bool",
    "status": "Status", "metadata": "dict", "session_id": "str | None", "non_generation_time": "float",
}  # fmt: skip


class DataSource:
    """slime's data source shape: get_samples(n) -> n groups, each n_samples copies of one prompt."""

    def __init__(self, n_samples: int, prompts: int = 1_000):
        self.n_samples, self.prompts, self.next = n_samples, prompts, 0
        self.handed_out: list[int] = []

    def get_samples(self, num: int) -> list[list[Sample]]:
        groups = []
        for _ in range(min(num, self.prompts - self.next)):
            group = [
                Sample(group_index=self.next, index=self.next * self.n_samples + i, prompt=f"prompt-{self.next}")
                for i in range(self.n_samples)
            ]
            self.handed_out.append(self.next)
            self.next += 1
            groups.append(group)
        return groups


def finished_trajectory(status_reason: StopReason = StopReason.ENV_DONE) -> Trajectory:
    trajectory = Trajectory(prompt=[{"role": "user", "content": "q"}], group_id=3, index=1, reward=1.0)
    trajectory.set_prompt([1, 2, 3])
    trajectory.transition(Status.RUNNING)
    trajectory.append_generation([10, 11], [-0.5, -0.25], "v0")
    trajectory.turns.append(Turn(index=0, start=0, num_generated=2, env_seconds=0.5, num_observation=2))
    trajectory.append_observation([20, 21])
    trajectory.append_generation([12], [-0.75], "v1")
    trajectory.turns.append(Turn(index=1, start=4, num_generated=1))
    trajectory.metadata["start_rollout_id"] = 7
    trajectory.finish(status_reason)
    return trajectory


# -- conversion ---------------------------------------------------------------------------------


def test_the_stand_in_sample_has_slimes_fields_and_status_values():
    annotations = {f.name: f.type for f in dataclasses.fields(Sample)}  # as written: strings
    assert set(SLIME_FIELDS) <= set(annotations)
    for name, expected in SLIME_FIELDS.items():
        assert annotations[name] == expected, name
    assert typing.get_type_hints(Sample)["status"] is Sample.Status
    assert [s.value for s in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]
    assert sample_class() is Sample  # slime is not importable in this environment


def test_a_trajectory_becomes_a_sample_with_masked_env_tokens(tokenizer):
    sample = to_sample(finished_trajectory(), tokenizer)
    assert sample.tokens == [1, 2, 3, 10, 11, 20, 21, 12]
    assert sample.response_length == 5 == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, -0.75]
    assert sample.status is Sample.Status.COMPLETED and not sample.remove_sample and sample.reward == 1.0
    assert sample.weight_versions == ["v0", "v1"]
    assert sample.rollout_id is None  # slime's: a trajectory's id (None: one of its own), never the step's
    assert sample.metadata["num_turns"] == 2 and sample.metadata["stop_reason"] == "env_done"
    assert sample.metadata["start_rollout_id"] == 7 and sample.non_generation_time == pytest.approx(0.5)
    assert sample.response == tokenizer.decode([10, 11, 20, 21, 12])


def test_failed_trajectories_are_removed_but_keep_their_place(tokenizer):
    trajectory = finished_trajectory(StopReason.BACKEND_ERROR)
    trajectory.reward = None
    trajectory.errors.append(BackendError(ErrorClass.CONNECTION, "server down").record(1))
    given = Sample(group_index=3, index=1, prompt="q", metadata={"source": "dataset"})
    sample = to_sample(trajectory, tokenizer, into=given)
    assert sample is given and sample.status is Sample.Status.FAILED and sample.remove_sample
    assert sample.reward is None  # slime's own loop (the custom generate path) scores or skips it
    assert settle(sample, trajectory).reward == 0.0 and sample.metadata["source"] == "dataset"  # the trainer's
    assert "server down" in sample.metadata["failure"]


def test_truncated_trajectories_are_truncated_samples(tokenizer):
    assert to_sample(finished_trajectory(StopReason.TOKEN_BUDGET), tokenizer).status is Sample.Status.TRUNCATED


def test_trajectories_aborted_for_staleness_do_not_train(tokenizer):
    trajectory = finished_trajectory(StopReason.ABORTED)  # on_stale="finish", or the engine's shutdown
    trajectory.reward = None
    sample = settle(to_sample(trajectory, tokenizer), trajectory)
    assert sample.status is Sample.Status.ABORTED and sample.remove_sample and sample.reward == 0.0


# -- slime's rollout function contract -----------------------------------------------------------


def test_generate_rollout_has_slimes_signature():
    parameters = inspect.signature(generate_rollout).parameters
    assert tuple(parameters) == ("args", "rollout_id", "data_source", "evaluation")
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters.values())
    assert parameters["evaluation"].default is False
    assert [p for p in parameters.values() if p.default is not inspect.Parameter.empty] == [parameters["evaluation"]]
    assert tuple(inspect.signature(generate).parameters)[:3] == ("args", "sample", "sampling_params")


def test_generate_rollout_without_configuration_runs_the_embedded_default():
    out = generate_rollout(None, 2, DataSource(n_samples=2))
    assert isinstance(out, RolloutFnTrainOutput) and len(out.samples) == 2
    for group in out.samples:
        assert len(group) == 2
        for sample in group:
            assert isinstance(sample.tokens, list) and all(isinstance(t, int) for t in sample.tokens)
            assert sample.reward is not None and isinstance(sample.response, str)
            assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
    assert "multi_turn/turns/mean" in out.metrics and "perf/rollout_time" in out.metrics
    evaluation = generate_rollout(None, 2, DataSource(n_samples=2), evaluation=True)
    assert isinstance(evaluation, RolloutFnEvalOutput)
    for data in evaluation.data.values():
        assert len(data["rewards"]) == len(data["truncated"]) == len(data["samples"]) > 0


def test_generate_runs_one_sample_through_the_same_engine():
    args = SimpleNamespace(n_samples_per_prompt=1, max_turns=3, turnstile={"max_new_tokens": 16})

    async def main():
        return await generate(args, Sample(index=0, prompt="prompt-0"), {"temperature": 1.0, "max_new_tokens": 64})

    sample = anyio.run(main)
    assert (
        sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED) and 1 <= sample.metadata["num_turns"] <= 3
    )
    assert len(sample.loss_mask) == sample.response_length
    assert all(turn["num_generated"] <= 16 for turn in sample.metadata["turns"])
    getattr(args, SERVICE_ATTRIBUTE).shutdown()


def test_settings_read_slimes_args_and_the_turnstile_section():
    args = SimpleNamespace(
        n_samples_per_prompt=8, rollout_batch_size=32, over_sampling_batch_size=48, partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True, rollout_max_response_len=4096, rollout_temperature=0.8,
        sglang_router_ip="10.0.0.5", sglang_router_port=30000, max_turns=5, rollout_interaction_env_path="my.env",
        turnstile={"max_generating": 64, "policy": "oldest", "max_new_tokens": 512},
    )  # fmt: skip
    settings = settings_from_args(args)
    assert (settings.n_samples_per_prompt, settings.target_groups, settings.over_sampling) == (8, 32, 1.5)
    assert settings.url == "http://10.0.0.5:30000" and settings.env_path == "my.env" and settings.max_turns == 5
    config = settings.engine_config((151645,))
    assert config.partial_rollout and config.mask_offpolicy and config.policy == "oldest"
    assert config.sampling.max_new_tokens == 512 and config.sampling.temperature == 0.8
    assert config.limits.max_tokens == 4096 and config.max_inflight == 48 * 8
    # without turnstile.max_new_tokens a turn may use what is left of the whole response's budget
    del args.turnstile["max_new_tokens"]
    assert settings_from_args(args).engine_config((151645,)).sampling.max_new_tokens == 4096
    with pytest.raises(ValueError, match="no_such_setting"):
        settings_from_args(SimpleNamespace(turnstile={"no_such_setting": 1}))


# -- the service across steps ---------------------------------------------------------------------


def partial_settings(n_samples: int = 2, **overrides) -> BridgeSettings:
    base = dict(
        n_samples_per_prompt=n_samples, target_groups=3, partial_rollout=True, over_sampling=2.0, max_turns=4,
        max_tokens=1024, sampling=SamplingParams(max_new_tokens=48),
    )  # fmt: skip
    return BridgeSettings(**{**base, **overrides})


def test_nothing_is_lost_across_ten_partial_rollout_steps():
    """Every prompt taken from the data source comes back exactly once in a returned group, or is still
    held (paused, finished and waiting, or queued) at the end."""
    backend = DeterministicBackend(stop_every=40)
    args = SimpleNamespace()
    service = RolloutService(partial_settings(), backend=backend)
    setattr(args, SERVICE_ATTRIBUTE, service)
    source = DataSource(n_samples=2)
    returned: list[int] = []
    try:
        for step in range(10):
            out = generate_rollout(args, step, source)
            assert len(out.samples) == 3 and all(len(g) == 2 for g in out.samples)
            returned += [g[0].group_index for g in out.samples]
            for group in out.samples:
                for sample in group:
                    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
            service.pause()
            backend.version = f"v{step + 1}"
            service.resume(f"v{step + 1}")
        held = service.num_held()
        held_prompts = service.held_prompts()
        status = service.status()
    finally:
        service.shutdown()
    assert sorted(returned) == sorted(set(returned))  # no prompt returned twice
    assert len(returned) + held == len(source.handed_out)  # the rest is held: paused, done or queued
    # which: exactly the prompts taken and not returned are held at the end
    assert held_prompts == sorted(set(source.handed_out) - set(returned)), (held_prompts, returned)
    assert held == len(held_prompts) == status["groups_open"] + status["groups_done"] + status["prompts_queued"] > 0


def test_a_step_with_refill_is_given_the_groups_its_tail_may_start():
    """slime's data source is asked for target x over_sampling groups and target x refill more, less what is
    held: the engine's refill takes its groups from what the step was given."""
    service = RolloutService(partial_settings(refill=0.5), backend=DeterministicBackend(stop_every=40))
    try:
        assert service.wanted(3) == 6 + 2  # ceil(3 x 2.0) + ceil(3 x 0.5), nothing held yet
    finally:
        service.shutdown()


def test_paused_trajectories_resume_with_their_env_and_carry_both_weight_versions():
    """Group 0 is mid-episode (its env blocked in its first step) when step 0 ends; the weights change
    while it is held; it finishes at a later step with its own env and tokens of both versions."""
    gated.GATE.hold(0)
    backend = DeterministicBackend(stop_every=40)
    service = RolloutService(partial_settings(env_path="tests.envs.gated"), backend=backend)
    source = DataSource(n_samples=2)
    later: list[list[Sample]] = []
    try:
        first = service.rollout(0, 3, source.get_samples(service.wanted(3)))
        assert 0 not in [g[0].group_index for g in first.samples]
        assert 0 in service.held_prompts() and service.status()["groups_open"] > 0
        service.pause()
        backend.version = "v1"
        service.resume("v1")
        gated.GATE.release()
        for step in range(1, 6):  # held groups that finished at step 0 may come back first
            out = service.rollout(step, 3, source.get_samples(service.wanted(3)))
            later += [g for g in out.samples if g[0].group_index == 0]
            if later:
                break
    finally:
        gated.GATE.release()
        service.shutdown()
    assert later, "the held group came back within five steps"
    for sample in later[0]:
        # v0 before the update (its first turn, whole or aborted mid-way by the step's end), v1 after
        assert sample.weight_versions[0] == "v0" and sample.weight_versions[-1] == "v1"
        assert set(sample.weight_versions) == {"v0", "v1"}
        assert sample.metadata["start_rollout_id"] == 0
        turns = sample.metadata["turns"]
        assert [t["index"] for t in turns] == [0, 1]  # its turn state went on
        # its env went on too: only its second step ends with a reward; a fresh env would have asked
        # "[step 1] one more" again
        assert sample.reward == 1.0 and sample.response.count("[step 1] one more") == 1
