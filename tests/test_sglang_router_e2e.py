"""End to end through the topology slime runs: the real sglang-router (PyPI) in front of two real SGLang
servers on CPU (the session's, tests/conftest.py), slime's rollout function over slime-shaped args with
`--apply-chat-template` prompts and images, a reward hook (`--custom-rm-path`), a dynamic sampling filter,
partial rollout across `update_weights_from_disk` on every worker, and an eval pass.

What it checks, from the servers' own request logs and replies: every turn of a trajectory reached one
worker (the routing key), turns after the first found their prefix cached there, a foreign request on a
worker survives the rollout's aborts, weight versions come from the workers, rewards are what the hook
computes, dropped groups are counted and replaced, and no prompt is lost.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest

from bridge.convert import Sample
from bridge.slime import SERVICE_ATTRIBUTE, generate_rollout
from tests import hooks
from tests.router import SGLangRouter
from tests.sglang_cpu.server import routed_requests, update_weights_as_slime
from tests.test_sglang_e2e import VisionDataSource

pytestmark = pytest.mark.sglang

N_SAMPLES, TARGET, STEPS = 2, 2, 3
FOREIGN_TOKENS = 600  # a long generation of another client on worker 0, in flight while the rollout aborts its own


@pytest.fixture(scope="module")
def router(sglang_workers):
    with SGLangRouter([w.url for w in sglang_workers], policy="consistent_hashing") as running:
        yield running


def sessions_by_worker(workers) -> dict[str, set[int]]:
    """Routing key -> the workers (by position) whose logs show a /generate request carrying it."""
    return {key: set(counts) for key, counts in routed_requests([w.log_path for w in workers]).items()}


def foreign_generation(url: str, out: dict) -> None:
    """Another client's request on the same worker, with an id of its own."""
    body = {
        "text": "a long story:", "rid": "someone-else-0001", "return_logprob": False,
        "sampling_params": {"max_new_tokens": FOREIGN_TOKENS, "ignore_eos": True, "temperature": 1.0},
    }  # fmt: skip
    out["reply"] = httpx2.post(f"{url}/generate", json=body, timeout=600).json()


def update_weights(workers, model_path: Path, version: str) -> None:
    """The trainer's weight update, as slime does it: to every engine, not through the router."""
    for worker in workers:
        update_weights_as_slime(worker.url, model_path, version)


