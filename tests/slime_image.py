"""TEST INFRASTRUCTURE: a venv holding what slime's image pins, for tests/test_slime_image.py.

    python -m tests.slime_image install    # the pinned venv (cached; ~5 GB, a minute or more once)

slime's image (docker/Dockerfile at slime 624b824) is `slimerl/sglang:v0.5.15.post1-cu129` plus slime's
requirements.txt, then `numpy==1.26.4 scipy==1.17.1` for Megatron. Of what it holds, these are what a
`pip install turnstile` there could replace: sglang 0.5.15.post1's `torch==2.11.0` and `transformers==5.12.1`,
the torchvision of torch 2.11 (0.26.0), and the numpy/scipy pair. PINS installs them as pip resolves them
(torch 2.11.0 from PyPI is a CUDA build: its libraries are the nvidia-* wheels, and torch does not import
without them). The venv: $TURNSTILE_SLIME_IMAGE_VENV, else `<turnstile cache>/slime-image-venv`; a finished
install leaves a marker naming the pins, so a half-done one is redone rather than used.

The checks never install into the cached venv: `copy_venv` makes a copy, hard-linked where the filesystem
allows (pip replaces a file by writing a new one, so the cache stays as built), and Turnstile goes into that.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine.models import cache_dir

REPO = Path(__file__).resolve().parents[1]
PINS = {"torch": "2.11.0", "torchvision": "0.26.0", "transformers": "5.12.1", "numpy": "1.26.4", "scipy": "1.17.1"}
PACKAGE_SOURCES = ("pyproject.toml", "README.md", "engine", "bridge")  # what `pip install <checkout>` builds from
# Every installed distribution and its version, as importlib.metadata reads them in that venv.
VERSIONS = (
    "import importlib.metadata as m, json, re; "
    "print(json.dumps({re.sub(r'[-_.]+', '-', d.name).lower(): d.version for d in m.distributions()}))"
)


class SlimeImageUnavailable(RuntimeError):
    """The pinned venv is missing or broken; the message says which and why."""


def venv_dir() -> Path:
    return Path(os.environ.get("TURNSTILE_SLIME_IMAGE_VENV") or cache_dir() / "slime-image-venv")


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _marker() -> Path:
    tag = hashlib.sha256(json.dumps(PINS, sort_keys=True).encode()).hexdigest()[:12]
    return venv_dir() / f".turnstile-slime-image-{tag}"


def is_installed() -> bool:
    return _marker().exists() and python_of(venv_dir()).exists()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return env


def _run(step: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(step, capture_output=True, text=True, env=_env(), **kwargs)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SlimeImageUnavailable(f"{what} failed at `{' '.join(map(str, step))}`:\n{tail}")
    return done


def install(log=sys.stderr) -> Path:
    """Create the venv and install PINS into it, unless already done. Raises SlimeImageUnavailable with
    pip's last lines when the install fails."""
    if is_installed():
        return python_of(venv_dir())
    shutil.rmtree(venv_dir(), ignore_errors=True)
    venv_dir().parent.mkdir(parents=True, exist_ok=True)
    python = str(python_of(venv_dir()))
    steps = [
        [sys.executable, "-m", "venv", str(venv_dir())],
        [python, "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "-q", *(f"{name}=={version}" for name, version in PINS.items())],
    ]
    for step in steps:
        print(f"slime-image: python {' '.join(step[1:])}", file=log, flush=True)
        _run(step, "building the slime-image venv")
    found = versions(venv_dir())
    wrong = {name: found.get(name) for name, version in PINS.items() if found.get(name) != version}
    if wrong:
        raise SlimeImageUnavailable(f"the slime-image venv holds {wrong}, not {PINS}")
    _run([python, "-c", "import torch, torchvision, transformers"], "importing the pins")
    _marker().write_text(json.dumps(PINS))
    return python_of(venv_dir())


def versions(venv: Path) -> dict[str, str]:
    """Every distribution installed in `venv`, by normalised name (PEP 503), and its version."""
    return json.loads(_run([str(python_of(venv)), "-c", VERSIONS], "listing the venv").stdout)


def copy_venv(dest: Path) -> Path:
    """A copy of the pinned venv at `dest` (hard links where the filesystem allows, else a full copy). Use it
    through `python -m pip`: the copied bin/ scripts still name the cached venv's python."""
    if not is_installed():
        raise SlimeImageUnavailable(f"no slime-image venv at {venv_dir()}: run `python -m tests.slime_image install`")

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(venv_dir(), dest, symlinks=True, copy_function=link)
    return dest


def checkout_copy(dest: Path) -> Path:
    """The files the package is built from, copied (a build in the checkout itself would leave build/ there)."""
    dest.mkdir(parents=True)
    for name in PACKAGE_SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, dest / name)
    return dest


def pip_install(venv: Path, *requirements: str) -> str:
    """`pip install REQUIREMENTS` in `venv`, as a user runs it; pip's output."""
    done = _run([str(python_of(venv)), "-m", "pip", "install", *requirements], "pip install")
    return done.stdout + done.stderr


def pip_would_install(venv: Path, *requirements: str) -> dict[str, str]:
    """What `pip install REQUIREMENTS` would install in `venv` (`--dry-run`): name -> version."""
    done = _run(
        [str(python_of(venv)), "-m", "pip", "install", "-q", "--dry-run", "--report", "-", *requirements],
        "pip install --dry-run",
    )
    report = json.loads(done.stdout)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}


def pip_check(venv: Path) -> str:
    """'' when `pip check` finds every installed distribution's requirements met, else its report."""
    done = subprocess.run([str(python_of(venv)), "-m", "pip", "check"], capture_output=True, text=True, env=_env())
    return "" if done.returncode == 0 else (done.stdout + done.stderr).strip()


def changes(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """What differs between two `versions`: name -> (before, after), None where absent."""
    return {
        name: (before.get(name), after.get(name))
        for name in sorted(before.keys() | after.keys())
        if before.get(name) != after.get(name)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.slime_image")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="create the venv with slime's image's pins (cached)")
    parser.parse_args(argv)
    try:
        print(install())
        return 0
    except SlimeImageUnavailable as error:
        print(f"slime-image: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
