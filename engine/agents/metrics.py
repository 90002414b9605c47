"""The gateway's own Prometheus series: its counts (requests, forks, bad requests, ignored fields, ...) and what
its sessions wait for, collected at scrape time (labels: the API, the fork cause, the HTTP status, the field:
bounded sets, never a session id). The turns' series are the engine's (its observers, its exporter)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class GatewayCollector(Collector):
    """`gateway.counts` (keys `name` or `name:label`) as `turnstile_agent_*` series."""

    SERIES = {  # count key -> (series, help, label)
        "requests": ("agent_requests", "Agent requests to the gateway, by API.", "api"),
        "forks": ("agent_forks", "Chains started by a request that continued none, by cause.", "cause"),
        "bad_requests": ("agent_bad_requests", "Requests answered with an error, by HTTP status.", "status"),
        "sampling_ignored": (
            "agent_sampling_ignored", "Client sampling fields ignored for the rollout's settings, by field.", "field",
        ),
        "degraded": (
            "agent_degraded", "Parts of requests the policy cannot take, left out of its prompt, by kind.", "kind",
        ),
        "parse_failures": ("agent_parse_failures", "Turns whose tool calls the family's parser could not read.", ""),
        "repeats": ("agent_repeated_requests", "Requests repeating one in flight or answered (a client's retry).", ""),
        "turns_cut": (
            "agent_turns_cut", "Turns the rollout's cap or budget cut, reported to the agent as ended.", "",
        ),
        "stream_diverged": (
            "agent_stream_diverged", "Streamed replies whose final reading did not extend what was sent.", "",
        ),
        "disconnects": ("agent_disconnects", "Requests whose client left before the body or the reply.", ""),
        "internal_errors": ("agent_internal_errors", "Requests that met an unexpected error (a 500).", ""),
        "agent_exits": ("agent_exits", "Agent programs of agent envs ended, by outcome.", "outcome"),
    }  # fmt: skip

    def __init__(self, gateway: Any):
        self.gateway = gateway

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        counts = dict(self.gateway.counts)  # a copy: the scrape may run while requests count
        for key, (series, doc, label) in self.SERIES.items():
            family = CounterMetricFamily(f"turnstile_{series}", doc, labels=[label] if label else [])
            for name, value in counts.items():
                head, _, value_label = name.partition(":")
                if head == key:
                    family.add_metric([value_label] if label else [], value)
            yield family
        sessions = list(self.gateway.sessions.values())
        chains = [chain for session in sessions for chain in session.chains if not chain.ended]
        yield GaugeMetricFamily("turnstile_agent_sessions", "Open sessions.", value=len(sessions))
        waiting = GaugeMetricFamily(
            "turnstile_agent_chains", "Chains not ended, by what they wait for.", labels=["waiting_for"]
        )
        waiting.add_metric(["agent"], sum(chain.waiting for chain in chains))
        waiting.add_metric(["model"], sum(not chain.waiting for chain in chains))
        yield waiting
