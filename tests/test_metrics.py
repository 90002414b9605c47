"""Per-turn metrics, the Prometheus exporter, structured turn logs and the per-step summary, each checked
against what the run did."""

from __future__ import annotations

import io
import json

import anyio
import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.metrics.logging import TurnLogger
from engine.metrics.recorder import MetricsRecorder
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status
from tests.fakes import DeterministicBackend
from tests.test_engine import config, env_factory, rows


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def all_trajectories(groups):
    return [t for g in groups for t in g.trajectories]


@pytest.mark.anyio
async def test_the_recorder_agrees_with_the_run(encoder):
    recorder = MetricsRecorder()
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=env_factory(),
        source=rows(6),
        config=config(n_samples_per_prompt=2, drift_check_every=2),
        observers=[recorder],
    ) as engine:
        groups = await engine.rollout(3) + await engine.rollout(3)
    trajectories = all_trajectories(groups)
    turns = [turn for t in trajectories for turn in t.turns]
    assert sum(recorder.turns.values()) == len(turns) == recorder.generate_seconds.snapshot().count
    assert recorder.turns["env_done"] == len(trajectories)  # each trajectory's last turn
    assert recorder.trajectories[("completed", "env_done")] == len(trajectories) == 12
    assert recorder.trajectory_turns.snapshot().total == len(turns)
    assert recorder.generated_tokens.snapshot().total == sum(t.num_generated for t in trajectories)
    assert recorder.counts["trained_tokens"] == sum(sum(t.loss_mask) for t in trajectories)
    assert recorder.counts["groups_returned"] == 6 and recorder.step_seconds.snapshot().count == 2
    observed = recorder.observation_tokens.snapshot()
    assert observed.total == sum(turn.num_observation for turn in turns)
    assert sum(recorder.drift_checks.values()) == 6  # every second finished trajectory


PAUSE_S = 1.5  # longer than any wait for a slot after the resume, on a loaded 2-core machine too


@pytest.mark.anyio
async def test_queue_time_does_not_count_a_pause(encoder):
    recorder = MetricsRecorder()
    backend = DeterministicBackend(stop_every=30)
    cfg = config(partial_rollout=True, over_sampling=3.0, sampling=SamplingParams(max_new_tokens=64))
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=env_factory(), source=rows(6), config=cfg, observers=[recorder]
    ) as engine:
        await engine.rollout(1)
        await engine.wait_until_parked()
        parked = [t for g in engine.open_groups for t in g.trajectories if t.status is Status.PAUSED]
        await anyio.sleep(PAUSE_S)  # a pause of known length (the weight update)
        await engine.resume("v1")
        groups = [g async for g in engine.stream()]
    resumed = {(t.group_id, t.index) for t in parked}
    waits = [
        turn.queue_seconds for t in all_trajectories(groups) if (t.group_id, t.index) in resumed for turn in t.turns
    ]
    assert waits and max(waits) < PAUSE_S


@pytest.mark.anyio
async def test_the_exporter_serves_bounded_series_that_agree_with_the_run(encoder):
    retry = RetryPolicy(backoff_base_s=0.0)
    from engine.errors import BackendError, ErrorClass

    backend = DeterministicBackend(failures={2: BackendError(ErrorClass.SERVER, "HTTP 503")})
    async with RolloutEngine(
        backend=backend,
        encoder=encoder,
        env_factory=env_factory(),
        source=rows(4),
        config=config(metrics_port=0, retry=retry),
    ) as engine:
        groups = await engine.rollout(4)
        async with httpx2.AsyncClient() as client:
            reply = await client.get(engine.exporter.url)
    families = {f.name: f for f in text_string_to_metric_families(reply.text)}
    assert all(name.startswith("turnstile_") for name in families)
    labels = {label for f in families.values() for s in f.samples for label in s.labels}
    assert labels <= {
        "le",
        "outcome",
        "status",
        "stop_reason",
        "state",
        "group_state",
        "limiter",
        "error_class",
        "stage",
        "reason",
        "result",
        "turn",
    }

    def value(family: str, sample: str | None = None, **labels) -> float:
        return sum(
            s.value
            for s in families[family].samples
            if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())
        )

    trajectories = all_trajectories(groups)
    num_turns = sum(len(t.turns) for t in trajectories)
    assert value("turnstile_trajectories_finished", "turnstile_trajectories_finished_total") == len(trajectories)
    assert value("turnstile_turn_generate_seconds", "turnstile_turn_generate_seconds_count") == num_turns
    assert value("turnstile_turns", "turnstile_turns_total") == num_turns
    assert value("turnstile_retries", "turnstile_retries_total", error_class="server", stage="backend") == 1
    assert value("turnstile_groups_emitted", "turnstile_groups_emitted_total") == 4
    assert {s.labels["state"] for s in families["turnstile_trajectories_inflight"].samples} == {
        "waiting_to_generate",
        "generating",
        "waiting_for_env",
        "in_env",
        "paused",
        "scoring",
    }
    assert value("turnstile_slots_total", limiter="generation") == 8


