"""The LLM judge (engine/envs/judge): its score parsing and rubric, the judge client against a local server
in SGLang's reply format and one in OpenAI's chat format (batching, timeout, retries, error classes), its
use as a Turnstile reward function and as slime's `--custom-rm-path` function, the judge env driven with
scripted answers, `turnstile run --env judge` on the embedded default, and a real SGLang server as judge.

slime's own `async_rm` / `batched_async_rm` calling the entry point needs a slime checkout:
scripts/slime_judge_rm.sh runs that check.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from bridge.convert import Sample
from bridge.rewards import SlimeScoring
from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.envs.judge import (
    QUESTIONS,
    Judge,
    JudgeError,
    JudgeReward,
    JudgeSettings,
    UnparseableScore,
    build_env,
    judge_rm,
    make_prompts,
)
from engine.envs.judge.prompt import Rubric, critique_of, parse_score
from engine.envs.judge.settings import from_environment
from engine.envs.loader import EnvSample
from engine.errors import ErrorClass, Stage, stage_of
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status, StopReason
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend
from tests.net import free_port
from tests.sglang_double import Disconnect, Generate, Raw, SGLangDouble, error_body

pytestmark = pytest.mark.anyio

GOOD, POISON = "GOOD ANSWER", "POISON"


def grade(prompt: str) -> str:
    """The double judge's reply to a judge prompt: 9/10 for a conversation holding GOOD ANSWER, else 3/10."""
    return "Clear and correct.\nScore: 9/10" if GOOD in prompt else "Misses the point.\nScore: 3/10"


class JudgeDouble(SGLangDouble):
    """SGLang's /generate with a batch (`text` or `input_ids` as a list) answered by `grade`, and an
    OpenAI-compatible /v1/chat/completions answered the same way. A batch holding POISON gets HTTP 500.
    Scripted replies (delays, statuses, disconnects) apply to the next /generate as in SGLangDouble."""

    def __init__(self, tokenizer: Any = None, reply=grade):
        super().__init__()
        self.tokenizer, self.reply = tokenizer, reply

    def prompts_of(self, body: dict[str, Any]) -> list[str]:
        if "text" in body:
            return list(body["text"])
        return [self.tokenizer.decode(ids) for ids in body["input_ids"]]

    def generate_reply(self, spec: Generate, request: dict[str, Any]) -> tuple[int, Any]:
        if spec.delay_s:
            self._stopping.wait(spec.delay_s)
        prompts = self.prompts_of(request)
        if spec.status != 200 or any(POISON in p for p in prompts):
            return (spec.status if spec.status != 200 else 500), error_body(500, "judge double: internal error")
        return 200, [{"text": self.reply(p), "meta_info": {"finish_reason": {"type": "stop"}}} for p in prompts]

    def control_reply(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if (method, path) != ("POST", "/v1/chat/completions"):
            return super().control_reply(method, path, body)
        prompt = body["messages"][-1]["content"]
        if POISON in prompt:
            return 500, error_body(500, "judge double: internal error")
        message = {"role": "assistant", "content": self.reply(prompt)}
        return 200, {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}


@pytest.fixture
def double():
    with JudgeDouble() as server:
        yield server


def fast(url: str | None, **kw) -> JudgeSettings:
    return JudgeSettings(url=url, backoff_base_s=0.0, **{"batch_window_s": 0.0, **kw})


def conversation(answer: str, question: str = "Explain DNS in two sentences.") -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


# -- the prompt and the score ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("Good.\nScore: 7/10", 7.0),
        ("score: 6", 6.0),
        ("**Score:** 8 / 10", 8.0),
        ("Score: 4/5", 8.0),  # another scale, brought to the rubric's
        ('{"critique": "fine", "score": 5}', 5.0),
        ("Score: 2/10 at first, but on reflection Score: 6/10", 6.0),  # the last one counts
    ],
)
def test_a_score_is_read_from_a_score_line_or_a_json_field(reply, score):
    assert parse_score(reply, max_score=10) == score


@pytest.mark.parametrize("reply", ["", "It is a fine answer.", "Score: 11/10", "Score: -1", "Scores vary"])
def test_a_reply_without_a_score_on_the_scale_is_one_error_class(reply):
    with pytest.raises(UnparseableScore) as caught:
        parse_score(reply, max_score=10)
    error = caught.value
    assert isinstance(error, JudgeError) and error.kind == "unparseable"
    assert error.error_class is ErrorClass.JUDGE and error.stage is Stage.REWARD is stage_of(ErrorClass.JUDGE)


