"""deploy/: the Prometheus config and alert rules pass promtool, each alert fires on the series it is
meant for and stays quiet on healthy ones, and the alerts and the Grafana dashboard name only series
and labels the exporter really exposes, the dashboard showing every family."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx2
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.errors import ErrorClass
from engine.metrics import prometheus as exporter_module
from engine.scheduler.scheduler import Phase
from engine.trajectory import Status, StopReason
from tests.conftest import REPO
from tests.fakes import DeterministicBackend
from tests.test_engine import config, env_factory, rows

DEPLOY = REPO / "deploy"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
PROMETHEUS_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
# Label values the alerts and the dashboard may select on, from the enums the exporter takes them from.
LABEL_VALUES = {
    "status": {str(s) for s in Status},
    "stop_reason": {str(r) for r in StopReason},
    "outcome": {"continued"} | {str(r) for r in StopReason},
    "error_class": {str(c) for c in ErrorClass},
    "stage": {exporter_module.stage_of(c) for c in ErrorClass},
    "state": {str(p) for p in Phase} | {"open", "done"},
    "limiter": {"generation", "env"},
    "result": {"exact", "drift"},
}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found: install Debian's `prometheus` package "
            "(apt-get install --no-install-recommends prometheus); CI's .ci/run installs it"
        )
    return path


def run_promtool(*args: str | Path) -> str:
    result = subprocess.run([promtool(), *map(str, args)], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{output}"
    return output


def load_rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def load_dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "turnstile.json").read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return panels


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", []) if t.get("expr")]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        exprs.append(query.get("query", "") if isinstance(query, dict) else query or "")
    return exprs


# -- what the exporter exposes ---------------------------------------------------------------------


@dataclass
class Family:
    kind: str  # counter, gauge, histogram
    labels: set[str] = field(default_factory=set)

    def sample_names(self, name: str) -> set[str]:
        return {name + suffix for suffix in SUFFIXES[self.kind]}


def declared_families() -> dict[str, Family]:
    """The families engine/metrics/prometheus.py declares: its _counter/_gauge/_histogram calls."""
    kinds = {"_counter": "counter", "_gauge": "gauge", "_histogram": "histogram"}
    families = {}
    for node in ast.walk(ast.parse(Path(exporter_module.__file__).read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in kinds:
            name = node.args[0]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue  # the helpers' own bodies
            labels = set()
            if len(node.args) > 3 and isinstance(node.args[3], ast.Tuple):
                labels = {e.value for e in node.args[3].elts if isinstance(e, ast.Constant)}
            families[exporter_module.PREFIX + name.value] = Family(kinds[node.func.id], labels)
    return families


async def scrape_a_run(tokenizer) -> str:
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=ChatEncoder(tokenizer),
        env_factory=env_factory(),
        source=rows(2),
        config=config(metrics_port=0, drift_check_every=1),
    ) as engine:
        await engine.rollout(2)
        async with httpx2.AsyncClient() as client:
            response = await client.get(engine.exporter.url)
    response.raise_for_status()
    return response.text


async def scrape_a_gateway(tokenizer) -> str:
    """The session gateway's /metrics after a request with a sampling field, a fork and a bad request."""
    from tests.gateway_kit import PROMPT, gateway_over, sampled

    encoder = ChatEncoder(tokenizer)
    gateway, _ = gateway_over(
        encoder, [sampled(encoder, "Sunny."), sampled(encoder, "Rainy."), sampled(encoder, "Hi.")]
    )
    async with gateway.serving(), httpx2.AsyncClient(base_url=gateway.url, timeout=60) as client:
        session = gateway.open_session()
        client.headers["x-api-key"] = session.key
        chat = f"/sessions/{session.id}/v1/chat/completions"
        for body in (
            {"messages": PROMPT, "temperature": 0.5},
            {"messages": [{"role": "system", "content": "Be brief."}, PROMPT[1]]},  # a fork
            {"messages": PROMPT, "n": 2},  # a bad request
        ):
            await client.post(chat, json={"model": "policy", **body})
        hosted = {"model": "policy", "input": "Hi", "tools": [{"type": "web_search"}]}  # left out, counted
        await client.post(f"/sessions/{session.id}/v1/responses", json=hosted)
        response = await client.get("/metrics")
        await gateway.finish(session.id)
    response.raise_for_status()
    return response.text


