"""End to end against a real SGLang server on CPU (tests/sglang_cpu/): slime's rollout function over a
slime-shaped `args` and data source, a tiny random-weight Qwen2.5-VL model, images in the prompts
and in every env observation, partial rollout across steps with `update_weights_from_disk` between
them, and an env that fails now and then (tests/envs/flaky_vision.py).

Needs the SGLang venv (`python -m tests.sglang_cpu.server install`; `.ci/run` does it). Without it
these tests skip saying so, or fail when TURNSTILE_REQUIRE_SGLANG=1 (as in CI).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import anyio
import pytest

from bridge.convert import Sample
from bridge.slime import SERVICE_ATTRIBUTE, generate, generate_rollout
from engine.envs.arith import make_prompts
from tests.envs.gated import GATE
from tests.sglang_cpu.server import SGLangServer, update_weights_as_slime

pytestmark = pytest.mark.sglang

N_SAMPLES, TARGET, STEPS = 2, 4, 4
HELD = 6  # a group with no scripted failure and two attempts, held in its env's first step until step 1
ATTEMPT = re.compile(r"\[attempt (\d+)\]")


@pytest.fixture(scope="module")
def server(sglang_workers):
    """One of the session's SGLang servers, talked to directly (the router tier shares it)."""
    return sglang_workers[0]


class VisionDataSource:
    """slime's data source for a VLM dataset: prompts as messages with an image placeholder, the
    image itself in `multimodal_inputs["images"]`, `n_samples` copies per prompt. Prompts allow 2, 3
    or 4 attempts in turn (the random model never answers right), so trajectories differ in length
    and a step ends with some of them mid-way."""

    def __init__(self, n_samples: int, *, seed: int = 0, render=None, max_attempts: int | None = None):
        """`render` (a processor): prompts rendered to text by its chat template, as slime's
        `--apply-chat-template` hands them over; `max_attempts`: the same for every prompt."""
        self.n_samples, self.next, self.seed = n_samples, 0, seed
        self.render, self.max_attempts = render, max_attempts
        self.handed_out: list[int] = []

    def get_samples(self, num: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num):
            row = make_prompts(1, seed=self.seed + self.next, vision=True)[0]
            image_part, text_part = row["prompt"][0]["content"]
            prompt = [{"role": "user", "content": [{"type": "image"}, text_part]}]
            if self.render is not None:
                prompt = self.render.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            attempts = self.max_attempts or 2 + self.next % 3
            groups.append(
                [
                    Sample(
                        group_index=self.next,
                        index=self.next * self.n_samples + i,
                        prompt=prompt,
                        label=row["label"],
                        multimodal_inputs={"images": [image_part["image"]]},
                        metadata={**row["metadata"], "max_attempts": attempts},
                    )
                    for i in range(self.n_samples)
                ]
            )
            self.handed_out.append(self.next)
            self.next += 1
        return groups


def slime_args(server: SGLangServer, **extra) -> SimpleNamespace:
    host, port = server.url.removeprefix("http://").split(":")
    return SimpleNamespace(
        n_samples_per_prompt=N_SAMPLES, rollout_batch_size=TARGET, over_sampling_batch_size=2 * TARGET,
        partial_rollout=True, max_turns=4, rollout_interaction_env_path="tests.envs.flaky_vision",
        hf_checkpoint=str(server.model_path), sglang_router_ip=host, sglang_router_port=int(port),
        rollout_max_response_len=256, custom_rm_path="tests.hooks.length_rm",  # where the env gives no reward
        turnstile={"max_new_tokens": 24, "max_staleness": STEPS},  # a held group resumes at any later step
        **extra,
    )  # fmt: skip


def cut_at_an_image_token(sample: Sample) -> bool:
    """The random model sampled a token only the processor writes: its trajectory ended FAILED, bad_response."""
    return any(error.startswith("encode/bad_response: ") for error in sample.metadata.get("errors", []))


