"""Layers only look down: every module of engine/ and bridge/ sits on one layer of the table below, imports only
modules of its own layer or of layers below it, and no modules import each other in a circle. A lower layer learns
of a higher one through a protocol it owns (engine/hosting.py's `HostedEnv`, engine/statistics.py's `Measured`,
engine/metrics/events.py's `Observer`), never an import. Every import counts: inside functions and under
TYPE_CHECKING too. docs/layout.md holds the same table (a test keeps the two equal).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "bridge")

# Top to bottom. A name is a module, or `pkg.*`: the package and every module in it; the longest name that
# matches a module places it.
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    ("the command", ("engine.cli",), "`turnstile`: its parser, the settings it builds"),
    (
        "slime's side",
        ("bridge.*",),
        "rollout functions with slime's signatures, the service, the Ray actor, the shards",
    ),
    (
        "the commands' work",
        ("engine.gateway_command", "engine.run", "engine.show", "engine.template_check", "engine.template_drift"),
        "`turnstile run`, `gateway`, `show`, `check-template`",
    ),
    (
        "built-in envs",
        (
            "engine.envs.agent_command",
            "engine.envs.arith",
            "engine.envs.faults",
            "engine.envs.geometry.*",
            "engine.envs.judge.*",
            "engine.envs.python_agent.*",
            "engine.envs.python_tool.*",
        ),
        "envs loaded by path, clients of what lies below (python_agent and agent_command of the agents)",
    ),
    ("agents", ("engine.agents.*",), "the session gateway and agent envs: clients of the engine"),
    ("the engine", ("engine.engine", "engine.hosting"), "RolloutEngine; what it offers envs that bind to it"),
    (
        "metrics and settings",
        ("engine.metrics.*", "engine.config", "engine.statistics"),
        "Prometheus, summaries, logs, the live view; the settings model; the engine's snapshot",
    ),
    ("the scheduler", ("engine.scheduler.*", "engine.metrics.events"), "turn-level dispatch; the observer hooks"),
    (
        "the turn",
        (
            "engine.turn",
            "engine.scheduler.partial",
            "engine.scheduler.queue",
            "engine.scheduler.retry",
            "engine.scheduler.signals",
        ),
        "what one turn does; the scheduler's parts (versions, slots, budgets, signals)",
    ),
    (
        "encoding",
        ("engine.encoding", "engine.families", "engine.probe"),
        "delta tokens; model families; a family's call syntax read off its template",
    ),
    ("backends and the env contract", ("engine.backends.*", "engine.envs.*"), "SGLang, the local model; env runners"),
    ("the trajectory", ("engine.trajectory",), "one sample, one writer of its status"),
    ("parsers and images", ("engine.parsers.*", "engine.multimodal"), "model output read per family; images"),
    (
        "the ground",
        ("engine", "engine.errors", "engine.models", "engine.source", "engine.gc_freeze"),
        "errors as data, the embedded models, prompt sources, the collector's freeze",
    ),
]


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _known(name: str) -> str | None:
    """The module of engine/ or bridge/ that importing `name` loads (a name inside a module: that module)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str) -> set[str]:
    """The modules of engine/ and bridge/ that module `name` imports, wherever in it the import stands."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:  # `from pkg import module` imports the module; `from module import name` it
                named.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base)
    return {module for module in map(_known, named) if module is not None and module != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    return {name: imports(name) for name in modules()}


def layer_of(module: str) -> int | None:
    """The index of the layer whose longest matching name places `module`."""
    matches = [
        (len(stem), index)
        for index, (_, names, _) in enumerate(LAYERS)
        for stem, whole in ((name.removesuffix(".*"), name.endswith(".*")) for name in names)
        if module == stem or (whole and module.startswith(stem + "."))
    ]
    return max(matches)[1] if matches else None


def cycles() -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph()[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for v in sorted(graph()):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read():
    assert len(modules()) > 100
    assert graph()["engine.engine"] >= {"engine.scheduler.scheduler", "engine.hosting", "engine.metrics.prometheus"}
    # an import inside a function, and one under TYPE_CHECKING, count as any other
    assert "engine.metrics.prometheus" in graph()["engine.engine"]
    assert "engine.hosting" in graph()["engine.agents.env"]


def test_no_modules_import_each_other_in_a_circle():
    found = cycles()
    ties = [f"{a} -> {b}" for group in found for a in group for b in sorted(graph()[a] & set(group))]
    assert not found, f"modules that import each other in a circle: {found}; the imports: {ties}"


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in modules() if layer_of(name) is None)
    assert not unplaced, f"place these modules in LAYERS (and docs/layout.md): {unplaced}"


def test_layers_only_look_down():
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in sorted(graph().items())
        for b in sorted(targets)
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) < layer_of(a)
    ]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_what_the_design_names_holds():
    """The arrows the style guide names, spelled out (the table implies them)."""
    agents = {name for name in modules() if name.startswith("engine.agents")}
    core = ("engine.engine", "engine.scheduler", "engine.turn", "engine.encoding", "engine.backends", "engine.metrics")
    for name, targets in graph().items():
        if name.startswith("engine") and name != "engine.cli":
            assert not any(t.startswith("bridge") for t in targets), f"{name} imports bridge/"
        if name.startswith(core):
            assert not targets & agents, f"{name} imports the agents: {sorted(targets & agents)}"
        if LAYERS[layer_of(name)][0] == "backends and the env contract":
            assert not any(t.startswith("engine.scheduler") for t in targets), f"{name} imports the scheduler"
        if name.startswith("engine.metrics"):
            assert "engine.engine" not in targets, f"{name} imports the engine"


def _path(pattern: str) -> str:
    if pattern.endswith(".*"):
        return pattern.removesuffix(".*").replace(".", "/") + "/"
    return str(modules()[pattern].relative_to(ROOT))


def markdown_table() -> str:
    rows = ["| layer | modules | what |", "|---|---|---|"]
    for name, members, what in LAYERS:
        rows.append(f"| {name} | {', '.join(f'`{_path(member)}`' for member in members)} | {what} |")
    return "\n".join(rows)


def test_the_layout_doc_holds_the_table():
    assert markdown_table() in (ROOT / "docs" / "layout.md").read_text(), markdown_table()