@pytest.mark.slow
def test_generate_rollout_through_sglang_router_in_front_of_two_servers(router, sglang_workers, tmp_path):
    from engine.models import load_processor

    model_path = sglang_workers[0].model_path
    processor = load_processor(str(model_path))
    host, port = router.url.removeprefix("http://").split(":")
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(
        "".join(json.dumps({"input": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4))
    )
    args = SimpleNamespace(
        n_samples_per_prompt=N_SAMPLES, rollout_batch_size=TARGET, over_sampling_batch_size=2 * TARGET,
        partial_rollout=True, max_turns=3, rollout_interaction_env_path="tests.envs.flaky_vision",
        hf_checkpoint=str(model_path), sglang_router_ip=host, sglang_router_port=int(port),
        router_policy="consistent_hashing", apply_chat_template=True, rollout_max_response_len=192,
        custom_rm_path="tests.hooks.length_rm", dynamic_sampling_filter_path="tests.hooks.drop_group_one",
        eval_datasets=[SimpleNamespace(
            name="sums", path=f"{eval_file}@[1:4]", input_key="input", label_key="answer", n_samples_per_eval_prompt=1,
            max_response_len=16, temperature=0.0, custom_rm_path="tests.hooks.length_rm",
        )],
        turnstile={"max_new_tokens": 24, "max_staleness": STEPS},
    )  # fmt: skip
    source = VisionDataSource(N_SAMPLES, seed=100, render=processor, max_attempts=3)  # --apply-chat-template
    hooks.CALLS.clear()
    returned: list[Sample] = []
    foreign: dict = {}
    try:
        for step in range(STEPS):
            if step == 1:  # another client's long request on worker 0, running while this step aborts its own
                thread = threading.Thread(target=foreign_generation, args=(sglang_workers[0].url, foreign))
                thread.start()
            out = generate_rollout(args, step, source)
            if step == 1:  # the step has ended: the requests it had in flight were aborted, and it is paused
                still_running_at_abort = thread.is_alive()
                thread.join()
            assert len(out.samples) == TARGET and all(len(g) == N_SAMPLES for g in out.samples)
            returned += [s for g in out.samples for s in g]
            update_weights(sglang_workers, model_path, f"v{step + 1}")
        service = getattr(args, SERVICE_ATTRIBUTE)
        service.resume()  # reads the version from the workers
        assert service.status()["weight_version"] == f"v{STEPS}"
        held = service.held_prompts()
        evaluation = generate_rollout(args, STEPS, source, evaluation=True)
    finally:
        getattr(args, SERVICE_ATTRIBUTE).shutdown()

    # a foreign request on the same worker survives every abort of the rollout
    assert still_running_at_abort, "the foreign request ended before the rollout's abort: make it longer"
    meta = foreign["reply"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == FOREIGN_TOKENS

    # every turn of a trajectory reached one worker; both workers served some trajectories
    routed = sessions_by_worker(sglang_workers)
    trained = [s for s in returned if s.status.value != "failed"]
    assert all(len(routed[s.session_id]) == 1 for s in returned), {s.session_id: routed[s.session_id] for s in returned}
    assert {w for s in returned for w in routed[s.session_id]} == {0, 1}

    # turns after the first found the conversation so far in that worker's prefix cache (same weights:
    # a weight update flushes the cache; a retried turn re-sends what it had)
    checked = 0
    for sample in trained:
        turns = sample.metadata["turns"]
        for before, turn in zip(turns, turns[1:], strict=False):
            if turn["weight_version"] == before["weight_version"] and turn["retries"] == 0 and before["retries"] == 0:
                prompt_length = len(sample.tokens) - sample.response_length
                assert turn["cached_tokens"] >= prompt_length + before["start"] + before["num_generated"] - 1, turns
                checked += 1
    assert checked > 0, "no trajectory had two turns under one weight version"

    # rewards: the env's where it gave one (arith: 1.0 or 0.0 when done), else what the hook computes
    for sample in trained:
        if sample.metadata["stop_reason"] == "env_done":
            assert sample.reward in (0.0, 1.0)
        else:
            assert sample.reward == hooks.length_reward(sample), sample.metadata["stop_reason"]

    # the dynamic filter dropped group 1 (counted, never returned), replaced from the data source
    groups = [s.group_index for s in returned if s.index % N_SAMPLES == 0]
    assert 1 in source.handed_out and 1 not in groups and ("drop_group_one", 1) in hooks.CALLS
    # no prompt lost: each one taken came back once, was dropped, or is still held
    assert len(groups) == len(set(groups)) == STEPS * TARGET
    assert sorted(set(source.handed_out) - set(groups) - {1}) == held

    # eval: its own dataset (rows 1..3), rewards by its reward function
    sums = evaluation.data["sums"]
    assert [s.label for s in sums["samples"]] == ["2", "4", "6"]
    assert sums["rewards"] == [hooks.length_reward(s) for s in sums["samples"]]


@pytest.mark.slow
def test_under_the_routers_default_policy_every_turn_of_a_trajectory_reaches_one_worker(sglang_workers):
    """slime starts the router with cache_aware unless told otherwise, and cache_aware ignores the routing key:
    the bridge then sends generation to the router's workers itself, each trajectory kept on one."""
    from engine.models import load_processor

    model_path = sglang_workers[0].model_path
    processor = load_processor(str(model_path))
    with SGLangRouter([w.url for w in sglang_workers], policy="cache_aware") as router:
        host, port = router.url.removeprefix("http://").split(":")
        args = SimpleNamespace(
            n_samples_per_prompt=N_SAMPLES, rollout_batch_size=TARGET, over_sampling_batch_size=2 * TARGET,
            partial_rollout=True, max_turns=3, rollout_interaction_env_path="tests.envs.flaky_vision",
            hf_checkpoint=str(model_path), sglang_router_ip=host, sglang_router_port=int(port),
            router_policy="cache_aware", apply_chat_template=True, rollout_max_response_len=192,
            turnstile={"max_new_tokens": 24, "max_staleness": 2},
        )  # fmt: skip
        source = VisionDataSource(N_SAMPLES, seed=200, render=processor, max_attempts=3)  # --apply-chat-template
        returned: list[Sample] = []
        try:
            for step in range(2):
                out = generate_rollout(args, step, source)
                returned += [s for g in out.samples for s in g]
                update_weights(sglang_workers, model_path, f"v{step + 1}")
        finally:
            getattr(args, SERVICE_ATTRIBUTE).shutdown()
    routed = sessions_by_worker(sglang_workers)
    turns = {s.session_id: len(s.metadata["turns"]) for s in returned}
    assert all(len(routed[s.session_id]) == 1 for s in returned), {s.session_id: routed[s.session_id] for s in returned}
    assert {w for s in returned for w in routed[s.session_id]} == {0, 1}
    assert sum(turns.values()) > len(turns)  # trajectories of several turns, each on one worker
