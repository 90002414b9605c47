"""The engine's reward path and group filter: trajectories scored as they end, groups scored once whole,
REWARD errors bounded by the retry budget and failing only what they score, filter verdicts with
slime's keep-when-insufficient rule; and the turn-level details the bridge relies on (sampling seeds per
member, a prompt's own tools, an abort that lands on the response budget)."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from engine.backends.base import GenerateResult
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine, StepFailedError, Verdict
from engine.envs.base import EnvRunner
from engine.errors import ErrorClass
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status, StopReason
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend
from tests.test_engine import TurnsEnv, config, env_factory, rows


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def engine_with(encoder, source, *, backend=None, **kwargs) -> RolloutEngine:
    cfg = kwargs.pop("cfg", None) or config()
    return RolloutEngine(
        backend=backend or DeterministicBackend(), encoder=encoder, env_factory=kwargs.pop("env", env_factory()),
        source=source, config=cfg, **kwargs,
    )  # fmt: skip


@pytest.mark.anyio
async def test_each_trajectory_is_scored_as_it_ends_while_others_still_run(encoder):
    """Short and long episodes in one group: the short ones are scored while the long ones generate."""
    seen_inflight: list[int] = []
    engine: RolloutEngine

    async def reward(trajectory):
        await anyio.lowlevel.checkpoint()
        seen_inflight.append(engine.statistics().num_trajectories_inflight)
        return 10.0 + trajectory.index

    def build(sample):  # member 0 ends after one turn, member 1 after five
        return EnvRunner(TurnsEnv(1 if sample.index == 0 else 5, reward=-1.0))

    engine = engine_with(encoder, rows(2), env=build, reward_fn=reward)
    async with engine:
        groups = await engine.rollout(2)
    members = [t for g in groups for t in g.trajectories]
    assert [t.reward for t in members] == [10.0, 11.0, 10.0, 11.0]  # the function's, over the env's -1.0
    assert all(t.status is Status.COMPLETED for t in members)
    assert max(seen_inflight) > 0  # some trajectory was scored while another was still in flight


@pytest.mark.anyio
async def test_a_reward_that_raises_is_retried_then_fails_only_its_trajectory(encoder):
    attempts: dict[tuple[int, int], int] = {}

    def reward(trajectory):
        key = (trajectory.group_id, trajectory.index)
        attempts[key] = attempts.get(key, 0) + 1
        if key == (0, 1) and attempts[key] == 1:
            raise ConnectionError("reward service hiccup")
        if key == (1, 0):
            raise ValueError("cannot parse the answer")
        return 1.0

    retry = RetryPolicy(backoff_base_s=0.0, per_turn={ErrorClass.REWARD: 2})
    async with engine_with(encoder, rows(2), reward_fn=reward, cfg=config(retry=retry)) as engine:
        groups = await engine.rollout(2)
        stats = engine.statistics().scheduler
    by_key = {(t.group_id, t.index): t for g in groups for t in g.trajectories}
    assert by_key[(0, 1)].status is Status.COMPLETED and by_key[(0, 1)].reward == 1.0
    assert by_key[(0, 1)].metadata["retries"] == {"reward": 1}
    failed = by_key[(1, 0)]
    assert failed.status is Status.FAILED and failed.stop_reason is StopReason.REWARD_ERROR
    assert failed.errors[-1].error_class is ErrorClass.REWARD and "cannot parse the answer" in failed.errors[-1].message
    assert attempts[(1, 0)] == 3  # the first call and two retries
    assert {k: t.status for k, t in by_key.items() if k != (1, 0)} == dict.fromkeys(
        [(0, 0), (0, 1), (1, 1)], Status.COMPLETED
    )
    assert stats.retries[ErrorClass.REWARD] == 3 and stats.budgets_exhausted == {ErrorClass.REWARD: 1}


@pytest.mark.anyio
async def test_a_reward_past_its_timeout_is_a_reward_error(encoder):
    never = anyio.Event()

    async def reward(trajectory):
        if trajectory.group_id == 0 and trajectory.index == 0:
            await never.wait()
        return 0.5

    retry = RetryPolicy(backoff_base_s=0.0, per_turn={}, reward_timeout_s=0.05)
    async with engine_with(encoder, rows(1), reward_fn=reward, cfg=config(retry=retry)) as engine:
        [group] = await engine.rollout(1)
    stuck, other = group.trajectories
    assert stuck.status is Status.FAILED and "no reward for trajectory" in stuck.errors[-1].message
    assert other.status is Status.COMPLETED and other.reward == 0.5


@pytest.mark.anyio
async def test_a_group_is_scored_once_when_all_its_members_have_ended(encoder):
    calls: list[list[Status]] = []

    async def group_reward(group):
        calls.append([t.status for t in group.trajectories])
        return [float(t.index) * 2 for t in group.trajectories]

    def build(sample):
        return EnvRunner(TurnsEnv(1 + 3 * sample.index, reward=-1.0))

    cfg = config(n_samples_per_prompt=3)
    async with engine_with(encoder, rows(2), env=build, group_reward_fn=group_reward, cfg=cfg) as engine:
        groups = await engine.rollout(2)
    assert len(calls) == 2 and all(all(s.is_terminal for s in statuses) for statuses in calls)
    assert [[t.reward for t in g.trajectories] for g in groups] == [[0.0, 2.0, 4.0]] * 2


@pytest.mark.anyio
async def test_a_failed_group_reward_fails_every_scored_member_and_keeps_the_group(encoder):
    def group_reward(group):
        if group.group_id == 1:
            raise RuntimeError("judge is down")
        return [1.0] * len(group.trajectories)

    retry = RetryPolicy(backoff_base_s=0.0, per_turn={ErrorClass.REWARD: 1})
    async with engine_with(encoder, rows(2), group_reward_fn=group_reward, cfg=config(retry=retry)) as engine:
        groups = await engine.rollout(2)
    by_group = {g.group_id: g for g in groups}
    assert all(t.status is Status.COMPLETED and t.reward == 1.0 for t in by_group[0].trajectories)
    for trajectory in by_group[1].trajectories:
        assert trajectory.status is Status.FAILED and trajectory.stop_reason is StopReason.REWARD_ERROR
        assert "judge is down" in trajectory.errors[-1].message


@pytest.mark.anyio
@pytest.mark.parametrize("keep_when_insufficient", [False, True])
async def test_a_filter_verdict_keeps_a_group_only_when_the_step_could_not_be_filled(encoder, keep_when_insufficient):
    """Four prompts, two wanted, four in flight; the filter rejects every group. Plain rejections drop all
    four; with keep_when_insufficient the first two are dropped (three, then two others could still fill
    the step) and the last two kept (dropping them would leave too few)."""
    verdicts: list[Verdict] = []

    def reject(group):
        verdicts.append(Verdict(False, "no_signal", keep_when_insufficient))
        return verdicts[-1]

    cfg = config(partial_rollout=True, over_sampling=2.0, max_inflight=16)
    async with engine_with(encoder, rows(4), group_filter=reject, cfg=cfg) as engine:
        groups = await engine.rollout(2)
        dropped = engine.take_dropped()
        stats = engine.statistics()
    assert len(verdicts) == 4
    assert (len(groups), len(dropped)) == ((2, 2) if keep_when_insufficient else (0, 4))
    assert stats.num_groups_dropped == {"no_signal": len(dropped)}
    assert sorted(g.group_id for g in groups + dropped) == [0, 1, 2, 3]


@pytest.mark.anyio
@pytest.mark.parametrize("over_sampling", [1.0, 2.0])
async def test_keep_when_insufficient_drops_at_most_the_over_sampling_margin_however_many_rows_are_left(
    encoder, over_sampling
):
    """slime drops a keep_when_insufficient group only from its one over-sampling round, never sampling
    again for it: two wanted with forty rows waiting and every group rejected, the step drops
    `2 * over_sampling - 2` groups and keeps the next two (were: a drop replaced by a fresh group each time,
    which samples without end once every group earns the same reward)."""

    def reject(group):
        return Verdict(False, "zero_std_1.0", keep_when_insufficient=True)

    cfg = config(partial_rollout=True, over_sampling=over_sampling, max_inflight=16)
    async with engine_with(encoder, rows(40), group_filter=reject, cfg=cfg) as engine:
        groups = await engine.rollout(2)
        dropped = engine.take_dropped()
        second = await engine.rollout(2)  # the margin is the step's own: the next step may drop again
        dropped_next = engine.take_dropped()
    margin = int(2 * over_sampling) - 2
    assert (len(groups), len(dropped)) == (2, margin)
    assert (len(second), len(dropped_next)) == (2, margin)


@pytest.mark.anyio
async def test_a_filter_that_raises_fails_that_group_only_and_a_failed_step_raises_naming_the_class(encoder):
    def broken(group):
        if group.group_id == 0:
            raise KeyError("reward")
        return None

    async with engine_with(encoder, rows(2), group_filter=broken, cfg=config(max_failed_share=1.0)) as engine:
        groups = sorted(await engine.rollout(2), key=lambda g: g.group_id)
    assert [len(g.trajectories) for g in groups] == [2, 2]  # kept whole: nothing lost
    assert {(t.status, t.stop_reason) for t in groups[0].trajectories} == {(Status.FAILED, StopReason.FILTER_ERROR)}
    assert "the group filter raised KeyError('reward') for group 0" in groups[0].trajectories[0].errors[-1].message
    assert {t.status for t in groups[1].trajectories} == {Status.COMPLETED}

    async with engine_with(encoder, rows(2), group_filter=broken, cfg=config(max_failed_share=0.25)) as engine:
        with pytest.raises(StepFailedError, match=r"2 of 4 trajectories of the step FAILED .* filter x2") as caught:
            await engine.rollout(2)
    assert sorted(g.group_id for g in caught.value.groups) == [0, 1]  # the step's groups, on the error


@pytest.mark.anyio
async def test_each_member_of_a_group_gets_its_own_sampling_seed(encoder):
    class Recording(DeterministicBackend):
        seeds: list[int | None]

        async def generate(self, input_ids, sampling_params, *args, **kwargs):
            self.seeds.append(sampling_params.sampling_seed)
            return await super().generate(input_ids, sampling_params, *args, **kwargs)

    backend = Recording()
    backend.seeds = []
    async with engine_with(
        encoder, rows(2), backend=backend, cfg=config(n_samples_per_prompt=3, sampling_seed_base=42)
    ) as engine:
        await engine.rollout(2)
    assert set(backend.seeds) == {42, 43, 44}


@pytest.mark.anyio
async def test_a_prompts_own_tools_are_rendered_and_the_trajectory_stays_exact(encoder):
    tools = [{"type": "function", "function": {"name": "calc_score", "description": "score an answer",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    source = [{"prompt": [{"role": "user", "content": "q"}], "metadata": {"turns": 2, "tools": tools}}]
    async with engine_with(encoder, source, cfg=config(n_samples_per_prompt=1)) as engine:
        [group] = await engine.rollout(1)
    [trajectory] = group.trajectories
    prompt = encoder.tokenizer.decode(trajectory.tokens[: trajectory.prompt_length].tolist())
    assert "calc_score" in prompt and "<tools>" in prompt
    assert encoder.for_tools(tools).drift_check(trajectory).exact


@pytest.mark.anyio
async def test_an_abort_that_lands_on_the_response_budget_ends_the_trajectory_truncated(encoder):
    """SGLang checks aborts before the length cap: the aborted reply carries every token the budget left."""

    class AbortAtBudget(DeterministicBackend):
        async def generate(self, input_ids, sampling_params, *args, rid=None, **kwargs):
            self.running[rid] = False
            while not self.running[rid]:
                await anyio.lowlevel.checkpoint()
            del self.running[rid]
            n = sampling_params.max_new_tokens
            return GenerateResult([7] * n, [-0.1] * n, "", "abort", self.version, prompt_tokens=len(input_ids))

    cfg = config(n_samples_per_prompt=1, partial_rollout=True, limits=TurnLimits(max_turns=4, max_tokens=10))
    async with engine_with(encoder, rows(2), backend=AbortAtBudget(), cfg=cfg) as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.rollout, 2)
            while engine.scheduler.statistics().phases.get("generating", 0) < 2:
                await anyio.lowlevel.checkpoint()
            await engine.pause()
            tg.cancel_scope.cancel()
        await engine.resume()
        groups = await engine.rollout(2)
    for group in groups:
        [trajectory] = group.trajectories
        assert trajectory.status is Status.TRUNCATED and trajectory.stop_reason is StopReason.TOKEN_BUDGET
        assert trajectory.response_length == 10


@pytest.mark.anyio
async def test_each_turn_records_what_the_server_prefilled_and_found_cached(encoder):
    """The server's `prompt_tokens` and `cached_tokens` per turn, on the trajectory and in the metrics."""
    from engine.metrics.recorder import MetricsRecorder

    class Caching(DeterministicBackend):  # a server that holds every earlier turn's prefix
        async def generate(self, input_ids, sampling_params, *args, **kwargs):
            result = await super().generate(input_ids, sampling_params, *args, **kwargs)
            first_turn = len(input_ids) == len(encoder.encode_prompt(rows(1)[0]["prompt"]).token_ids)
            return dataclasses.replace(result, cached_tokens=0 if first_turn else len(input_ids) - 8)

    recorder = MetricsRecorder()
    async with engine_with(encoder, rows(1), backend=Caching(), observers=[recorder]) as engine:
        [group] = await engine.rollout(1)
    for trajectory in group.trajectories:
        first, *later = trajectory.turns
        assert first.prompt_tokens == trajectory.prompt_length and later
        assert all(turn.cached_tokens == turn.prompt_tokens - 8 > 0 for turn in later)
    assert recorder.prompt_tokens["later"] - recorder.cached_tokens["later"] == 8 * sum(
        len(t.turns) - 1 for t in group.trajectories
    )


@pytest.mark.anyio
async def test_a_group_stays_held_while_an_async_filter_judges_it(encoder):
    """Group 0 ends first and its filter waits until group 1 has been judged: the step still returns both
    (a group being judged is held, not gone), and held_groups lists it meanwhile."""
    judged_one = anyio.Event()
    held_while_waiting: list[list[int]] = []
    engine: RolloutEngine

    async def judge(group):
        if group.group_id == 0:
            held_while_waiting.append([g.group_id for g in engine.held_groups])
            await judged_one.wait()
        else:
            judged_one.set()
        return None

    def build(sample):  # group 0: one turn; group 1: four
        return EnvRunner(TurnsEnv(1 if sample.group_index == 0 else 4))

    engine = engine_with(encoder, rows(2), env=build, group_filter=judge)
    async with engine:
        groups = await engine.rollout(2)
    assert sorted(g.group_id for g in groups) == [0, 1]
    assert held_while_waiting == [[0, 1]]
