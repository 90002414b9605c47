"""The rollout service as a named Ray actor, and in shards of such actors: created once, attached to by name, driven
through generate_rollout, created again when killed (no prompt lost), shut down."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bridge.ray_actor import attach_or_create
from bridge.settings import BridgeSettings
from bridge.slime import SERVICE_ATTRIBUTE, generate_rollout
from tests.test_bridge import DataSource
from tests.test_shards import sharded_settings

ray = pytest.importorskip("ray", reason="Ray is part of the dev extra; install it with `pip install -e .[dev]`")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, namespace="turnstile")
    yield
    ray.shutdown()


@pytest.mark.slow
def test_the_service_is_a_named_actor_that_generate_rollout_drives(local_ray):
    settings = BridgeSettings.embedded(2).model_copy(update={"partial_rollout": True, "over_sampling": 2.0})
    service = attach_or_create("turnstile-test", settings)
    try:
        again = attach_or_create("turnstile-test", settings)  # attached to, not created again
        assert ray.get_actor("turnstile-test", namespace="turnstile") is not None
        args = SimpleNamespace(**{SERVICE_ATTRIBUTE: again})
        source = DataSource(n_samples=2)
        out = generate_rollout(args, 0, source)
        assert len(out.samples) == 2 and all(len(group) == 2 for group in out.samples)
        for group in out.samples:
            for sample in group:
                assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        status = service.status()  # the first handle sees what the second one did
        assert status["groups_returned"] == 2
        held = service.num_held()
        assert held == status["groups_open"] + status["groups_done"] + status["prompts_queued"]
        assert len(source.handed_out) == 2 + held  # the rest of what was taken is held in the actor
        service.pause()
        service.resume("step-1")
        assert service.status()["weight_version"] == "step-1"
    finally:
        service.shutdown()
    with pytest.raises(ValueError):
        ray.get_actor("turnstile-test", namespace="turnstile")


@pytest.mark.slow
def test_a_killed_service_actor_is_created_again_and_no_prompt_is_lost(local_ray):
    """The actor dies between steps, holding groups (partial rollout): the next step's call creates it
    again by name and hands it every group the dead one held; each prompt is returned once, or held."""
    settings = BridgeSettings.embedded(2).model_copy(update={"partial_rollout": True, "over_sampling": 2.0})
    service = attach_or_create("turnstile-restart-test", settings)
    try:
        args = SimpleNamespace(**{SERVICE_ATTRIBUTE: service})
        source = DataSource(n_samples=2)
        returned = [group[0].group_index for group in generate_rollout(args, 0, source).samples]
        held_when_killed = service.held_prompts()
        assert held_when_killed  # the dead actor takes these with it
        ray.kill(service._actor, no_restart=True)
        returned += [group[0].group_index for group in generate_rollout(args, 1, source).samples]
        assert service.restarts == 1
        held = service.held_prompts()
        assert sorted(returned + held) == source.handed_out  # every prompt taken: returned once, or held
        assert set(held_when_killed) <= set(returned + held)
    finally:
        service.shutdown()


def serve_detached(tmp_path, name: str, turnstile: str, capsys) -> str:
    """`turnstile serve --detach` from a slime config whose `turnstile:` section is `turnstile`; what it said."""
    from engine.cli import main

    config = tmp_path / "turnstile.yaml"
    config.write_text(f"max_turns: 2\nn_samples_per_prompt: 2\nturnstile:\n  max_new_tokens: 8\n{turnstile}")
    assert main(["serve", "--name", name, "--config", str(config), "--detach"]) == 0
    return capsys.readouterr().err


def step_capped_at_8_tokens(service) -> None:
    """One step through generate_rollout: whole groups, each turn within the served config's max_new_tokens."""
    out = generate_rollout(SimpleNamespace(**{SERVICE_ATTRIBUTE: service}), 0, DataSource(n_samples=2))
    assert out.samples and all(len(group) == 2 for group in out.samples)
    assert all(t["num_generated"] <= 8 for g in out.samples for s in g for t in s.metadata["turns"])


@pytest.mark.slow
def test_turnstile_serve_starts_a_detached_actor_from_a_slime_config(local_ray, tmp_path, capsys):
    said = serve_detached(tmp_path, "turnstile-serve-test", "  max_generating: 4\n", capsys)
    assert "service 'turnstile-serve-test' is up" in said
    service = attach_or_create("turnstile-serve-test", BridgeSettings())  # attaches: the settings are not used
    try:
        step_capped_at_8_tokens(service)
    finally:
        service.shutdown()


def test_turnstile_serve_detach_without_a_cluster_says_so(monkeypatch, capsys):
    from engine.cli import main

    def no_cluster(*args, **kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert main(["serve", "--detach"]) == 2
    assert "needs a running Ray cluster" in capsys.readouterr().err


@pytest.mark.slow
def test_a_shard_killed_mid_step_is_created_again_and_no_prompt_is_lost(local_ray):
    """Two shards as Ray actors; one is killed while a step runs on it: the step still returns its target, and
    every prompt taken is returned once or held."""
    from bridge.shards import ray_shards

    settings = sharded_settings(ray_actor="turnstile-shard-test", shards=2)
    service = ray_shards(settings)
    try:
        args = SimpleNamespace(**{SERVICE_ATTRIBUTE: service})
        source = DataSource(n_samples=2)
        returned = [group[0].group_index for group in generate_rollout(args, 0, source).samples]
        victim = max(service.shards, key=lambda shard: shard.num_held())
        assert victim.num_held() > 0  # it dies holding groups

        original_begin = victim.begin

        def begin_then_die(*a, **kw):  # the step has begun on it, holding groups, when it dies
            original_begin(*a, **kw)
            ray.kill(victim._actor, no_restart=True)

        victim.begin = begin_then_die
        out = generate_rollout(args, 1, source)
        assert victim.restarts == 1
        assert len(out.samples) == 3 and all(len(group) == 2 for group in out.samples)
        returned += [group[0].group_index for group in out.samples]
        held = service.held_prompts()
        assert len(set(returned)) == len(returned)
        assert sorted(returned + held) == source.handed_out
    finally:
        service.shutdown()


@pytest.mark.slow
def test_turnstile_serve_starts_shards_that_slime_attaches_to(local_ray, tmp_path, capsys):
    from bridge.settings import settings_from_args
    from bridge.shards import ray_shards

    said = serve_detached(tmp_path, "turnstile-serve-shards", "  shards: 2\n", capsys)
    assert "service 'turnstile-serve-shards-shard-0 .. 1' is up" in said
    for i in range(2):
        assert ray.get_actor(f"turnstile-serve-shards-shard-{i}", namespace="turnstile") is not None
    slime_args = SimpleNamespace(
        max_turns=2, n_samples_per_prompt=2, rollout_batch_size=2,
        turnstile={"shards": 2, "ray_actor": "turnstile-serve-shards"},
    )  # fmt: skip
    service = ray_shards(settings_from_args(slime_args), slime_args)  # attaches to the running shards
    try:
        step_capped_at_8_tokens(service)
    finally:
        service.shutdown()
    with pytest.raises(ValueError):
        ray.get_actor("turnstile-serve-shards-shard-0", namespace="turnstile")