@pytest.fixture(scope="module")
def families(tokenizer) -> dict[str, Family]:
    """Family name -> kind and labels: what a small run's and a gateway's /metrics show, plus what the exporter
    declares."""
    families = declared_families()
    scraped = anyio.run(scrape_a_run, tokenizer) + anyio.run(scrape_a_gateway, tokenizer)
    for parsed in text_string_to_metric_families(scraped):
        family = families.setdefault(parsed.name, Family(parsed.type))
        assert family.kind == parsed.type, parsed.name
        family.labels |= {k for s in parsed.samples for k in s.labels if k != "le"}
    assert len(families) > 30 and all(name.startswith("turnstile_") for name in families)
    return families


def referenced(exprs: list[str], families: dict[str, Family]) -> dict[str, set[str]]:
    """Family name -> the sample names the expressions use of it; unknown names map from None."""
    by_sample = {sample: name for name, f in families.items() for sample in f.sample_names(name)}
    used: dict[str, set[str]] = {}
    for expr in exprs:
        for sample in re.findall(r"\bturnstile_\w+", expr):
            used.setdefault(by_sample.get(sample), set()).add(sample)
    return used


def check_labels(expr: str, families: dict[str, Family]) -> list[str]:
    """Problems with the labels `expr` selects or groups on."""
    problems = []
    known = set().union(*(f.labels for f in families.values())) | PROMETHEUS_LABELS | {"le"}
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        problems += [
            f"groups on unknown label {x!r}" for x in map(str.strip, clause.split(",")) if x and x not in known
        ]
    for sample, matchers in re.findall(r"\b(turnstile_\w+)\{([^}]*)\}", expr):
        name = next(n for n, f in families.items() if sample in f.sample_names(n))
        allowed = families[name].labels | PROMETHEUS_LABELS | ({"le"} if sample.endswith("_bucket") else set())
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
            if label not in allowed:
                problems.append(f"{sample} has no label {label!r}")
            elif label in LABEL_VALUES and "$" not in value:
                unknown = set(value.split("|") if "~" in op else [value]) - LABEL_VALUES[label]
                problems += [f"{sample}: {label} is never {v!r}" for v in sorted(unknown)]
    return problems


# -- promtool ---------------------------------------------------------------------------------------


def test_promtool_accepts_the_rules_and_the_config():
    assert "SUCCESS" in run_promtool("check", "rules", DEPLOY / "alerts.yml")
    output = run_promtool("check", "config", DEPLOY / "prometheus.yml")  # rule_files resolve next to it
    assert "1 rule files found" in output


def test_the_config_scrapes_turnstile_and_loads_the_alerts():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "turnstile"]
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
    assert config["rule_files"] == ["alerts.yml"]


def test_every_alert_says_what_to_look_at():
    rules = load_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, rule["alert"]