def test_the_rubric_is_the_packaged_one_or_a_file_with_the_conversation_filled_in(tmp_path):
    packaged = Rubric.load(None).render(conversation("It maps names to addresses."))
    assert "[user]\nExplain DNS in two sentences." in packaged and "[assistant]\nIt maps names" in packaged
    assert "Score: N/10" in packaged and "{{" not in packaged
    own = tmp_path / "rubric.txt"
    own.write_text("Grade 0-{{max_score}}:\n{{conversation}}\nEnd.")
    assert Rubric.load(str(own), max_score=5).render(conversation("x")).startswith("Grade 0-5:\n[user]\n")
    own.write_text("Grade the answer.")  # no placeholder: the transcript goes after it
    assert Rubric.load(str(own)).render(conversation("x")).endswith("[assistant]\nx\n")
    for bad, why in [(tmp_path / "none.txt", "does not read"), (tmp_path / "empty.txt", "is empty")]:
        if "empty" in bad.name:
            bad.write_text("  \n")
        with pytest.raises(ValueError, match=f"judge rubric '{re.escape(str(bad))}' {why}"):
            Rubric.load(str(bad))


def test_settings_come_from_the_environment_then_args_then_keywords(monkeypatch):
    monkeypatch.setenv("TURNSTILE_JUDGE_URL", "http://env:1")
    monkeypatch.setenv("TURNSTILE_JUDGE_MAX_BATCH_SIZE", "5")
    args = SimpleNamespace(judge={"url": "http://args:2", "api": "openai"})
    settings = JudgeSettings.from_sources(args, api="sglang")
    assert (settings.url, settings.max_batch_size, settings.api) == ("http://args:2", 5, "sglang")
    assert settings.error_policy == "fail" and JudgeSettings().error_policy == "fallback"  # local: fallback
    with pytest.raises(ValueError, match="TURNSTILE_JUDGE_URLS: no such judge setting"):
        from_environment({"TURNSTILE_JUDGE_URLS": "x"})
    with pytest.raises(ValueError, match="must be a mapping of judge settings, got str"):
        JudgeSettings.from_sources(SimpleNamespace(judge="http://x"))


# -- the client against SGLang's and OpenAI's reply formats ---------------------------------------


async def test_the_judge_scores_through_sglang_generate_as_text(double):
    async with Judge(fast(double.url)) as judge:
        verdict = await judge.judge(conversation(GOOD))
    assert (verdict.score, verdict.raw_score, verdict.error) == (0.9, 9.0, None)
    assert verdict.critique == "Clear and correct."
    (request,) = double.requests_to("/generate")
    assert request.body["sampling_params"] == {"max_new_tokens": 128, "temperature": 0.0}
    assert len(request.body["text"]) == 1 and GOOD in request.body["text"][0]


async def test_with_a_tokenizer_the_prompt_goes_as_input_ids_in_the_chat_template(tokenizer):
    with JudgeDouble(tokenizer) as server:
        async with Judge(fast(server.url, tokenizer="qwen2.5")) as judge:
            assert await judge.score(conversation("meh")) == pytest.approx(0.3)
        (ids,) = server.requests_to("/generate")[0].body["input_ids"]
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "[assistant]\nmeh" in text


async def test_the_judge_scores_through_an_openai_compatible_chat_api(double):
    async with Judge(fast(double.url, api="openai", model="judge-7b")) as judge:
        scores = [await judge.score(conversation(answer)) for answer in (GOOD, "meh")]
    assert scores == [pytest.approx(0.9), pytest.approx(0.3)]
    requests = double.requests_to("/v1/chat/completions")
    assert len(requests) == 2 and requests[0].body["model"] == "judge-7b"
    assert requests[0].body["messages"][0]["role"] == "user" and GOOD in requests[0].body["messages"][0]["content"]


