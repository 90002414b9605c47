"""The real Prometheus server, run with the shipped deploy/prometheus.yml and alerts.yml, scrapes a
finished run's exporter: its queries agree with what the run did, no alert fires on a healthy run,
and every dashboard query runs.

Needs the `prometheus` binary (Debian's `prometheus` package; CI's .ci/run installs it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import anyio
import httpx2
import pytest
import yaml
from prometheus_client.core import Metric

from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from tests.conftest import REPO
from tests.fakes import DeterministicBackend
from tests.net import free_port
from tests.test_deploy import dashboard_panels, load_dashboard
from tests.test_engine import config, env_factory, rows

DEPLOY = REPO / "deploy"
TIMEOUT_S = 30.0


class ScrapeCounter:
    """A collector that adds no series and counts scrapes: each /metrics request collects it once."""

    def __init__(self) -> None:
        self.num_scrapes = 0
        self._is_interrupted = False
        self._changed = threading.Condition()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._changed:  # on the exporter's server thread
            self.num_scrapes += 1
            self._changed.notify_all()
        return iter(())

    def wait_for(self, num_scrapes: int, timeout: float) -> bool:
        """Blocks until the `num_scrapes`-th scrape (True), a timeout or an interrupt (False)."""
        with self._changed:
            self._changed.wait_for(lambda: self.num_scrapes >= num_scrapes or self._is_interrupted, timeout)
            return self.num_scrapes >= num_scrapes

    def interrupt(self) -> None:
        with self._changed:
            self._is_interrupted = True
            self._changed.notify_all()


def prometheus_config(exporter_port: int | None, path: Path) -> Path:
    """deploy/prometheus.yml with short intervals and rule files by absolute path, and its target the exporter
    at `exporter_port`; None: only the target files its file_sd_configs finds (beside `path`, as they are
    beside deploy/prometheus.yml)."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="500ms", scrape_timeout="500ms", evaluation_interval="500ms")
    config["rule_files"] = [str(DEPLOY / name) for name in config["rule_files"]]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "turnstile"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{exporter_port}"]}] if exporter_port is not None else []
    path.write_text(yaml.safe_dump(config))
    return path


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "the `prometheus` binary is not on PATH: install Debian's `prometheus` package "
            "(apt-get install --no-install-recommends prometheus); CI's .ci/run installs it"
        )
    return binary


class PrometheusServer:
    """`prometheus` as a subprocess on a free loopback port, its TSDB and log under `workdir`.

    Failures raise AssertionError (not pytest.fail, which pytest cannot report from inside the
    engine's task group)."""

    def __init__(self, binary: str, config_path: Path, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self.command = [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]

    async def __aenter__(self) -> PrometheusServer:
        self._log = self.log_path.open("wb")
        self.process = await anyio.open_process(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx2.AsyncClient(base_url=self.url, timeout=10)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.client.aclose()
        if self.process.returncode is None:
            self.process.terminate()
            with anyio.move_on_after(10, shield=True):
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
        await self.process.aclose()
        self._log.close()

    def fail(self, why: str) -> NoReturn:
        raise AssertionError(f"{why}\n--- prometheus log ---\n{self.log_path.read_text(errors='replace')[-4000:]}")

    async def wait_for_scrapes(self, counter: ScrapeCounter, num_scrapes: int) -> None:
        """Until the exporter has served its `num_scrapes`-th scrape; fails at once if Prometheus exits."""
        async with anyio.create_task_group() as tasks:

            async def interrupt_on_exit() -> None:
                await self.process.wait()
                counter.interrupt()

            tasks.start_soon(interrupt_on_exit)
            reached = await anyio.to_thread.run_sync(counter.wait_for, num_scrapes, TIMEOUT_S)
            tasks.cancel_scope.cancel()
        if self.process.returncode is not None:
            self.fail(f"prometheus exited with status {self.process.returncode}")
        if not reached:
            self.fail(f"prometheus scraped the exporter {counter.num_scrapes} times in {TIMEOUT_S}s")

    async def wait_until_ready(self) -> None:
        # Prometheus sends no readiness notification; scrapes prove its scrape loop runs, and /-/ready
        # (its documented readiness probe) turns 200 at about the same moment. So this short bounded
        # poll, the one sleep loop here, usually returns on its first request.
        with anyio.move_on_after(TIMEOUT_S):
            while (await self.client.get("/-/ready")).status_code != 200:
                await anyio.sleep(0.05)
            return
        self.fail(f"prometheus was not ready after {TIMEOUT_S}s")

    async def api(self, path: str, **params: str) -> dict | list:
        response = await self.client.get(f"/api/v1/{path}", params=params)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    async def query(self, expr: str) -> list[dict]:
        data = await self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    async def value(self, expr: str) -> float:
        result = await self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])


# What Grafana puts in place of the dashboard's variables.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$job": ".*", "$instance": ".*"}


def dashboard_queries() -> dict[str, str]:
    queries = {}
    for panel in dashboard_panels(load_dashboard()):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries[f"{panel['title']} / {target['refId']}"] = expr
    return queries


