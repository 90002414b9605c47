"""The run `example/geo3k`: examples/geo3k_vlm_multi_turn as written, on slime's own code.

slime's flags are read from the example's `run.sh` itself: its `ROLLOUT_ARGS` and `GRPO_ARGS` arrays, expanded
by bash (comments, quoting and `$DATA` / `$TURNSTILE_DIR` as bash reads them), with `DATA` set to the script's
geo3k-shaped parquet (run.sh's own variable). Only the scale is overridden, each override printed with its
reason; the other arrays are Megatron's and SGLang's GPU flags (MODEL_ARGS, CKPT_ARGS's `--load`,
OPTIMIZER_ARGS, SGLANG_ARGS, BACKEND_ARGS), which no function run here reads. `--custom-config-path` is the
example's `turnstile.yaml`, as written, unless something in it cannot work on this machine (then a copy with
only those keys changed, each printed with its reason): `ray_actor` is kept when a local `ray.init()` works
(Ray is started here as run.sh's `ray start` + `ray job submit` would, PYTHONPATH the slime checkout and
Turnstile; the actor is shut down after), `metrics_port` / `metrics_host` when the port is free.

Besides the checks every run gets (checks.py), this run checks partial rollout across its steps (the groups
held after a step are returned by a later one, started in the earlier step, none lost), the named Ray actor,
and the Prometheus endpoint the YAML asks for.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.slime_train_path.common import problem_of

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/geo3k_vlm_multi_turn"
RUN_SH = EXAMPLE / "run.sh"
YAML = EXAMPLE / "turnstile.yaml"
ARRAYS = ("ROLLOUT_ARGS", "GRPO_ARGS")  # run.sh's arrays of slime flags the rollout path reads
NAME = "example/geo3k"
STEPS = 3  # partial rollout: groups held after step 0 and step 1 are returned by the next


def bash_array(script: Path, name: str, env: dict[str, str]) -> list[str]:
    """`"${NAME[@]}"` as bash expands the array's assignment in `script` (only that assignment is run)."""
    match = re.search(rf"^{name}=\(\n.*?^\)\s*$", script.read_text(), re.S | re.M)
    if match is None:
        raise ValueError(f"no {name}=( ... ) array in {script}")
    done = subprocess.run(
        ["bash", "-c", f'set -euo pipefail; eval "$1"; printf "%s\\0" "${{{name}[@]}}"', "bash", match.group()],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ValueError(f"bash could not expand {name} from {script}: {done.stderr.strip()}")
    return done.stdout.split("\0")[:-1]


def settings_of(argv: list[str]) -> dict[str, Any]:
    """slime flags -> the settings dict slime_args.to_argv turns back into the same flags."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            raise ValueError(f"{flag!r} in run.sh's arrays is not a --flag or its value")
        values, i = [], i + 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(_value(argv[i]))
            i += 1
        out[flag[2:].replace("-", "_")] = True if not values else values[0] if len(values) == 1 else values
    return out


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1] in "{[":
        return json.loads(text)
    return text


def port_free(host: str, port: int) -> bool:
    """Whether the exporter could bind host:port: as prometheus_client's HTTP server does, with SO_REUSEADDR
    (a port left in TIME_WAIT by an earlier scrape is free; one something listens on is not)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Example:
    """What the run took from the example's files and what it changed, and the Ray it started."""

    argv: list[str]  # run.sh's arrays as bash expands them
    settings: dict[str, Any]  # with the overrides
    overrides: list[str]  # "--flag old -> new: why"
    kept: list[str]  # notable flags kept as written, and why they do no harm at this scale
    yaml_path: Path
    yaml_overrides: list[str] = field(default_factory=list)
    ray: Any = None  # the ray module when this run started a local Ray instance

    def note(self) -> str:
        return (
            f"slime flags from {RUN_SH.relative_to(REPO)} ({' + '.join(ARRAYS)}: {len(self.argv)} tokens, "
            f"expanded by bash); scale overridden: {'; '.join(self.overrides)}; kept as written: "
            f"{'; '.join(self.kept)}; --custom-config-path {self.yaml_path}"
            + (f" (overrides: {'; '.join(self.yaml_overrides)})" if self.yaml_overrides else " (as written)")
        )


def prepare(root: Path, tmp: Path, parquet: Path, hf: Path, rollout_function_path: str, steps: int) -> Example:
    """The run's settings from the example's files; starts a local Ray instance for `ray_actor` when one can."""
    import yaml

    env = {"DATA": str(parquet), "TURNSTILE_DIR": str(REPO)}
    argv = [token for name in ARRAYS for token in bash_array(RUN_SH, name, env)]
    settings = settings_of(argv)
    from scripts.slime_train_path.slime_args import to_argv

    if settings_of(to_argv(settings)) != settings:  # nothing of run.sh lost on the way to slime's parser
        raise ValueError(f"run.sh's flags do not round-trip: {argv} vs {to_argv(settings)}")
    overrides, kept = [], []
    import pyarrow.parquet as pq

    rows = pq.read_metadata(parquet).num_rows

    def override(key: str, value: Any, why: str) -> None:
        old = settings.get(key, "(not set)")
        settings[key] = value
        overrides.append(f"--{key.replace('_', '-')} {old} -> {value}: {why}")

    n = settings["n_samples_per_prompt"]
    rollout_batch = 2
    config = yaml.safe_load(YAML.read_text())
    over = (config.get("turnstile") or {}).get("over_sampling") or 1.0
    new_groups = math.ceil(rollout_batch * over) + (steps - 1) * rollout_batch
    override(
        "rollout_batch_size",
        rollout_batch,
        f"{rows} prompt rows; {steps} steps at turnstile.yaml's over_sampling {over} take "
        f"{new_groups} groups (a step returns {rollout_batch}, the rest carry over)",
    )
    override(
        "global_batch_size",
        rollout_batch * n,
        f"rollout_batch_size x n_samples_per_prompt {n}, as run.sh's 64 x 8 = 512 (one optimizer step per rollout)",
    )
    if settings.get("prompt_data") != str(parquet):
        raise ValueError(f"run.sh's --prompt-data is {settings.get('prompt_data')!r}, not its $DATA ({parquet})")
    overrides.append(
        f"--prompt-data (DATA) -> {parquet.name}: the script's {rows} geo3k-shaped rows (problem, answer, images)"
    )
    settings["hf_checkpoint"] = str(hf)
    overrides.append(
        f"--hf-checkpoint (MODEL, in CKPT_ARGS) -> {hf.name}: the tiny Qwen2.5-VL and its processor "
        "(Qwen3.5-35B-A3B needs GPUs; CKPT_ARGS's --load is Megatron's and is not read here)"
    )
    if settings.get("rollout_function_path") != rollout_function_path:
        override("rollout_function_path", rollout_function_path, "given to this script (--rollout-function-path)")
    kept.append(
        f"--n-samples-per-prompt {n}, --rollout-max-response-len {settings.get('rollout_max_response_len')} "
        "(the scripted server's replies are short; nothing here scales with them)"
    )
    kept.append(
        f"--over-sampling-batch-size {settings.get('over_sampling_batch_size')} (slime only asserts it >= "
        f"rollout_batch_size; turnstile.yaml's over_sampling {over} wins in the bridge)"
    )
    kept.append(f"--num-rollout {settings.get('num_rollout')} (train.py's loop; this script runs {steps} steps)")

    example = Example(argv, settings, overrides, kept, YAML)
    changes: dict[str, Any] = {}
    section = dict(config.get("turnstile") or {})
    if section.get("ray_actor"):
        ray, why = start_ray(root)
        if ray is None:
            changes["ray_actor"] = (None, f"a Ray cluster is needed and a local ray.init() did not work here: {why}")
        else:
            example.ray = ray
    port, host = section.get("metrics_port"), section.get("metrics_host", "127.0.0.1")
    if port is not None and not port_free(host, int(port)):
        changes["metrics_port"] = (0, f"{host}:{port} is in use on this machine (0: any free port)")
    if changes:
        for key, (value, why) in changes.items():
            example.yaml_overrides.append(f"turnstile.{key} {section.get(key)} -> {value}: {why}")
            section[key] = value
        example.yaml_path = tmp / "turnstile.yaml"
        example.yaml_path.write_text(yaml.safe_dump({**config, "turnstile": section}, sort_keys=False))
        settings["custom_config_path"] = str(example.yaml_path)
    return example


def start_ray(root: Path) -> tuple[Any, str]:
    """A local Ray instance, as run.sh's `ray start --head` and `ray job submit --runtime-env-json` give
    train.py (PYTHONPATH: the slime checkout, Turnstile). (ray, "") or (None, why not)."""
    from scripts.slime_train_path import stubs

    if any(module == "ray" for module, _ in stubs.MADE):
        return None, "Ray is not installed (the script stubs it)"
    try:
        import ray

        if ray.is_initialized():
            return ray, ""
        ray.init(
            address="local",  # a fresh instance of this run's own, never a cluster found on the machine
            namespace="turnstile",
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": f"{root}:{REPO}"}},
            log_to_driver=False,
        )
        return ray, ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def service_of(run: Any) -> Any:
    from bridge.slime import SERVICE_ATTRIBUTE

    return getattr(run.args, SERVICE_ATTRIBUTE, None)


class PartialRolloutChecks:
    """With --partial-rollout: which groups each step leaves held in the rollout service, and that a later
    step returns them (started in the earlier step, so carried over, not re-queued), none lost. With the
    scripted server holding one group's later turns (double.py), that group is paused mid-episode at the
    step's end, its requests aborted, and finishes in the next step."""

    def __init__(self, report: Any, run: Any):
        self.report, self.run = report, run
        self.held: list[list[Any]] = []  # group_index held after each step
        self.carried = 0
        self.paused_carried = 0

    def ok(self, name: str, ok: bool, detail: str) -> bool:
        return self.report.check(self.run.name, name, ok, detail)

    def after_step(self, step: int) -> None:
        run, args = self.run, self.run.args
        service = service_of(run)
        server = run.server if getattr(run.server, "hold_one_group", False) else None
        returned = run.step_groups[-1] if run.step_groups else []
        try:
            held = list(service.held_prompts())
            status = service.status()
        except Exception as exc:
            self.report.error(run.name, f"step {step}: the rollout service's held groups", exc)
            return
        self.held.append(held)
        in_flight = math.ceil(args.rollout_batch_size * service.settings.over_sampling)
        paused_ok, paused = True, ""
        if server is not None:  # the one group the server held: open, all its trajectories paused
            n = args.n_samples_per_prompt
            paused_ok = (status.get("groups_open"), status.get("trajectories_inflight")) == (1, n)
            paused = (
                f"; the server held {server.held_problems[-1] if server.held_problems else None}'s later turns "
                f"({dict(server.aborted)} aborted so far): groups open {status.get('groups_open')}, done "
                f"{status.get('groups_done')}, trajectories in flight (paused) {status.get('trajectories_inflight')} "
                f"of {n}"
            )
        self.ok(
            f"step {step}: partial rollout holds the groups it did not return",
            len(held) == in_flight - len(returned)
            and not set(held) & {i for r in run.step_groups for i in r}
            and paused_ok,
            f"returned {returned}, held {held} (in flight {in_flight} = rollout_batch_size {args.rollout_batch_size} "
            f"x over_sampling {service.settings.over_sampling}){paused}",
        )
        if step == 0:
            return
        before = self.held[-2]
        back = [i for i in before if i in returned]
        lost = [i for i in before if i not in returned and i not in held]
        samples = run.step_samples[-1] if run.step_samples else []
        started = {x.group_index: (x.metadata or {}).get("start_rollout_id") for x in samples}
        problems = {x.group_index: problem_of(x) for x in samples}
        early = [i for i in back if started.get(i) is not None and started[i] < step]
        self.carried += len(early)
        was_paused = [i for i in back if server is not None and problems.get(i) in server.held_problems[:step]]
        self.paused_carried += len(was_paused)
        self.ok(
            f"step {step}: groups held after step {step - 1} carried over",
            not lost and len(early) == len(back) and (server is None or was_paused == back),
            f"held after step {step - 1}: {before}; returned now: {back} (start_rollout_id "
            f"{ {i: started.get(i) for i in back} }, problems { {i: problems.get(i) for i in back} }, paused "
            f"mid-episode by the server: {was_paused}), still held: {[i for i in before if i in held]}; "
            f"lost: {lost or 'none'}",
        )

    def finish(self) -> None:
        paused = self.run.server is not None and getattr(self.run.server, "hold_one_group", False)
        self.ok(
            "partial rollout: held groups returned by a later step",
            self.carried > 0 and (not paused or self.paused_carried > 0),
            f"{self.carried} group(s) started in one step and returned by a later one over {len(self.held)} "
            f"steps, {self.paused_carried} of them paused mid-episode in between (their requests aborted at the "
            "step's end, the trajectories resumed in the next)",
        )


def final_checks(run: Any, report: Any, example: Example) -> None:
    """The YAML's Ray actor and Prometheus endpoint, while the service is still up."""
    service = service_of(run)
    if service is None:
        report.check(run.name, "the rollout service", False, "no service on args after the steps")
        return
    section = getattr(run.args, "turnstile", None) or {}
    if section.get("ray_actor"):
        try:
            actor = example.ray.get_actor(section["ray_actor"], namespace="turnstile")
            report.check(
                run.name,
                "turnstile.ray_actor: the service is the named, detached Ray actor",
                type(service).__name__ == "RayService" and actor is not None,
                f"{type(service).__module__}.{type(service).__name__}; ray.get_actor({section['ray_actor']!r}, "
                f"namespace='turnstile') -> {type(actor).__name__}",
            )
        except Exception as exc:
            report.error(run.name, "turnstile.ray_actor: the named Ray actor", exc)
    if section.get("metrics_port") is not None:
        try:
            url = service.status()["metrics_url"]
            local = re.sub(r"//0\.0\.0\.0:", "//127.0.0.1:", url)
            with urllib.request.urlopen(local, timeout=10) as reply:
                text = reply.read().decode()
            names = sorted({line.split()[2] for line in text.splitlines() if line.startswith("# TYPE turnstile_")})
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            value = {
                line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith("turnstile_")
            }
            paused, resumed = (value.get(f"turnstile_trajectories_{k}_total") for k in ("paused", "resumed"))
            held_open = value.get('turnstile_groups_held{group_state="open"}')
            report.check(
                run.name,
                "turnstile.metrics_port: Prometheus /metrics while the service runs",
                bool(names) and section["metrics_port"] in (0, port) and (paused or 0) >= (resumed or 0) > 0,
                f"{url} (scraped at {local}): {len(names)} turnstile_* families; trajectories paused {paused}, "
                f"resumed {resumed}, groups held open {held_open}",
            )
            named = sorted(set(re.findall(r"\bturnstile_[a-z_]+", (EXAMPLE / "README.md").read_text())))
            served = {n.removesuffix("_total") for n in names} | set(names)
            missing = [n for n in named if n not in served and n.removesuffix("_total") not in served]
            report.check(
                run.name,
                "the example's README: the metrics it names are served",
                not missing,
                f"named {named}; not served: {missing or 'none'}",
            )
        except Exception as exc:
            report.error(run.name, "turnstile.metrics_port: Prometheus /metrics", exc)
    keys = sorted({k for m in run.step_metrics for k in m})
    multi_turn = [k for k in keys if k.startswith("multi_turn/")]
    prefixes = ("rollout/", "perf/", "multi_turn/")
    report.check(
        run.name,
        "the example's README: rollout/*, perf/* and multi_turn/* in the step's metrics",
        all(any(k.startswith(p) for k in keys) for p in prefixes),
        "; ".join(f"{p}* {sum(k.startswith(p) for k in keys)}" for p in prefixes)
        + f" (of {len(keys)} keys the rollout function returned, e.g. {multi_turn[:3]})",
    )


def teardown(run: Any, example: Example) -> str:
    """Shut the service (and the Ray actor) down, then the local Ray instance this run started."""
    from scripts.slime_train_path.common import call_with_timeout

    done = []
    service = service_of(run) if run.args is not None else None
    if service is not None and run.hung:
        done.append(f"{type(service).__name__} left as it is (a rollout call hung)")
    elif service is not None:
        try:
            call_with_timeout(service.shutdown, timeout=60)
            done.append(f"{type(service).__name__} shut down")
        except Exception as exc:
            done.append(f"shutdown failed: {type(exc).__name__}: {exc}")
    if example.ray is not None:
        example.ray.shutdown()
        done.append("local Ray instance stopped")
    return "; ".join(done) or "nothing to shut down"