async def test_batching_sends_concurrent_conversations_in_one_request(double):
    settings = fast(double.url, max_batch_size=4, batch_window_s=0.5)
    async with Judge(settings) as judge:
        scores: dict[int, float] = {}

        async def ask(i: int) -> None:
            scores[i] = await judge.score(conversation(GOOD if i % 2 else f"answer {i}"))

        async with anyio.create_task_group() as group:
            for i in range(6):
                group.start_soon(ask, i)
        stats = judge.statistics()
    assert scores == {i: pytest.approx(0.9 if i % 2 else 0.3) for i in range(6)}  # each gets its own score
    sizes = [len(r.body["text"]) for r in double.requests_to("/generate")]
    assert sorted(sizes) == [2, 4]  # 4 filled a batch at once; 2 more went together when the window closed
    assert (stats.num_requests, stats.num_batches, stats.largest_batch, stats.num_scored) == (6, 2, 4, 6)


async def test_a_slow_reply_times_out_and_is_retried_within_the_budget(double):
    double.script(Generate(delay_s=2.0), Generate(delay_s=2.0))  # then prompt replies
    async with Judge(fast(double.url, timeout_s=0.3, max_retries=2)) as judge:
        assert await judge.score(conversation(GOOD)) == pytest.approx(0.9)
        stats = judge.statistics()
    assert (stats.num_retries, stats.failures) == (2, {})
    assert len(double.requests_to("/generate")) == 3


async def test_a_timeout_that_spends_the_budget_is_a_judge_error_of_kind_timeout(double):
    double.script(*[Generate(delay_s=2.0)] * 2)
    async with Judge(fast(double.url, timeout_s=0.3, max_retries=1)) as judge:
        with pytest.raises(JudgeError) as caught:
            await judge.score(conversation(GOOD))
        stats = judge.statistics()
    assert caught.value.kind == "timeout" and "(after 1 retries)" in caught.value.message
    assert (stats.num_retries, stats.failures) == (1, {"timeout": 1})


@pytest.mark.parametrize(
    ("replies", "kind", "num_sent"),
    [
        ([Raw(503, error_body(503, "overloaded"))] * 3, "server", 3),  # 1 + max_retries
        ([Disconnect()] * 3, "connection", 3),
        ([Raw(400, error_body(400, "bad request"))], "client", 1),  # never retried
        ([Raw(200, "not json", "text/plain")], "malformed", 1),
        ([Raw(200, [{"meta_info": {}}])], "malformed", 1),  # no text
    ],
)
async def test_failures_are_retried_by_class_and_counted_by_kind(double, replies, kind, num_sent):
    double.script(*replies)
    async with Judge(fast(double.url, max_retries=2)) as judge:
        verdict = await judge.judge(conversation(GOOD))
        stats = judge.statistics()
    assert verdict.score is None and verdict.error.kind == kind and verdict.error.error_class is ErrorClass.JUDGE
    assert f"judge at {double.url}: POST /generate" in verdict.error.message or "unreachable" in verdict.error.message
    assert len(double.requests_to("/generate")) == num_sent
    assert (stats.num_retries, stats.failures) == (num_sent - 1, {kind: 1})


async def test_a_judge_that_is_not_there_is_a_connection_failure_with_the_fallback_policy():
    url = f"http://127.0.0.1:{free_port()}"
    async with Judge(fast(url, max_retries=1, on_error="fallback", fallback_score=-1.0)) as judge:
        assert await judge.score(conversation(GOOD)) == -1.0
        assert judge.statistics().failures == {"connection": 1}


async def test_a_batch_that_fails_is_resent_one_by_one_so_only_the_bad_conversation_fails(double):
    async with Judge(fast(double.url, max_batch_size=3, batch_window_s=0.5, max_retries=1)) as judge:
        verdicts: dict[str, Any] = {}

        async def ask(answer: str) -> None:
            verdicts[answer] = await judge.judge(conversation(answer))

        async with anyio.create_task_group() as group:
            for answer in (GOOD, POISON, "meh"):
                group.start_soon(ask, answer)
    assert verdicts[GOOD].score == 0.9 and verdicts["meh"].score == pytest.approx(0.3)
    assert verdicts[POISON].error.kind == "server"
    sizes = [len(r.body["text"]) for r in double.requests_to("/generate")]
    assert sizes == [3, 3, 1, 1, 1, 1]  # the batch and its retry (500), then each alone, and POISON's retry


# -- as a reward function ------------------------------------------------------------------------


class OneAnswerEnv(AsyncInteractionEnv):
    """Done after the model's first answer, with no reward of its own: the reward function gives it."""

    async def astep(self, response_text):
        return {}, True, {}