# Each alert: input series at a 1m interval, an evaluation time, and the instances it fires for there
# (with their labels beyond job, instance and severity); it must not fire for the other instances
# ("ok" and the like), nor for any at 0m.
def series(name: str, instance: str, values: str, **labels: str) -> dict:
    text = ", ".join(f'{k}="{v}"' for k, v in {"job": "turnstile", "instance": instance, **labels}.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def buckets(name: str, instance: str, per_minute: dict[str, int]) -> list[dict]:
    """A histogram's cumulative buckets, each growing by its count every minute."""
    return [series(f"{name}_bucket", instance, f"0+{n}x40", le=le) for le, n in per_minute.items()]


FINISHED = "turnstile_trajectories_finished_total"
SCENARIOS = {
    "TurnstileExporterDown": ([series("up", "bad", "1 1 0x10"), series("up", "ok", "1x12")], "8m", ["bad"]),
    "TurnstileTrajectoryFailureRateHigh": (
        [
            series(FINISHED, "bad", "0+10x40", status="completed", stop_reason="env_done"),
            series(FINISHED, "bad", "0+5x40", status="failed", stop_reason="backend_error"),
            series(FINISHED, "ok", "0+50x40", status="completed", stop_reason="env_done"),
            series(FINISHED, "ok", "0+1x40", status="failed", stop_reason="env_error"),
        ],
        "30m",
        ["bad"],
    ),
    "TurnstileRetryRateHigh": (
        [
            series("turnstile_retries_total", "bad", "0+5x40", error_class="timeout", stage="backend"),
            series("turnstile_turns_total", "bad", "0+10x40", outcome="continued"),
            series("turnstile_retries_total", "ok", "0+1x40", error_class="timeout", stage="backend"),
            series("turnstile_turns_total", "ok", "0+10x40", outcome="continued"),
        ],
        "30m",
        ["bad"],
    ),
    "TurnstileRetryBudgetsExhausted": (
        [
            series("turnstile_retry_budgets_exhausted_total", "bad", "0+1x40", error_class="env_timeout", stage="env"),
            series("turnstile_retry_budgets_exhausted_total", "ok", "0+0.1x40", error_class="server", stage="backend"),
        ],
        "20m",
        [{"instance": "bad", "error_class": "env_timeout", "stage": "env"}],
    ),
    "TurnstileBreakerOpen": (
        [series("turnstile_breaker_open", "bad", "0 0 1x10"), series("turnstile_breaker_open", "ok", "0 0 1 0x9")],
        "8m",
        ["bad"],
    ),
    "TurnstileBreakerFlapping": (
        [
            series("turnstile_breaker_opened_total", "bad", "0+1x40"),
            series("turnstile_breaker_opened_total", "ok", "0x5 1x35"),
        ],
        "30m",
        ["bad"],
    ),
    "TurnstileTrajectoriesStuck": (
        [
            # bad: turns stop ending at 10m; nothing ended: no turn ever ended
            series("turnstile_trajectories_inflight", "bad", "5x60", state="generating"),
            series("turnstile_turns_total", "bad", "0+1x10 10x50", outcome="continued"),
            series("turnstile_generation_paused", "bad", "0x60"),
            series("turnstile_trajectories_inflight", "nothing_ended", "5x60", state="in_env"),
            series("turnstile_generation_paused", "nothing_ended", "0x60"),
            # paused: no turns end either, but generation is paused (a weight update)
            series("turnstile_trajectories_inflight", "paused", "5x60", state="waiting_to_generate"),
            series("turnstile_turns_total", "paused", "0+1x10 10x50", outcome="continued"),
            series("turnstile_generation_paused", "paused", "0x10 1x50"),
            # idle: nothing in flight (between runs), parked trajectories do not count
            series("turnstile_trajectories_inflight", "idle", "0x60", state="generating"),
            series("turnstile_trajectories_inflight", "idle", "3x60", state="paused"),
            series("turnstile_turns_total", "idle", "0+1x10 10x50", outcome="continued"),
            series("turnstile_generation_paused", "idle", "0x60"),
            series("turnstile_trajectories_inflight", "ok", "5x60", state="generating"),
            series("turnstile_turns_total", "ok", "0+1x60", outcome="continued"),
            series("turnstile_generation_paused", "ok", "0x60"),
        ],
        "50m",
        ["bad", "nothing_ended"],
    ),
    "TurnstileTrajectoryHung": (
        [
            series("turnstile_longest_in_state_seconds", "bad", "0+60x60", state="generating"),
            series("turnstile_longest_in_state_seconds", "bad", "5x60", state="in_env"),
            series("turnstile_longest_in_state_seconds", "paused", "0+60x60", state="paused"),
            series("turnstile_longest_in_state_seconds", "ok", "5x60", state="generating"),
        ],
        "45m",
        [{"instance": "bad", "state": "generating"}],
    ),
    "TurnstileGenerationPausedTooLong": (
        [
            series("turnstile_generation_paused", "bad", "1x90"),
            series("turnstile_generation_paused", "ok", "0 1x30 0x59"),
        ],
        "80m",
        ["bad"],
    ),
    "TurnstileStaleTokensOverBound": (
        [
            series("turnstile_trained_tokens_total", "bad", "0+100x60"),
            series("turnstile_trained_tokens_over_staleness_bound_total", "bad", "0+10x60"),
            series("turnstile_trained_tokens_total", "ok", "0+100x60"),
            series("turnstile_trained_tokens_over_staleness_bound_total", "ok", "0+1x60"),
        ],
        "40m",
        ["bad"],
    ),
    "TurnstileDiscardedTokensHigh": (
        [
            series("turnstile_discarded_tokens_total", "bad", "0+50x60"),
            series("turnstile_generated_tokens_total", "bad", "0+100x60"),
            series("turnstile_discarded_tokens_total", "ok", "0+10x60"),
            series("turnstile_generated_tokens_total", "ok", "0+100x60"),
        ],
        "40m",
        ["bad"],
    ),
    "TurnstileEnvQueueSlow": (
        [
            *buckets("turnstile_turn_env_queue_seconds", "bad", {"5": 0, "10": 0, "30": 10, "+Inf": 10}),
            *buckets("turnstile_turn_env_queue_seconds", "ok", {"5": 10, "10": 10, "30": 10, "+Inf": 10}),
        ],
        "30m",
        ["bad"],
    ),
    "TurnstileGenerationQueueSlow": (
        [
            *buckets("turnstile_turn_generation_queue_seconds", "bad", {"1": 0, "60": 0, "120": 10, "+Inf": 10}),
            *buckets("turnstile_turn_generation_queue_seconds", "ok", {"1": 10, "60": 10, "120": 10, "+Inf": 10}),
        ],
        "30m",
        ["bad"],
    ),
    "TurnstileMostGroupsFiltered": (
        [
            series("turnstile_groups_filtered_total", "bad", "0+3x90", reason="zero_std"),
            series("turnstile_groups_emitted_total", "bad", "0+1x90"),
            series("turnstile_groups_filtered_total", "ok", "0+1x90", reason="zero_std"),
            series("turnstile_groups_emitted_total", "ok", "0+3x90"),
        ],
        "70m",
        ["bad"],
    ),
    "TurnstileTrajectoriesHitLimits": (
        [
            series(FINISHED, "bad", "0+6x90", status="truncated", stop_reason="length"),
            series(FINISHED, "bad", "0+4x90", status="completed", stop_reason="env_done"),
            series(FINISHED, "ok", "0+1x90", status="completed", stop_reason="max_turns"),
            series(FINISHED, "ok", "0+9x90", status="completed", stop_reason="env_done"),
        ],
        "70m",
        ["bad"],
    ),
    "TurnstileTokenizationDrift": (
        [
            series("turnstile_drift_checks_total", "bad", "0x3 1x20", result="drift"),
            series("turnstile_drift_checks_total", "bad", "0+1x23", result="exact"),
            series("turnstile_drift_checks_total", "ok", "0+1x23", result="exact"),
        ],
        "10m",
        ["bad"],
    ),
}


def test_each_alert_fires_on_its_series_and_not_on_healthy_ones(tmp_path):
    rules = {rule["alert"]: rule for rule in load_rules()}
    assert set(SCENARIOS) == set(rules), "every alert needs a scenario here"
    quiet = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    for group in quiet["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")  # promtool compares annotations verbatim; the labels are what we test
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(quiet))
    tests = []
    for name, (input_series, eval_time, firing) in SCENARIOS.items():
        base = {"job": "turnstile", "severity": rules[name]["labels"]["severity"]}
        expected = [{"exp_labels": {**base, **({"instance": f} if isinstance(f, str) else f)}} for f in firing]
        tests.append({
            "interval": "1m",
            "input_series": input_series,
            "alert_rule_test": [
                {"eval_time": "0m", "alertname": name, "exp_alerts": []},
                {"eval_time": eval_time, "alertname": name, "exp_alerts": expected},
            ],
        })  # fmt: skip
    unit_tests = tmp_path / "alerts_test.yml"
    unit_tests.write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": tests}))
    assert "SUCCESS" in run_promtool("test", "rules", unit_tests)