def log_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.anyio
async def test_turn_logs_are_json_events_sampled_as_asked(encoder):
    every, sampled = io.StringIO(), io.StringIO()
    loggers = [TurnLogger(json=True, stream=every), TurnLogger(json=True, stream=sampled, sample=0.5)]
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=env_factory(),
        source=rows(3),
        config=config(),
        observers=loggers,
    ) as engine:
        groups = await engine.rollout(3)
    trajectories = all_trajectories(groups)
    events = log_lines(every)
    turns = [e for e in events if e["event"] == "turn"]
    assert len(turns) == sum(len(t.turns) for t in trajectories)
    first = turns[0]
    assert {
        "trajectory",
        "group",
        "index",
        "turn",
        "generated_tokens",
        "observation_tokens",
        "generate_s",
        "env_s",
        "queue_s",
        "retries",
        "finish_reason",
        "outcome",
        "weight_version",
        "ts",
        "level",
    } <= first.keys()
    done = [e for e in events if e["event"] == "trajectory"]
    assert len(done) == len(trajectories) and {e["stop_reason"] for e in done} == {"env_done"}
    sampled_events = log_lines(sampled)
    assert len([e for e in sampled_events if e["event"] == "turn"]) == len(turns) // 2
    assert len([e for e in sampled_events if e["event"] == "trajectory"]) == len(trajectories)


def test_failed_trajectories_log_at_warning_with_where_the_env_failed_and_levels_filter():
    from engine.errors import BackendError, EnvError, ErrorClass
    from engine.trajectory import StopReason, Trajectory

    stream = io.StringIO()
    logger = TurnLogger(json=True, stream=stream, level="warning")
    failed, fine = Trajectory(prompt=[]), Trajectory(prompt=[])
    for trajectory in (failed, fine):
        trajectory.transition(Status.RUNNING)
    failed.errors.append(BackendError(ErrorClass.CONNECTION, "unreachable").record(0))
    failed.finish(StopReason.BACKEND_ERROR)
    fine.finish(StopReason.ENV_DONE)
    logger.trajectory_ended(failed)
    logger.trajectory_ended(fine)  # info: filtered out at warning level
    [event] = log_lines(stream)
    assert event["level"] == "warning" and event["errors"] == ["connection: unreachable"]
    assert "exception" not in event  # no user code behind it
    console = io.StringIO()
    TurnLogger(json=False, stream=console).trajectory_ended(fine)
    assert "trajectory" in console.getvalue() and not console.getvalue().startswith("{")

    where = 'Traceback (most recent call last):\n  File "my_env.py", line 3, in step\nValueError: my bug'
    failed.errors.append(EnvError(ErrorClass.ENV_EXCEPTION, "env E.step raised", traceback=where).record(0))
    stream, console = io.StringIO(), io.StringIO()
    TurnLogger(json=True, stream=stream).trajectory_ended(failed)
    TurnLogger(json=False, stream=console).trajectory_ended(failed)
    [event] = log_lines(stream)
    assert event["exception"] == where  # the turn log says where the env failed
    assert 'File "my_env.py", line 3, in step' in console.getvalue()  # below the line, on a console
    with pytest.raises(ValueError, match="log level must be one of"):
        TurnLogger(level="verbose")


@pytest.mark.anyio
async def test_step_summary_has_slimes_keys_and_the_multi_turn_distributions(encoder):
    def build(sample):  # group 0: every member gets the same reward (zero spread)
        from engine.envs.base import EnvRunner
        from tests.test_engine import TurnsEnv

        return EnvRunner(TurnsEnv(2 + sample.index, reward=1.0 if sample.group_index == 0 else float(sample.index)))

    async with RolloutEngine(
        backend=DeterministicBackend(), encoder=encoder, env_factory=build, source=rows(3), config=config()
    ) as engine:
        groups = await engine.rollout(3)
        summary = engine.last_step_summary
    trajectories = all_trajectories(groups)
    lengths = [t.response_length for t in trajectories]
    assert summary["rollout/response_len/max"] == max(lengths) and summary["rollout/response_len/min"] == min(lengths)
    assert summary["rollout/truncated_ratio"] == 0.0 and summary["rollout/zero_std/count_1.0"] == 1
    assert summary["perf/rollout_time"] > 0 and summary["perf/longest_sample_tokens_per_sec"] > 0
    assert summary["multi_turn/turns/max"] == 3 and summary["multi_turn/turns/min"] == 2
    assert sum(v for k, v in summary.items() if k.startswith("multi_turn/stop_reason/")) == pytest.approx(1.0)
    assert summary["multi_turn/staleness/le1_ratio"] == 1.0 and summary["multi_turn/partial/paused"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("terminal", [False, True])
async def test_the_live_view_shows_groups_done_in_flight_tokens_and_errors(encoder, terminal):
    from engine.metrics.live import LiveView

    recorder, screen = MetricsRecorder(), io.StringIO()
    async with RolloutEngine(
        backend=DeterministicBackend(), encoder=encoder, env_factory=env_factory(), source=rows(3),
        config=config(), observers=[recorder],
    ) as engine, anyio.create_task_group() as view:  # fmt: skip
        live = LiveView(engine, recorder, total_groups=3, stream=screen, terminal=terminal, interval_s=0.01)
        view.start_soon(live.run)
        await engine.rollout(3)
        view.cancel_scope.cancel()
    shown = screen.getvalue()
    assert "0 generating, 0 in env, 0 waiting, 0 paused" in shown and "failed 0" in shown and "retries 0" in shown
    if terminal:
        assert "3/3" in shown and "\x1b[" in shown  # a rich progress bar, drawn with escape codes
    else:
        assert shown.splitlines()[-1].startswith("groups 3/3 · in flight")