async def test_as_a_turnstile_reward_function_a_judge_5xx_fails_only_that_trajectorys_reward(double, tokenizer):
    encoder = ChatEncoder(tokenizer)
    rows = [{"prompt": [{"role": "user", "content": q}], "label": None} for q in (GOOD, "plain", POISON, "other")]
    config = EngineConfig(
        n_samples_per_prompt=1,
        retry=RetryPolicy(backoff_base_s=0.0),
        limits=TurnLimits(max_turns=2),
        sampling=SamplingParams(max_new_tokens=8),
    )
    judge = Judge(fast(double.url, max_batch_size=4, batch_window_s=0.2, max_retries=1))
    engine = RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=lambda sample: EnvRunner(OneAnswerEnv()),
        source=rows,
        config=config,
        reward_fn=JudgeReward(judge, encoder),
    )
    async with judge, engine:
        groups = await engine.rollout(4)
    by_prompt = {g.trajectories[0].prompt[0]["content"]: g.trajectories[0] for g in groups}
    assert {p: t.status for p, t in by_prompt.items()} == {
        GOOD: Status.COMPLETED, "plain": Status.COMPLETED, POISON: Status.FAILED, "other": Status.COMPLETED
    }  # fmt: skip
    assert by_prompt[GOOD].reward == 0.9 and by_prompt["plain"].reward == pytest.approx(0.3)
    failed = by_prompt[POISON]
    assert failed.stop_reason is StopReason.REWARD_ERROR and failed.errors[-1].error_class == "judge"
    assert "HTTP 500" in failed.errors[-1].message
    # the judge's class keeps its own budget (none in the engine: the judge retried already), not reward's
    assert judge.statistics().failures == {"server": 1}


def slime_args(url: str, **judge: Any) -> SimpleNamespace:
    """slime's args as the rm path reads them, the judge settings from a --custom-config-path YAML."""
    settings = {"url": url, "backoff_base_s": 0.0, "batch_window_s": 0.2, **judge}
    return SimpleNamespace(custom_rm_path="engine.envs.judge.rm.judge_rm", judge=settings, group_rm=False)


async def test_slimes_rm_path_calls_the_entry_point_for_a_sample_and_for_a_group(double):
    # As slime/rollout/rm_hub/__init__.py does (commit 624b824a): async_rm loads args.custom_rm_path and
    # awaits `rm_function(args, sample, **kwargs)`; batched_async_rm awaits `rm_function(args, samples, **kwargs)`.
    args = slime_args(double.url)
    samples = [Sample(prompt="Explain DNS.", response=answer) for answer in (GOOD, "meh", GOOD)]
    assert await judge_rm(args, samples[0]) == 0.9
    assert await judge_rm(args, samples) == [0.9, pytest.approx(0.3), 0.9]
    assert [len(r.body["text"]) for r in double.requests_to("/generate")] == [1, 3]  # the group in one batch
    text = double.requests_to("/generate")[0].body["text"][0]
    assert "[user]\nExplain DNS.\n\n[assistant]\nGOOD ANSWER" in text


def test_one_shared_judge_per_settings_per_event_loop():
    from engine.envs.judge.shared import JudgeRegistry

    registry = JudgeRegistry()
    a, b = JudgeSettings(url="http://a:1"), JudgeSettings(url="http://b:1")

    async def judges() -> tuple[Judge, Judge, Judge]:
        return registry.judge(a), registry.judge(JudgeSettings(url="http://a:1")), registry.judge(b)

    first, same, other = anyio.run(judges)
    assert first is same and first is not other
    assert anyio.run(judges)[0] is not first  # another loop, another judge (the closed loop's is dropped)
    assert len(registry._judges) == 2


async def test_turnstiles_slime_bridge_loads_the_entry_point_by_path(double, tokenizer):
    scoring = SlimeScoring(slime_args(double.url), tokenizer)
    sample = Sample(prompt=[{"role": "user", "content": "Explain DNS."}], response=GOOD)
    assert await scoring._score(sample) == 0.9


# -- the judge env -------------------------------------------------------------------------------