def check_sample(sample: Sample, processor) -> None:
    """slime's conversion rules for one multi-turn VLM sample."""
    tokenizer = processor.tokenizer
    n = sample.response_length
    assert len(sample.loss_mask) == n == len(sample.rollout_log_probs)
    assert len(sample.tokens) > n
    response = sample.tokens[len(sample.tokens) - n :]
    pad, start = processor.image_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for token, mask, logprob in zip(response, sample.loss_mask, sample.rollout_log_probs, strict=True):
        if mask == 0:
            assert logprob == 0.0  # environment tokens: written directly, log-prob 0
        else:
            assert token not in (pad, start)  # an image token is never the model's: a turn is cut before one
            assert logprob < 0.0  # the server's log-prob of a sampled token
    # images: one in the prompt and one per observation, each expanded to what the merged inputs hold; a
    # FAILED sample too, as slime runs a removed sample through the model with its loss mask zeroed
    train = sample.multimodal_train_inputs
    grid = train["image_grid_thw"]
    merge = processor.image_processor.merge_size
    assert grid.shape[0] == sample.tokens.count(start) == 1 + response.count(start)
    assert train["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    assert sample.tokens.count(pad) == int(grid.prod(-1).sum()) // merge**2
    if sample.status.value == "failed":
        assert sample.remove_sample
        return
    assert sum(sample.loss_mask) > 0
    # the env kept its state: its attempts count up from 1 across every turn, pauses included
    attempts = [int(a) for a in ATTEMPT.findall(tokenizer.decode(response))]
    assert attempts == list(range(1, len(attempts) + 1)), attempts


@pytest.mark.slow
def test_generate_rollout_against_a_real_sglang_server(server):
    from engine.models import load_processor

    processor = load_processor(str(server.model_path))
    args, source = slime_args(server), VisionDataSource(N_SAMPLES)
    returned: list[Sample] = []
    GATE.hold(HELD)
    try:
        for step in range(STEPS):
            out = generate_rollout(args, step, source)
            assert len(out.samples) == TARGET and all(len(g) == N_SAMPLES for g in out.samples)
            for group in out.samples:
                for sample in group:
                    check_sample(sample, processor)
                    sample.metadata["returned_at"] = step
            returned += [s for g in out.samples for s in g]
            assert out.metrics["multi_turn/turns/mean"] > 1
            # the trainer's weight update, as slime does it: straight to the server, not through the rollout
            update_weights_as_slime(server.url, server.model_path, f"v{step + 1}")
            if step == 0:  # group HELD is mid-episode, its env live, one turn generated before the update
                assert HELD in source.handed_out and HELD not in [g[0].group_index for g in out.samples]
                GATE.release()
        service = getattr(args, SERVICE_ATTRIBUTE)
        held = service.held_prompts()
    finally:
        GATE.release()
        getattr(args, SERVICE_ATTRIBUTE).shutdown()

    # every prompt taken comes back once in a group, or is still held
    groups = [s.group_index for s in returned if s.index % N_SAMPLES == 0]
    assert len(groups) == len(set(groups)) == STEPS * TARGET
    assert held == sorted(set(source.handed_out) - set(groups))

    # partial rollout: group HELD was paused at step 0 and returned at a later step, generated across
    # a weight update, with its own env: two turns, the second its last attempt; a fresh env would
    # have counted attempt 1 again and asked for a third (and check_sample would have seen [1, 1])
    held_back = [s for s in returned if s.group_index == HELD]
    assert held_back, f"group {HELD}, held at step 0, not returned in {STEPS} steps (held at the end: {held})"
    for sample in held_back:
        assert sample.metadata["start_rollout_id"] == 0 < sample.metadata["returned_at"]
        # the weights it started with, and those of every step it generated in after the release
        assert len(sample.metadata["turns"]) == 2 and len(set(sample.weight_versions)) >= 2
    versions = {v for s in returned for v in s.weight_versions}
    assert {"v1", "v2"} <= versions

    # the env's failures: a failure retried once and recovered, an env that always fails ends FAILED
    # the model's random weights now and then sample an image token (`<|vision_start|>`, `<|video_pad|>`): that
    # trajectory alone ends FAILED (bad_response), maybe before its env failed as scripted
    cut = [s for s in returned if cut_at_an_image_token(s)]
    failing = [s for s in returned if s.index % 13 == 7 and s not in cut]
    flaky = [s for s in returned if s.index % 5 == 1 and s.index % 13 != 7 and s not in cut]
    assert all(s.status.value == "failed" and s.remove_sample for s in failing + cut)
    assert all(s.status.value != "failed" for s in flaky), [
        (s.index, s.metadata.get("failure"), s.metadata["retries"]) for s in flaky if s.status.value == "failed"
    ]
    # one env_exception retry each, in the first turn; a busy server may add retries of its own classes
    assert all(s.metadata["retries"].get("env_exception") == 1 for s in flaky), [s.metadata["retries"] for s in flaky]
    assert all(s.metadata["turns"][0]["retries"] >= 1 for s in flaky), [s.metadata["turns"][0] for s in flaky]
    assert all("scripted env failure" in s.metadata["failure"] for s in failing)
    assert failing and flaky, "the run returned no sample of the failing kinds"


@pytest.mark.slow
def test_custom_generate_function_against_a_real_sglang_server(server):
    from engine.models import load_processor

    processor = load_processor(str(server.model_path))
    args = slime_args(server)
    (sample,) = VisionDataSource(1).get_samples(1)[0]
    try:
        out = anyio.run(generate, args, sample, {"temperature": 1.0, "max_new_tokens": 256})
    finally:
        getattr(args, SERVICE_ATTRIBUTE).shutdown()
    assert out is sample
    check_sample(out, processor)
    if cut_at_an_image_token(out):
        pytest.skip(f"the random model sampled an image token, which ends the trajectory: {out.metadata['failure']}")
    assert out.status.value in {"completed", "truncated"}, out.metadata.get("failure")
    assert len(out.metadata["turns"]) >= 2