# -- names: the deploy files against the exporter ---------------------------------------------------


def test_alerts_name_only_exported_series_and_labels(families):
    exprs = [rule["expr"] for rule in load_rules()]
    assert not referenced(exprs, families).get(None), "alerts use series the exporter does not expose"
    assert [p for expr in exprs for p in check_labels(expr, families)] == []


def test_dashboard_names_only_exported_series_and_labels(families):
    dashboard = load_dashboard()
    exprs = dashboard_exprs(dashboard)
    assert not referenced(exprs, families).get(None), "the dashboard uses series the exporter does not expose"
    assert [p for expr in exprs for p in check_labels(expr, families)] == []


def test_dashboard_shows_every_exported_family(families):
    used = referenced(dashboard_exprs(load_dashboard()), families)
    assert sorted(set(families) - set(used)) == []
    histograms = [name for name, f in families.items() if f.kind == "histogram"]
    assert all(f"{name}_bucket" in used[name] for name in histograms), "each histogram needs a bucket panel"


def test_dashboard_is_grafana_json_on_a_datasource_variable():
    dashboard = load_dashboard()
    assert dashboard["uid"] and 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = dashboard_panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels)
    row_titles = [p["title"] for p in panels if p["type"] == "row"]
    assert len(row_titles) >= 6 and panels[0]["type"] == "row"
    for panel in (p for p in panels if p["type"] != "row"):
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    heatmaps = {p["title"] for p in panels if p["type"] == "heatmap"}
    assert {"Generate time per turn", "Env step time per turn", "Generation queue time", "Env queue time"} <= heatmaps