def test_make_prompts_gives_each_question_once_before_repeating_and_refuses_vision():
    rows = make_prompts(len(QUESTIONS), seed=3)
    assert sorted(r["prompt"][0]["content"] for r in rows) == sorted(QUESTIONS)
    assert make_prompts(4, seed=3) == rows[:4] and make_prompts(4, seed=4) != rows[:4]
    with pytest.raises(ValueError, match="the judge env is text only"):
        make_prompts(2, vision=True)


async def test_the_env_gives_the_critique_for_a_revision_then_ends_with_the_judges_score(double):
    row = make_prompts(1)[0]
    env = build_env(EnvSample.from_row(row), SimpleNamespace(max_turns=3, judge={"url": double.url}))
    runner = EnvRunner(env)
    await runner.reset()
    first = await runner.step("meh")
    assert not first.done and "reward" not in first.info and first.info["judge_score"] == pytest.approx(0.3)
    assert runner.message(first.observation)["content"][-1]["text"] == (
        "A reviewer's critique of your answer:\nMisses the point.\n\nRevise your answer."
    )
    last = await runner.step(f"better: {GOOD}")
    assert last.done and last.info["reward"] == 0.9
    judged = double.requests_to("/generate")[-1].body["text"][0]  # the whole conversation, critique included
    assert "[assistant]\nmeh\n\n[user]\nA reviewer's critique" in judged and "[assistant]\nbetter: GOOD" in judged


async def test_the_env_scores_the_first_answer_when_there_is_no_turn_for_a_revision(double):
    env = build_env(EnvSample.from_row(make_prompts(1)[0]), SimpleNamespace(max_turns=1, judge={"url": double.url}))
    observation, done, info = await env.astep(GOOD)
    assert done and info["reward"] == 0.9


async def test_without_a_score_the_env_fails_the_step_or_gives_the_fallback_by_policy():
    def rambling(prompt: str) -> str:
        return "I have no opinion on this."

    with JudgeDouble(reply=rambling) as server:
        args = SimpleNamespace(max_turns=1, judge={"url": server.url})
        with pytest.raises(UnparseableScore):
            await build_env(None, args).astep("answer")
        args.judge["on_error"], args.judge["fallback_score"] = "fallback", 0.25
        observation, done, info = await build_env(None, args).astep("answer")
    assert done and info["reward"] == 0.25 and info["judge_error"]["kind"] == "unparseable"
    assert info["judge_reply"] == "I have no opinion on this." and info["judge_error"]["class"] == "judge"


@pytest.mark.slow
async def test_a_critique_round_needs_a_reply_not_a_score():
    with JudgeDouble(reply=lambda prompt: "Too vague.") as server:  # no score line: still a critique
        args = SimpleNamespace(max_turns=2, judge={"url": server.url, "batch_window_s": 0.0})
        observation, done, _ = await build_env(None, args).astep("answer")
        assert not done and "critique of your answer:\nToo vague.\n" in observation["obs_str"]
        server.script(Raw(400, error_body(400, "bad request")), Raw(400, error_body(400, "bad request")))
        with pytest.raises(JudgeError) as caught:  # no reply at all
            await build_env(None, args).astep("answer")
        assert caught.value.kind == "client"
        args.judge["on_error"] = "fallback"
        observation, done, _ = await build_env(None, args).astep("answer")
    assert not done and "No critique is available." in observation["obs_str"]


async def test_in_an_engine_a_judge_without_a_score_fails_that_trajectory_or_gives_the_fallback(tokenizer):
    def by_prompt(prompt: str) -> str:
        return "Score: 8/10" if "hash table" in prompt else "no grade from me"

    rows = [{"prompt": [{"role": "user", "content": q}], "label": None} for q in QUESTIONS[:2]]  # hash table first
    config = EngineConfig(
        n_samples_per_prompt=1, retry=RetryPolicy(backoff_base_s=0.0), limits=TurnLimits(max_turns=1),
        sampling=SamplingParams(max_new_tokens=8),
    )  # fmt: skip
    with JudgeDouble(reply=by_prompt) as server:
        outcomes = {}
        for policy in ("fail", "fallback"):
            args = SimpleNamespace(max_turns=1, judge={"url": server.url, "on_error": policy, "batch_window_s": 0.0})
            engine = RolloutEngine(
                backend=DeterministicBackend(), encoder=ChatEncoder(tokenizer), source=rows, config=config,
                env_factory=lambda sample, args=args: EnvRunner(build_env(sample, args)),
            )  # fmt: skip
            async with engine:
                groups = await engine.rollout(2)
            outcomes[policy] = sorted((g.trajectories[0] for g in groups), key=lambda t: t.prompt[0]["content"])
    scored, failed = outcomes["fail"]
    assert (scored.status, scored.reward) == (Status.COMPLETED, 0.8)
    # the judge's failure, with its own class, in the env's step: the trajectory's reward failed
    assert failed.status is Status.FAILED and failed.stop_reason is StopReason.REWARD_ERROR
    assert failed.errors[-1].error_class == "judge" and "no grade from me" in failed.errors[-1].message
    assert [(t.status, t.reward) for t in outcomes["fallback"]] == [(Status.COMPLETED, 0.8), (Status.COMPLETED, 0.0)]


