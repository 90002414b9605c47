"""Load a user env module by path and build one env per trajectory, as slime's multi-turn examples do.

    factory = EnvFactory("my_pkg.my_env", args=SimpleNamespace(max_turns=4), step_timeout=30.0)
    runner = factory(EnvSample(prompt="...", label="95"))     # an EnvRunner around a fresh env

The module is a dotted module path or a path to a `.py` file, and exposes
`build_env(sample=None, args=None, **kw)` (a positional `build_env(sample, args)` works too).
Every problem with the module or with what `build_env` returns raises `EnvLoadError`, naming the
module and the cause; failures of the env's own steps are the runner's (EnvError). `hosted(factory,
env_workers=4)` of engine/envs/ray_workers.py runs the same module's envs in Ray actors instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.envs.base import BaseInteractionEnv, EnvRunner
from engine.envs.builtin import EXTRAS, resolve_env_path
from engine.errors import EnvError, ErrorClass


class EnvLoadError(EnvError, ValueError):
    """An env module that does not load, or a `build_env` that does not give a usable env.

    A ValueError for whoever loads the module; an EnvError (ENV_EXCEPTION) for the turn loop, so a
    `build_env` that fails for one sample fails that trajectory only, with the reason recorded."""

    def __init__(self, message: str):
        super().__init__(ErrorClass.ENV_EXCEPTION, message)


@dataclass(slots=True)
class EnvSample:
    """The attributes of slime's `Sample` that envs read; a slime `Sample` may be passed instead."""

    prompt: str | list[dict[str, Any]] = ""
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int | None = None
    group_index: int | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any], *, index: int | None = None, group_index: int | None = None) -> EnvSample:
        """From a prompt row `{"prompt": ..., "label": ..., "metadata": {...}}`. A row that carries the
        caller's own sample objects, one per trajectory (`row["samples"]`: slime's Samples, from the
        bridge), gives the env that sample itself, as slime's own rollout would."""
        given = caller_sample(row, index)
        if given is not None:
            return given
        return cls(row.get("prompt", ""), row.get("label"), dict(row.get("metadata") or {}), index, group_index)


def caller_sample(row: dict[str, Any], index: int | None) -> Any | None:
    """The caller's own object for member `index` of a row's group (`row["samples"]`), or None."""
    samples = row.get("samples")
    return samples[index] if samples is not None and index is not None and index < len(samples) else None


def load_env_module(path: str) -> ModuleType:
    """Import an env module from a dotted module path, a `.py` file path or a built-in env's short name
    (engine/envs/builtin.py). Raises EnvLoadError."""
    path = resolve_env_path(path)
    if path.endswith(".py"):
        return _load_file(Path(path))
    try:
        return importlib.import_module(path)
    except Exception as exc:
        hint = ""
        file = Path(*path.split(".")).with_suffix(".py")
        if isinstance(exc, ModuleNotFoundError) and path.startswith(str(exc.name)) and file.is_file():
            hint = f"; {file} is a file here: give it as a path, {file}, or put its folder on PYTHONPATH"
        elif isinstance(exc, ModuleNotFoundError) and path in EXTRAS:
            hint = f"; it needs Turnstile's {EXTRAS[path]} extra: pip install 'turnstile[{EXTRAS[path]}]'"
        raise EnvLoadError(f"env module {path!r} does not import: {exc!r}{hint}") from exc


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise EnvLoadError(f"env module file {str(path)!r} does not exist")
    resolved = path.resolve()
    # A stable, unique name: loading the same file twice gives the same module.
    name = f"turnstile_env_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise EnvLoadError(f"env module file {str(path)!r} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise EnvLoadError(f"env module file {str(path)!r} does not import: {exc!r}") from exc
    return module


class EnvFactory:
    """Built once from a module path (and slime-style `args`); each call builds one env and its runner.

    The runner formats observations with the env's own `format_observation` when it defines one,
    else the module's `format_observation`, else the default (base.default_format_observation).
    A user's `build_env` may block (creating a remote sandbox, say): `blocking` tells the engine to
    call the factory in a worker thread.
    """

    blocking = True

    def __init__(self, path: str, args: Any = None, *, step_timeout: float | None = None):
        self.path = path
        self.args = args
        self.step_timeout = step_timeout
        self.module = load_env_module(path)
        self._build = getattr(self.module, "build_env", None)
        if self._build is None:
            raise EnvLoadError(f"env module {path!r} has no build_env")
        if not callable(self._build):
            raise EnvLoadError(f"env module {path!r}: build_env is a {type(self._build).__name__}, not callable")
        self._module_format = getattr(self.module, "format_observation", None)
        if self._module_format is not None and not callable(self._module_format):
            raise EnvLoadError(f"env module {path!r}: format_observation is not callable")
        by_keyword = _takes_keywords(self._build)
        if by_keyword is None:
            raise EnvLoadError(
                f"env module {path!r}: build_env{inspect.signature(self._build)} takes neither "
                "build_env(sample=..., args=...) nor build_env(sample, args)"
            )
        self._by_keyword = by_keyword
        roles = getattr(self.module, "OBSERVATION_ROLES", ())
        if not (isinstance(roles, tuple | list) and all(isinstance(role, str) for role in roles)):
            raise EnvLoadError(f"env module {path!r}: OBSERVATION_ROLES is {roles!r}, not a tuple of role names")
        self.observation_roles: tuple[str, ...] = tuple(roles)  # what its observations may be, if it says

    def __call__(self, sample: Any = None) -> EnvRunner:
        """A runner around a fresh env for `sample` (an EnvSample or a slime Sample). Raises EnvLoadError."""
        try:
            if self._by_keyword:
                env = self._build(sample=sample, args=self.args)
            else:
                env = self._build(sample, self.args)
        except Exception as exc:
            raise EnvLoadError(f"env module {self.path!r}: build_env raised {exc!r}") from exc
        if not callable(getattr(env, "step", None)) and not callable(getattr(env, "astep", None)):
            kind = type(env).__name__
            raise EnvLoadError(f"env module {self.path!r}: build_env returned {kind}, which has no step() or astep()")
        return EnvRunner(env, format_observation=self._formatter(env), step_timeout=self.step_timeout)

    def close(self) -> None:
        """Nothing to end here: each env is closed with its trajectory."""

    def _formatter(self, env: Any) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
        own = getattr(env, "format_observation", None)
        if callable(own) and getattr(own, "__func__", None) is not BaseInteractionEnv.format_observation:
            return own
        return self._module_format  # None: the runner's default


def _takes_keywords(fn: Any) -> bool | None:
    """Whether `fn(sample=..., args=...)` binds (True), else `fn(sample, args)` does (False), as slime falls
    back to positional arguments; None when neither binds."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to inspect (a builtin): try keywords
        return True
    try:
        signature.bind(sample=None, args=None)
        return True
    except TypeError:
        pass
    try:
        signature.bind(None, None)
        return False
    except TypeError:
        return None