def varied_rows(n: int) -> list[dict]:
    """`rows(n)` with 1 to 4 turns per prompt."""
    return [{**row, "metadata": {"turns": 1 + i % 4}} for i, row in enumerate(rows(n))]


# Slow: Prometheus 2.x hands new targets to its scrape loop only every 5s, so the first scrape comes
# about 5s after it starts, whatever the scrape interval.
@pytest.mark.slow
@pytest.mark.anyio
async def test_prometheus_scrapes_a_finished_run_and_loads_the_alerts(tokenizer, tmp_path):
    binary = prometheus_binary()
    alerts = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    alert_names = {rule["alert"] for group in alerts["groups"] for rule in group["rules"]}
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=ChatEncoder(tokenizer),
        env_factory=env_factory(),
        source=varied_rows(5),
        config=config(n_samples_per_prompt=3, metrics_port=0),
    ) as engine:
        groups = await engine.rollout(5)
        assert len(groups) == 5
        trajectories = [t for group in groups for t in group.trajectories]
        num_turns = sum(len(t.turns) for t in trajectories)
        counter = ScrapeCounter()
        engine.exporter.registry.register(counter)
        scraped_before = counter.num_scrapes  # the run has ended: every scrape from here on sees it all

        config_path = prometheus_config(engine.exporter.port, tmp_path / "prometheus.yml")
        async with PrometheusServer(binary, config_path, tmp_path) as prometheus:
            # Scrapes of one target run one after another: once the second has begun, the first
            # (wholly after the run) has been stored.
            await prometheus.wait_for_scrapes(counter, scraped_before + 2)
            await prometheus.wait_until_ready()

            assert await prometheus.value('up{job="turnstile"}') == 1
            job = '{job="turnstile"}'
            assert await prometheus.value(f"sum(turnstile_trajectories_finished_total{job})") == len(trajectories)
            assert await prometheus.value(f"sum(turnstile_turn_generate_seconds_count{job})") == num_turns
            assert await prometheus.value(f"sum(turnstile_turns_total{job})") == num_turns
            assert await prometheus.value(f"sum(turnstile_groups_emitted_total{job})") == len(groups)
            assert await prometheus.value(f"sum(turnstile_trajectories_inflight{job})") == 0
            by_outcome = await prometheus.query('turnstile_turns_total{job="turnstile", outcome="env_done"}')
            assert [float(s["value"][1]) for s in by_outcome] == [len(trajectories)]

            groups_loaded = (await prometheus.api("rules", type="alert"))["groups"]
            loaded = {rule["name"]: rule for group in groups_loaded for rule in group["rules"]}
            assert set(loaded) == alert_names
            for name, rule in loaded.items():
                # Each alert's condition on the real series: valid PromQL, and quiet on a healthy run.
                assert await prometheus.query(rule["query"]) == [], name
            for panel, expr in dashboard_queries().items():
                assert "$" not in expr, panel
                await prometheus.query(expr)  # the response says success (valid PromQL, no matching errors)


@pytest.mark.slow
@pytest.mark.anyio
async def test_prometheus_finds_an_engine_by_the_target_file_it_writes_while_it_serves(tokenizer, tmp_path):
    """metrics_sd_dir, read by the shipped config's file_sd_configs: no address is written into the config; the
    labels it is given (a rollout shard's `shard`) are on every series scraped."""
    binary = prometheus_binary()
    targets = tmp_path / "targets"  # as deploy/targets beside deploy/prometheus.yml
    config_path = prometheus_config(None, tmp_path / "prometheus.yml")
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=ChatEncoder(tokenizer),
        env_factory=env_factory(),
        source=rows(2),
        config=config(metrics_port=0, metrics_sd_dir=str(targets), metrics_labels={"shard": "3"}),
    ) as engine:
        groups = await engine.rollout(2)
        counter = ScrapeCounter()
        engine.exporter.registry.register(counter)
        [target_file] = targets.glob("turnstile-*.json")
        assert target_file == engine.exporter.target_file
        async with PrometheusServer(binary, config_path, tmp_path) as prometheus:
            await prometheus.wait_for_scrapes(counter, 2)
            await prometheus.wait_until_ready()
            [up] = await prometheus.query('up{job="turnstile"}')
            assert up["metric"]["instance"] == f"127.0.0.1:{engine.exporter.port}" and up["value"][1] == "1"
            assert up["metric"]["node"] and up["metric"]["pid"]  # the labels the target file gives
            finished = await prometheus.value('sum(turnstile_trajectories_finished_total{job="turnstile"})')
            assert finished == sum(len(g.trajectories) for g in groups)
            series = await prometheus.query('{job="turnstile", __name__=~"turnstile_.*"}')
            assert series and {s["metric"].get("shard") for s in series} == {"3"}
    assert list(targets.iterdir()) == []  # gone with the exporter


def test_a_wildcard_metrics_host_is_advertised_as_this_nodes_address():
    from engine.metrics.prometheus import reachable_host

    assert reachable_host("127.0.0.1") == "127.0.0.1"
    for wildcard in ("0.0.0.0", "::"):
        address = reachable_host(wildcard)
        assert address not in ("0.0.0.0", "::", "") and socket.getaddrinfo(address, None)
