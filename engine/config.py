"""Turnstile's settings: one typed model, validated once when built, read by the engine, `turnstile run`
and the slime bridge alike.

`EngineConfig` holds what `RolloutEngine` runs with; `Settings` extends it with what a run needs around
the engine (env, tokenizer, backend, logs). Each knob is declared once, with its one default and its
description (the attribute docstring); docs/settings.md is printed from these classes
(`python -m engine.config`) and a test keeps the two equal.

Where a knob's value comes from:

- `turnstile run`: its flags (knobs marked `FLAG`), over a YAML file of flat keys (`--config`), over the
  defaults. The YAML takes slime's name where slime has one (`rollout_interaction_env_path` for `env_path`).
- the slime bridge (bridge/settings.py): slime's flags for what slime already says (knobs marked `Slime`),
  the `turnstile:` section of slime's `--custom-config-path` YAML for the rest.

A knob marked `Only` is read by one of the two and refused by the other, so no setting is taken and then
ignored.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo

from engine.backends.base import SamplingParams
from engine.backends.sglang_read import InProcessParsers
from engine.envs.builtin import resolve_env_path
from engine.families import NAMES, REASONING_PARSERS, family_name, has_family, reasoning_parser_name
from engine.scheduler.queue import Policy
from engine.scheduler.retry import RetryPolicy
from engine.turn import ServerReader, TurnLimits

Reader = Literal["run", "slime"]
EMBEDDED_TURN_TOKENS = 48  # the per-turn cap on the local backend when max_new_tokens is unset (see that knob)


@dataclass(frozen=True, slots=True)
class Slime:
    """Under slime, where a knob's value comes from: `source` names slime's flag (or a top-level key of
    slime's custom config YAML). With `fills`, slime's value stands in only when the `turnstile:` section
    leaves the knob unset; without, slime's flag decides and the section may not name the knob."""

    source: str
    fills: bool = False


@dataclass(frozen=True, slots=True)
class Only:
    """A knob read by one entry point only: "run" (`turnstile run`) or "slime" (the slime bridge)."""

    reader: Reader


@dataclass(frozen=True, slots=True)
class Flag:
    """The knob is also a `turnstile run` option, `--` and its name with dashes, and `--` and each of
    `aliases`."""

    aliases: tuple[str, ...] = ()


FLAG = Flag()
RETRY_FLAGS = {"env_step_timeout_s": "env-step-timeout"}  # RetryPolicy knobs that are `turnstile run` options
MOVED = {  # keys of earlier versions, and where the knob lives now
    "env_step_timeout": "retry.env_step_timeout_s",
    "env_step_timeout_s": "retry.env_step_timeout_s",
    "backend.kind": "backend",
}
_LIMITS = tuple(f.name for f in fields(TurnLimits))
_SAMPLING = tuple(f.name for f in fields(SamplingParams) if f.name != "sampling_seed")

M = TypeVar("M")


def marker(field: FieldInfo, kind: type[M]) -> M | None:
    """`field`'s marker of type `kind` (Slime, Only, Flag), if it has one."""
    return next((m for m in field.metadata if isinstance(m, kind)), None)


class EngineConfig(BaseModel):
    """What `RolloutEngine` runs with. Per-trajectory limits and per-request sampling are flat knobs here;
    `limits` and `sampling` give them as the `TurnLimits` and `SamplingParams` the turns take. The
    constructor (and `model_copy(update=...)`) also takes `limits=` or `sampling=` objects, unpacked into
    those knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, validate_by_name=True)

    # -- groups and concurrency -----------------------------------------------------------------------
    n_samples_per_prompt: Annotated[PositiveInt, Slime("`--n-samples-per-prompt`"), FLAG] = 1
    """Trajectories per prompt: a group, emitted once all its members have ended."""
    max_inflight: Annotated[
        PositiveInt,
        Slime(
            "the step's groups in flight (`--rollout-batch-size`, x over_sampling with partial rollout)"
            " x n_samples_per_prompt",
            fills=True,
        ),
        FLAG,
    ] = 512
    """Trajectories admitted and not yet ended, at most (never less than one group)."""
    max_generating: Annotated[PositiveInt, Slime("`--sglang-server-concurrency` x engines", fills=True), FLAG] = 256
    """Concurrent generate requests over all servers; a trajectory holds a slot only while its request runs."""
    max_env_steps: Annotated[PositiveInt, FLAG] = 64
    """Concurrent env steps; size it to what the env's backing service (sandbox, judge, tool) takes."""
    policy: Annotated[Policy, FLAG] = Policy.GROUP_COMPLETION
    """Which ready turn gets a free slot first: fifo, group_completion (fewest unfinished members) or oldest."""

    # -- limits of a trajectory -----------------------------------------------------------------------
    max_turns: Annotated[PositiveInt, Slime("`max_turns:` at the top of the custom config"), FLAG] = 6
    """Turns (model replies) per trajectory; after the last one it ends with stop reason max_turns."""
    max_tokens: Annotated[PositiveInt, Slime("`--rollout-max-response-len`"), FLAG] = 2048
    """Response budget of a trajectory: generated plus observation tokens; it caps every request too."""
    max_context_len: Annotated[PositiveInt | None, Slime("`--rollout-max-context-len`"), FLAG] = None
    """The model's window, prompt plus response (none: no cap beyond max_tokens)."""

    # -- sampling, per request ------------------------------------------------------------------------
    max_new_tokens: Annotated[PositiveInt | None, FLAG] = None
    """Per-turn cap: a turn cut there is closed with the end-of-turn token (mask 0) and the env still
    answers it. None: a turn may use what is left of max_tokens, except on the local backend, where it is
    48 (the tiny random-weight models seldom stop by themselves)."""
    temperature: Annotated[float, Field(ge=0), Slime("`--rollout-temperature`"), FLAG] = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: Annotated[float, Field(gt=0, le=1), Slime("`--rollout-top-p`"), FLAG] = 1.0
    """Nucleus sampling's probability mass."""
    top_k: Annotated[int, Slime("`--rollout-top-k`"), FLAG] = -1
    """Sample among the k likeliest tokens (-1: all)."""
    stop: Annotated[tuple[str, ...], Slime("`--rollout-stop`")] = ()
    """Stop strings; a matched one stays in the reply."""
    stop_token_ids: Annotated[tuple[int, ...], Slime("`--rollout-stop-token-ids`")] = ()
    """Stop token ids (none given: the chat template's end-of-turn ids)."""
    skip_special_tokens: Annotated[bool, Slime("`--rollout-skip-special-tokens`")] = True
    """Decode replies without special tokens (the text the env reads)."""
    min_new_tokens: NonNegativeInt = 0
    """Tokens a request generates before it may stop."""
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    """SGLang's repetition penalty (1: none)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (for benchmarks)."""
    sampling_seed_base: Annotated[
        int | None, Slime("`--rollout-seed`, with `--sglang-enable-deterministic-inference`")
    ] = None
    """Per-request sampling seed = this + the trajectory's index in its group (SGLang; none: unseeded)."""
    seed: Annotated[int, FLAG] = 0
    """Seed of the engine's own randomness (retry jitter), the built-in prompts and the tiny models' weights."""

    # -- partial rollout ------------------------------------------------------------------------------
    partial_rollout: Annotated[bool, Slime("`--partial-rollout`")] = False
    """A step returns once its target groups are done; the rest are paused, envs alive, and resume next step."""
    over_sampling: Annotated[
        float | None, Field(ge=1.0), Slime("`--over-sampling-batch-size` / `--rollout-batch-size`", fills=True)
    ] = None
    """With partial rollout, groups kept in flight per group a step wants: exactly (in_flight fixed), or the most
    (in_flight auto). None: 1 (fixed), up to what max_inflight holds (auto)."""
    in_flight: Annotated[Literal["fixed", "auto"], FLAG] = "fixed"
    """With partial rollout, how many groups a step keeps in flight. fixed: over_sampling x the target. auto
    (experimental; docs/engine.md has its figures): sized by the servers' own load (SGLang's GET /v1/loads), one
    more while they have room, fewer when requests queue, the KV cache fills or too many sessions come back stale,
    between the step's target and over_sampling x it (what max_inflight holds without over_sampling); servers
    that report no load get fixed."""
    refill: Annotated[float, Field(ge=0)] = 0.0
    """With partial rollout, more groups a step may start, per group it wants, while fewer trajectories are
    live than max_generating (the step's tail); they resume first next step. Raise max_staleness with it."""
    max_staleness: NonNegativeInt = 1
    """Weight versions a resumed trajectory's tokens may lag; past it, on_stale applies."""
    on_stale: Literal["restart", "finish"] = "restart"
    """A trajectory past max_staleness is restarted from its prompt, or finished (aborted, tokens kept)."""
    max_restarts: NonNegativeInt = 2
    """Restarts for staleness per trajectory; past it, it ends aborted (stale)."""
    mask_offpolicy: Annotated[bool, Slime("`--mask-offpolicy-in-partial-rollout`")] = False
    """Zero the loss mask of tokens older than a trajectory's newest weight version."""

    # -- outcomes -------------------------------------------------------------------------------------
    max_failed_share: Annotated[float, Field(ge=0, le=1)] = 0.5
    """A step whose share of failed trajectories is over this raises StepFailedError (none of it trains)."""
    drop_zero_std: bool = False
    """Drop groups whose rewards are all equal (no learning signal)."""
    drift_check_every: NonNegativeInt = 0
    """Re-render one finished trajectory in N and count where its tokens drift (0: never)."""

    # -- retries and the breaker ----------------------------------------------------------------------
    retry: RetryPolicy = RetryPolicy()
    """Retry budgets per error class, backoff and timeouts (the retry.* rows)."""
    breaker_threshold: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Share of failed attempts (generate calls, env steps) in the window above which no prompt is admitted."""
    breaker_window_s: Annotated[float, Field(gt=0)] = 30.0
    """The breaker's sliding window, seconds."""
    breaker_min_attempts: PositiveInt = 20
    """Attempts in the window before the breaker may open."""

    # -- metrics --------------------------------------------------------------------------------------
    metrics_host: Annotated[str, FLAG] = "127.0.0.1"
    """Address Prometheus /metrics is served on."""
    metrics_port: Annotated[int | None, Field(ge=0, le=65535), FLAG] = None
    """Port of Prometheus /metrics (0: any free port; none: not served)."""
    metrics_sd_dir: Annotated[str | None, FLAG] = None
    """A folder Prometheus reads with file_sd_configs: while /metrics is served, it holds a target file naming
    this process's host:port (its node's address where metrics_host is 0.0.0.0), so Prometheus finds it on
    whichever node it runs (deploy/prometheus.yml)."""
    metrics_labels: dict[Annotated[str, Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$")], str] = {}
    """Labels that target file gives every series Prometheus scrapes from this process (each rollout shard's
    carries shard: its index)."""

    # -- agent envs (engine/agents/env.py) -----------------------------------------------------------
    agent_host: str = "127.0.0.1"
    """Address the session gateway of agent envs binds (served from the first agent env built)."""
    agent_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Its port (0: any free port)."""
    agent_public_url: str | None = None
    """The gateway's address as the agents reach it (default http://agent_host:port): set it where agents run
    elsewhere (a container, another node)."""
    agent_client_sampling: Literal["ignore", "refuse"] = "ignore"
    """An agent's temperature, top_p, seed and the like: ignored and counted, or refused with a 400 naming them;
    the rollout's sampling settings rule either way."""

    # -- the process ----------------------------------------------------------------------------------
    gc_freeze: bool = True
    """When the process's first engine starts: collect garbage, then gc.freeze() what is alive (the modules
    loaded, torch, the tokenizer), so the collector's full passes, which stop the event loop, skip it. With
    those loaded, a full pass took 130-160 ms in benchmarks.longtail. False: the collector is left as it is."""

    @model_validator(mode="before")
    @classmethod
    def _unpack(cls, data: Any) -> Any:
        """`limits=TurnLimits(...)` and `sampling=SamplingParams(...)`, as their knobs."""
        if not isinstance(data, Mapping) or not ({"limits", "sampling"} & data.keys()):
            return data
        data = dict(data)
        for key, kind, names in (("limits", TurnLimits, _LIMITS), ("sampling", SamplingParams, _SAMPLING)):
            if key not in data:
                continue
            value = data.pop(key)
            if not isinstance(value, kind):
                raise ValueError(f"{key}: give a {kind.__name__}, or its fields ({', '.join(names)}) as settings")
            if getattr(value, "sampling_seed", None) is not None:
                raise ValueError("sampling: a per-request sampling_seed is not a setting; set sampling_seed_base")
            both = sorted(set(names) & data.keys())
            if both:
                raise ValueError(f"{key} and {', '.join(both)} both given: give one or the other")
            data.update({name: getattr(value, name) for name in names})
        return data

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with `update` applied, validated like a new config (`update` may give `limits` or
        `sampling` objects, as the constructor takes them)."""
        base = super().model_copy(deep=deep)
        if not update:
            return base
        kept = {name: getattr(base, name) for name in type(self).model_fields}
        return self.model_validate({**kept, **type(self)._unpack(dict(update))})

    def step_groups(self, target: int) -> tuple[int, int]:
        """Groups a step of `target` keeps in flight, and the most it may hold once its tail refills: with
        partial rollout `target * over_sampling` and `target * refill` more; `target` and `target` otherwise."""
        if not self.partial_rollout:
            return target, target
        goal = math.ceil(target * (self.over_sampling or 1.0))
        return goal, goal + math.ceil(target * self.refill)

    def in_flight_ceiling(self, target: int) -> int:
        """The most groups a step of `target` keeps in flight when sized by the servers (in_flight auto)."""
        if self.over_sampling is not None:
            return math.ceil(target * self.over_sampling)
        return max(target, self.max_inflight // self.n_samples_per_prompt)

    @property
    def limits(self) -> TurnLimits:
        """The limits every trajectory runs under."""
        return TurnLimits(max_turns=self.max_turns, max_tokens=self.max_tokens, max_context_len=self.max_context_len)

    @property
    def sampling(self) -> SamplingParams:
        """Every request's sampling; `max_new_tokens` is the per-turn cap as resolved (`turn_cap`)."""
        values = {name: getattr(self, name) for name in _SAMPLING if name != "max_new_tokens"}
        return SamplingParams(max_new_tokens=self.turn_cap, **values)

    @property
    def turn_cap(self) -> int:
        """The per-turn cap: max_new_tokens, or (unset) what is left of max_tokens."""
        return self.max_new_tokens or self.max_tokens


class Settings(EngineConfig):
    """A whole run's settings: the engine's, and the env, tokenizer, backend and logs around it.
    `engine_config()` is the engine's part."""

    # -- env, tokenizer, model ------------------------------------------------------------------------
    env_path: Annotated[
        str,
        AfterValidator(resolve_env_path),
        Field(validation_alias=AliasChoices("env_path", "rollout_interaction_env_path")),
        Slime("`rollout_interaction_env_path:` at the top of the custom config"),
        Flag(aliases=("env",)),
    ] = "engine.envs.arith"
    """The env module (dotted path or .py file) exposing build_env, or a built-in env's short name (arith,
    python_tool, judge, geometry: engine/envs/builtin.py); `rollout_interaction_env_path` in YAML too."""
    agent_command: Annotated[str | None, FLAG] = None
    """An agent CLI's command line, run for each sample against its own session of the gateway (the built-in env
    agent_command, engine/envs/agent_command.py: `{prompt}` in it is the row's task, `{openai_base_url}` and the
    like its session's); given, the env is agent_command. Under slime: `agent_command:` at the top of the custom
    config, with `rollout_interaction_env_path: agent_command`."""
    agent_reward_command: Annotated[str | None, FLAG] = None
    """With agent_command: a command run after the agent in its directory (its output in $TURNSTILE_AGENT_OUTPUT),
    whose last printed line is the sample's reward; none: the env gives no reward (slime's reward path scores)."""
    env_workers: Annotated[NonNegativeInt, FLAG] = 0
    """Host the envs in this many Ray actors (env workers: processes stepping many envs each) instead of the
    rollout process's threads (0: in process, for one machine); see engine/envs/ray_workers.py."""
    env_worker_capacity: Annotated[PositiveInt, FLAG] = 16
    """Env calls one env worker runs at once (its threads); max_env_steps still bounds all env calls."""
    ray_address: Annotated[str | None, FLAG] = None
    """The Ray cluster env workers start in ("auto", or its host:port); none: the Ray this process is in
    (slime's job), else a running local one, else a new local one."""
    tokenizer: Annotated[str, Slime("`--hf-checkpoint`"), FLAG] = "qwen2.5"
    """A Hugging Face tokenizer directory, or the embedded Qwen tokenizer "qwen2.5"."""
    chat_template: Annotated[str | None, Only("run"), FLAG] = None
    """Jinja text, or a .jinja file, replacing the tokenizer's chat template."""
    chat_template_kwargs: Annotated[dict[str, Any], Slime("`--apply-chat-template-kwargs`")] = {}
    """Keyword arguments of the chat template (Qwen3's enable_thinking), for the prompt and every observation."""
    vision: Annotated[bool, FLAG] = False
    """A VLM: the Qwen2.5-VL processor, images in prompts and observations."""
    model_family: Annotated[str | None, AfterValidator(family_name), Slime("`--sglang-tool-call-parser`"), FLAG] = None
    """The model family, by SGLang's tool-call parser name: how a turn ends and how its tool calls are written and
    parsed (engine/families.py). The engine's own: qwen25, qwen3_coder, glm45, glm47, kimi_k2, gpt-oss,
    deepseekv31, llama3, mistral; any other of SGLang's 44 (minimax-m2, gemma4, ...) is read by SGLang itself on
    its servers (see turn_parser), and refused on the local backend. Unset: found from the chat template."""
    reasoning_parser: Annotated[
        str | None, AfterValidator(reasoning_parser_name), Slime("`--sglang-reasoning-parser`"), FLAG
    ] = None
    """SGLang's reasoning parser name; qwen3-thinking and deepseek-r1 say every turn starts inside the reasoning
    (its opening `<think>` is the prompt's), as SGLang reads them; unset: as the generation prompt says. One the
    engine does not read (nemotron_3, minimax-append-think, ...) is read by SGLang on its servers."""
    turn_parser: Annotated[Literal["auto", "sglang", "engine"], FLAG] = "auto"
    """Who reads a turn's content, reasoning and tool calls for the env. sglang: SGLang's own parsers, with
    model_family and reasoning_parser as their names, exactly as SGLang reads them (a malformed call is text
    there, not a named error): in this process where sglang is importable here (as in slime's image), else on
    the servers (POST /separate_reasoning, /parse_function_call); engine: the engine's own parsers; auto: SGLang's
    where the backend is SGLang and a parser named is one the engine does not have, else the engine's."""

    # -- backend --------------------------------------------------------------------------------------
    backend: Annotated[
        Literal["local", "sglang"] | None, Slime("`--sglang-router-ip` / `--sglang-router-port`"), FLAG
    ] = None
    """local (a model in this process) or sglang (SGLang servers, or an sglang-router, at url); unset:
    sglang when url is given, else local."""
    url: Annotated[str | None, Slime("`--sglang-router-ip` / `--sglang-router-port`"), FLAG] = None
    """SGLang server or sglang-router URL; several, comma-separated, form a pool."""
    routing: Annotated[Literal["affinity", "consistent_hash", "round_robin"], Only("run"), FLAG] = "affinity"
    """With several URLs: which server each request goes to (engine/backends/affinity.py). affinity keeps a
    trajectory on the server holding its prefix until that server is loaded past a margin, and places new ones
    on the server home to the fewest live trajectories, then by load; consistent_hash is sglang-router's session
    hashing; round_robin ignores sessions."""
    model: Annotated[str, FLAG] = "tiny-qwen2"
    """Local backend: a tiny model name or a saved model's directory (with vision, tiny-qwen2 means tiny-qwen2.5-vl)."""
    request_timeout_s: Annotated[float, Field(gt=0), Only("run")] = 600.0
    """SGLang backend: seconds a generate request may take."""
    max_batch_size: Annotated[PositiveInt, Only("run")] = 64
    """Local backend: requests batched into one forward pass, at most."""

    # -- logs -----------------------------------------------------------------------------------------
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Only("run"), FLAG] = "warning"
    """Level of the turn and trajectory events (structlog; JSON lines when not on a terminal)."""
    log_sample: Annotated[float, Field(gt=0, le=1), Only("run"), FLAG] = 1.0
    """Share of turn events written."""

    # -- slime --------------------------------------------------------------------------------------
    target_groups: Annotated[PositiveInt, Slime("`--rollout-batch-size`"), Only("slime")] = 2
    """Groups a step returns."""
    num_gpus: Annotated[NonNegativeInt | None, Slime("`--rollout-num-gpus`"), Only("slime")] = None
    """Rollout GPUs, dividing the per-GPU throughput metrics (none or 0: no per-GPU metrics)."""
    ray_actor: Annotated[str | None, Only("slime")] = None
    """Host the engine in this named, detached Ray actor (none: in slime's rollout process)."""
    shards: Annotated[PositiveInt, Only("slime")] = 1
    """Rollout shards: engines in Ray actors of their own (`<ray_actor>-shard-<i>`, default names
    turnstile-rollout-shard-<i>), each with its share of the groups, its envs and agent sessions, over the same
    servers, while slime's rollout process decides for all (bridge/shards.py); 1: one engine, as ray_actor says.
    Each shard's metrics_port and agent_port, where fixed, are the given one plus its index."""
    router_policy: Annotated[str | None, Slime("`--router-policy`"), Only("slime")] = None
    """The policy slime starts sglang-router with (none: the router's default, cache_aware)."""
    weights_dir: Annotated[str | None, Slime("`--update-weight-disk-dir`"), Only("slime")] = None
    """Local backend under slime (no SGLang engines, `--update-weight-transport disk`): the directory slime's
    trainer writes each weight version into, as `weight_vNNNNNN`; each step first loads the newest one not yet
    loaded, and generation goes on as version NNNNNN."""
    session_routing: Annotated[Literal["auto", "router", "workers"], Only("slime")] = "auto"
    """Behind slime's sglang-router, where generation goes. auto: through the router when its policy pins a
    trajectory's turns to one worker by the routing key Turnstile sends (consistent_hashing, manual), else to
    the workers the router lists at start, placed by Turnstile's affinity (a trajectory stays on the worker
    holding its prefix); router, workers: always that way."""

    def for_shard(self, index: int) -> Self:
        """Shard `index`'s settings: its ports, where fixed, offset by its index (shards may share a node), and
        its `shard` label on every series."""
        offset = lambda port: port + index if port else port  # noqa: E731 -- 0 and none stay as they are
        return self.model_copy(
            update={
                "metrics_port": offset(self.metrics_port),
                "agent_port": offset(self.agent_port),
                "metrics_labels": {**self.metrics_labels, "shard": str(index)},
            }
        )

    @model_validator(mode="before")
    @classmethod
    def _agent_command_env(cls, data: Any) -> Any:
        """`agent_command` runs the agent_command env: the env unless another was named (then one error)."""
        if not isinstance(data, Mapping) or not data.get("agent_command"):
            return data
        named = data.get("env_path", data.get("rollout_interaction_env_path"))
        if named is None:
            return {**data, "env_path": "agent_command"}
        if resolve_env_path(named) != resolve_env_path("agent_command"):
            raise ValueError(f"agent_command runs the agent_command env, but env_path names {named!r}: give one")
        return data

    @model_validator(mode="after")
    def _env_worker_knobs(self) -> Self:
        given = [name for name in ("env_worker_capacity", "ray_address") if getattr(self, name) != _default_of(name)]
        if given and not self.env_workers:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(f"{' and '.join(given)} {verb} to env workers only: set env_workers too")
        return self

    @model_validator(mode="after")
    def _parsers_where_they_run(self) -> Self:
        """A parser only SGLang has needs SGLang servers to read the turns; `turn_parser: sglang` needs a name."""
        only_sglang = self.sglang_only_parsers
        if only_sglang and (self.backend_kind != "sglang" or self.turn_parser == "engine"):
            where = "the local backend" if self.backend_kind != "sglang" else "turn_parser engine"
            raise ValueError(
                f"{' and '.join(only_sglang)}: read only by SGLang's own parsers, on SGLang servers (url, with "
                f"turn_parser auto or sglang), not by {where}; the engine's own families: {', '.join(NAMES)}"
            )
        if self.turn_parser == "sglang" and (self.backend_kind != "sglang" or not self.server_parsers):
            raise ValueError("turn_parser sglang: needs SGLang servers (url) and model_family or reasoning_parser")
        agents = {resolve_env_path(name) for name in ("python_agent", "agent_command")}
        if self.env_path in agents and self.server_parsers:  # an agent streams through the gateway: engine parsers
            raise ValueError(
                f"env {self.env_path}: its agent's replies are read by the engine's own parsers, as they stream, and "
                f"this run asks SGLang's ({' and '.join(n for n in self.server_parsers if n)}; turn_parser)"
            )
        return self

    @property
    def sglang_only_parsers(self) -> list[str]:
        """The parsers named that only SGLang reads, as `model_family X` / `reasoning_parser Y`."""
        named = []
        if self.model_family is not None and not has_family(self.model_family):
            named.append(f"model_family {self.model_family}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            named.append(f"reasoning_parser {self.reasoning_parser}")
        return named

    @property
    def server_parsers(self) -> tuple[str | None, str | None] | None:
        """SGLang's (tool-call, reasoning) parser names the servers read every turn with, or None where the
        engine's own parsers read them (turn_parser)."""
        names = (self.model_family, self.reasoning_parser)
        if self.backend_kind != "sglang" or self.turn_parser == "engine" or names == (None, None):
            return None
        if self.turn_parser == "sglang" or self.sglang_only_parsers:
            return names
        return None

    @property
    def calls_read_by_server(self) -> bool:
        """Whether SGLang's tool-call parser reads the model's calls on the servers (`server_parsers`)."""
        return self.server_parsers is not None and self.server_parsers[0] is not None

    def server_reader(self, backend: Any, tokenizer: Any = None) -> ServerReader | None:
        """What reads the turns with SGLang's parsers (`server_parsers`), for `RolloutEngine(reader=...)`: SGLang's
        parser classes in this process where `sglang` is importable here (given the served model's `tokenizer`),
        else `backend`'s servers."""
        names = self.server_parsers
        if names is None:
            return None
        return ServerReader(backend, *names, in_process=InProcessParsers.here(tokenizer, names))

    @model_validator(mode="after")
    def _backend_and_url(self) -> Self:
        if self.backend == "sglang" and not self.url:
            raise ValueError("backend kind 'sglang' needs a url (e.g. http://127.0.0.1:30000)")
        if self.backend == "local" and self.url:
            raise ValueError(f"url {self.url} is for the sglang backend, not the local one")
        for url in (self.url or "").split(","):
            if url.strip() and not url.strip().startswith(("http://", "https://")):
                raise ValueError(f"url {url.strip()!r}: give it as http://host:port (or https://)")
        return self

    @property
    def backend_kind(self) -> Literal["local", "sglang"]:
        return self.backend or ("sglang" if self.url else "local")

    @property
    def local_model(self) -> str:
        """The local backend's model: `model`, or the tiny VLM for a vision run on the tiny text model."""
        return "tiny-qwen2.5-vl" if self.vision and self.model == "tiny-qwen2" else self.model

    @property
    def turn_cap(self) -> int:
        if self.max_new_tokens is None and self.backend_kind == "local":
            return min(self.max_tokens, EMBEDDED_TURN_TOKENS)
        return super().turn_cap

    def engine_config(self, stop_token_ids: tuple[int, ...] = ()) -> EngineConfig:
        """The engine's part, the per-turn cap resolved; `stop_token_ids` (the chat template's end-of-turn
        ids) apply when no stop_token_ids are set."""
        values = {name: getattr(self, name) for name in EngineConfig.model_fields}
        values.update(
            max_new_tokens=self.turn_cap,
            stop_token_ids=self.stop_token_ids or tuple(stop_token_ids),
            max_inflight=max(self.max_inflight, self.n_samples_per_prompt),
        )
        return EngineConfig.model_validate(values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Self:
        """`turnstile run --config`: a YAML mapping of knobs, slime's flat key names included."""
        return cls.model_validate(read_yaml(path, cls, "run"))


def _default_of(name: str) -> Any:
    return Settings.model_fields[name].default


# -- reading keys -------------------------------------------------------------------------------------


def key_names(model: type[BaseModel]) -> dict[str, str]:
    """Every key a mapping may name a knob of `model` by (its name, and aliases), to the knob's name."""
    names = {}
    for name, field in model.model_fields.items():
        names[name] = name
        if isinstance(field.validation_alias, AliasChoices):
            names.update({alias: name for alias in field.validation_alias.choices if isinstance(alias, str)})
    return names


def refusal(
    model: type[BaseModel], key: str, reader: Reader, *, own: Collection[str] = (), is_top: bool = True
) -> str | None:
    """Why `reader` does not take `key` ("run": `turnstile run`'s YAML; "slime": the `turnstile:`
    section) of `model` (the top-level settings, or a knob's own mapping), or None when it does."""
    if is_top and key in MOVED:
        return f"now {MOVED[key]}"
    names = key_names(model)
    if key not in names:
        close = difflib.get_close_matches(key, [*names, *own], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"not a setting{hint}; docs/settings.md lists them"
    field = model.model_fields[names[key]]
    only, slime = marker(field, Only), marker(field, Slime)
    if only is not None and only.reader != reader:
        return "read by `turnstile run` only" if only.reader == "run" else "read under slime only"
    if reader == "slime" and slime is not None and not slime.fills:
        return f"set by slime's {slime.source}; set that instead"
    return None


def read_yaml(path: str | Path, model: type[BaseModel], reader: Reader, *, own: Collection[str] = ()) -> dict[str, Any]:
    """The mapping in the YAML file at `path`, each key checked (`refusal`) but those in `own` (options of
    the reader's own, not knobs); values are checked when the model is built."""
    return checked(load_yaml(path) or {}, model, reader, where=str(path), key_prefix=f"{path}: ", own=own)


def load_yaml(path: str | Path) -> Any:
    """The document in the YAML file at `path`; a ValueError naming the file, line and column if it is not YAML."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ValueError(f"{path}: not valid YAML{where}: {why}") from exc


def checked(
    data: Any,
    model: type[BaseModel],
    reader: Reader,
    *,
    where: str,
    key_prefix: str,
    own: Collection[str] = (),
    is_top: bool = True,
) -> dict[str, Any]:
    """`data` as a dict of knobs of `model`, or one ValueError naming the first key `reader` refuses
    (as `key_prefix` + the key, `retry.per_turn` for a nested one) and why."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of settings, got {type(data).__name__}")
    for key, value in data.items():
        if key in own:
            continue
        why = refusal(model, str(key), reader, own=own, is_top=is_top)
        if why is not None:
            raise ValueError(f"{key_prefix}{key}: {why}")
        nested = _model_of(model.model_fields[key_names(model)[str(key)]].annotation)
        if nested is not None and isinstance(value, Mapping):
            checked(value, nested, reader, where=where, key_prefix=f"{key_prefix}{key}.", is_top=False)
    return dict(data)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The settings model a knob's value is a mapping of (`retry`: RetryPolicy), or None."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def problems(exc: ValidationError, name: Callable[[str], str] = str) -> str:
    """`exc` as one line, `key: why (given value)` per problem; `name` says where a knob's value came from
    (the key's first part is the knob)."""
    lines = []
    for error in exc.errors():
        knob, *rest = [str(part) for part in error["loc"]] or [""]
        why = error["msg"].removeprefix("Value error, ")
        key = ".".join([name(knob), *rest]) if knob else ""
        lines.append(f"{key}: {why} (given {error['input']!r})" if key else why)
    return "; ".join(lines)


# -- the table of docs/settings.md --------------------------------------------------------------------


def _default(value: Any) -> str:
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, Mapping):
        return ", ".join(f"{getattr(k, 'value', k)}: {v}" for k, v in value.items()) or "{}"
    if isinstance(value, tuple):
        return "()" if not value else ", ".join(map(str, value))
    return "none" if value is None else json.dumps(value) if isinstance(value, bool) else str(value)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _run_column(name: str, flag: Flag | None) -> str:
    """How `turnstile run` sets a knob: its flags (aliases first), and YAML."""
    if flag is None:
        return "YAML"
    return ", ".join(f"`{_flag(alias)}`" for alias in (*flag.aliases, name)) + ", YAML"


def _rows() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for name, field in Settings.model_fields.items():
        if name == "retry":
            for sub, inner in RetryPolicy.model_fields.items():
                default = inner.default_factory() if inner.default_factory else inner.default  # type: ignore[call-arg]
                flag = f"`--{RETRY_FLAGS[sub]}`, YAML" if sub in RETRY_FLAGS else "YAML"
                rows.append((f"retry.{sub}", _default(default), flag, f"`turnstile.retry.{sub}`", inner.description))
            continue
        only, slime = marker(field, Only), marker(field, Slime)
        run = "—" if only and only.reader == "slime" else _run_column(name, marker(field, Flag))
        if only and only.reader == "run":
            under = "—"
        elif slime is not None and slime.fills:
            under = f"`turnstile.{name}`; unset: {slime.source}"
        elif slime is not None:
            under = slime.source
        else:
            under = f"`turnstile.{name}`"
        rows.append((name, _default(field.default), run, under, field.description or ""))
    return rows


def markdown_table() -> str:
    """Every knob as a GitHub markdown table: name, default, how `turnstile run` and slime set it, description."""
    lines = ["| setting | default | `turnstile run` | under slime | description |", "|---|---|---|---|---|"]
    for name, default, run, under, description in _rows():
        text = " ".join(description.split()).replace("|", "\\|")
        lines.append(f"| `{name}` | `{default}` | {run} | {under} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
