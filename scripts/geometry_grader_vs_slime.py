"""Checks the geometry env's answer rule and slime's `--rm-type math` rule on the table of answer forms
(engine/envs/geometry/answer_forms.py), from a slime checkout:

    .venv/bin/python scripts/geometry_grader_vs_slime.py /path/to/slime-checkout

slime's rule is loaded from the checkout's slime/rollout/rm_hub/math_utils.py by its file path (importing
slime's package needs its whole stack); that file needs sympy and pylatexenc (`pip install pylatexenc`).
The answer goes to slime inside `\\boxed{}`, as the env sends it. Prints a line per row, then the number of
rows where either rule is not the table's verdict, and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.envs.geometry.answer_forms import ANSWER_FORMS, disagreements  # noqa: E402
from engine.envs.geometry.grader import is_equivalent  # noqa: E402

MATH_UTILS = Path("slime/rollout/rm_hub/math_utils.py")


def slime_rule(checkout: Path) -> Callable[[str, str], bool]:
    """slime's `grade_answer_verl`, as `rule(answer, truth)` with the answer boxed."""
    path = checkout / MATH_UTILS
    if not path.is_file():
        raise SystemExit(f"{checkout}: no {MATH_UTILS} (not a slime checkout?)")
    spec = importlib.util.spec_from_file_location("slime_math_utils", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise SystemExit(f"{path} does not import: {exc} (it needs sympy and pylatexenc)") from exc
    return lambda answer, truth: module.grade_answer_verl(f"\\boxed{{{answer}}}", truth)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a slime checkout")
    checkout = parser.parse_args().checkout
    slime = slime_rule(checkout)
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    print(f"slime {commit.stdout.strip() or '(not a git checkout)'}: {checkout / MATH_UTILS}")
    for form in ANSWER_FORMS:
        own, theirs = is_equivalent(form.given, form.truth), slime(form.given, form.truth)
        note = f"  slime differs: {form.slime_differs}" if form.slime_differs else ""
        verdicts = f"table={form.is_correct!s:5} own={own!s:5} slime={theirs!s:5}"
        print(f"{form.given!r:28} vs {form.truth!r:22} {verdicts}{note}")
    own_off, slime_off = disagreements(is_equivalent, is_slime=False), disagreements(slime, is_slime=True)
    for name, off in (("own rule", own_off), ("slime's rule", slime_off)):
        for form, verdict in off:
            print(f"UNEXPECTED {name}: {form.given!r} vs {form.truth!r} gave {verdict}", file=sys.stderr)
    print(f"{len(ANSWER_FORMS)} rows; off the table: own rule {len(own_off)}, slime's rule {len(slime_off)}")
    return 1 if own_off or slime_off else 0


if __name__ == "__main__":
    sys.exit(main())