async def test_without_a_url_the_judge_runs_the_local_model_and_its_random_reply_is_data():
    settings = JudgeSettings(max_new_tokens=12, temperature=1.0, batch_window_s=0.2)
    async with Judge(settings) as judge:
        verdicts = [await judge.judge(conversation(answer)) for answer in ("a", "b")]
        stats = judge.statistics()
    for verdict in verdicts:  # random weights: a score is possible, a reply that has none is likely
        assert isinstance(verdict.reply, str)
        assert verdict.error is None or verdict.error.kind == "unparseable"
    assert stats.num_batches == 2 and stats.num_scored + stats.failures.get("unparseable", 0) == 2


@pytest.mark.slow
def test_turnstile_run_env_judge_on_the_embedded_default(tmp_path):
    from engine.cli import main

    out = tmp_path / "judge.jsonl"
    assert main(["run", "--env", "judge", "--num-prompts", "4", "--max-turns", "2", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 and all(r["status"] in ("completed", "truncated", "failed") for r in records)
    for record in records:  # an answer, the critique as an observation, a revision, then the score
        if record["stop_reason"] == "env_done":
            assert len(record["turns"]) == 2 and isinstance(record["reward"], float)
            assert 0.0 <= record["reward"] <= 1.0


def test_critique_of_drops_the_score_line():
    assert critique_of("Too long.\nScore: 4/10\n") == "Too long."


# -- a real SGLang server as the judge -----------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_judge():
    """One real SGLang server on CPU serving the tiny Qwen2.5-VL model, as the judge. Skips (fails under
    TURNSTILE_REQUIRE_SGLANG=1) without the SGLang venv."""
    import os

    from tests.sglang_cpu.server import SGLangServer, SGLangUnavailable, is_installed, model_dir, venv_dir

    if not is_installed():
        reason = f"no SGLang venv at {venv_dir()}: run `python -m tests.sglang_cpu.server install`"
        if os.environ.get("TURNSTILE_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    server = SGLangServer(model_dir("tiny-qwen2.5-vl"))
    try:
        server.start()
    except SGLangUnavailable as error:
        server.stop()
        pytest.fail(str(error))
    yield server
    server.stop()


@pytest.mark.sglang
@pytest.mark.parametrize(
    "how",
    [{"api": "sglang"}, {"api": "sglang", "tokenizer": "qwen2.5"}, {"api": "openai"}],
    ids=lambda h: "-".join(h.values()),
)
async def test_a_real_sglang_server_judges_in_batches(sglang_judge, how):
    """The tiny random-weight model writes no score, mostly: what is checked is that every request reaches the
    server and comes back as a reply, read as a score or classified unparseable, never a transport failure."""
    settings = JudgeSettings(url=sglang_judge.url, max_new_tokens=16, batch_window_s=0.5, **how)
    async with Judge(settings) as judge:
        verdicts: list[Any] = []

        async def ask(i: int) -> None:
            verdicts.append(await judge.judge(conversation(f"answer number {i}")))

        async with anyio.create_task_group() as group:
            for i in range(3):
                group.start_soon(ask, i)
        stats = judge.statistics()
    assert len(verdicts) == 3 and all(isinstance(v.reply, str) for v in verdicts)
    assert all(v.error is None or v.error.kind == "unparseable" for v in verdicts)
    assert set(stats.failures) <= {"unparseable"} and stats.num_retries == 0
    assert (stats.num_batches, stats.largest_batch) == ((1, 3) if how["api"] == "sglang" else (3, 1))
