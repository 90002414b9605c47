"""What the engine tells the world: observer hooks, per-turn metrics, Prometheus, logs, step summaries."""

from engine.metrics.events import Observer
from engine.metrics.recorder import MetricsRecorder

__all__ = ["MetricsRecorder", "Observer"]
