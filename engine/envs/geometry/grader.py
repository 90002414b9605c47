"""The math-answer rule: does a response's final answer equal the ground truth? (And exact answers written
as LaTeX, for the problems.)

Where slime imports, its own `--rm-type math` rule decides (`slime.rollout.rm_hub.math_utils.grade_answer_verl`
on the answer in `\\boxed{}`), so the env's reward is the one slime's trainer would compute. Elsewhere an
equivalent rule of this module's own decides, written for the answer forms geometry problems have:

- the answer is the last `\\boxed{...}` of the response, else what follows its last `Answer:`;
- `$`, `\\(...\\)`, `\\text{}`, `\\left`/`\\right`, degree signs (`^\\circ`, `°`, "degrees"), units (cm, m,
  units, square ...), a leading `x =`, and thousands commas are dropped;
- `\\frac{a}{b}`, `a/b`, `\\sqrt{n}`, `\\sqrt n`, `sqrt(n)`, `√n`, `\\pi`, `π` and implicit products
  (`5\\sqrt{2}`, `25\\pi`) are evaluated exactly enough to compare values;
- an integer truth needs an integer answer (`35`, `35.0`), as slime's rule does; a fraction truth refuses an
  unreduced fraction (`\\frac{6}{4}` for `\\frac{3}{2}`), as slime's does;
- a decimal answer within `rel_tol` (default 1e-3, and 5e-3 absolute) of a non-integer truth counts
  (`78.54` for `25\\pi`): slime's rule needs the decimal itself as a ground truth, which the env supplies.

`engine.envs.geometry.answer_forms.ANSWER_FORMS` is the table of forms both rules are checked on.
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import Literal

DEFAULT_REL_TOL = 1e-3
ABS_TOL = 5e-3
Rule = Literal["auto", "slime", "own"]

_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:：]\s*(.+)", re.IGNORECASE)
_UNITS = re.compile(
    r"(?:square|sq\.?|cubic)?\s*(?<![a-z\\])(?:units?|centimet(?:er|re)s?|met(?:er|re)s?|millimet(?:er|re)s?|cm|mm|km|m|"
    r"inch(?:es)?|in|feet|foot|ft|yards?|degrees?|deg)(?![a-z])\s*(?:\^\s*\{?[23]\}?|²|³)?",
    re.IGNORECASE,
)
_THOUSANDS = re.compile(r"(\d),(\d{3})(?!\d)")


@dataclass(frozen=True, slots=True)
class Verdict:
    answer: str | None  # what was read as the final answer; None: no answer found
    is_correct: bool
    rule: str  # "slime" or "own"


# -- writing exact answers ---------------------------------------------------------------------
def sqrt_form(n: int) -> tuple[int, int]:
    """`(k, m)` with `sqrt(n) = k * sqrt(m)` and `m` square-free."""
    k, m = 1, n
    for f in range(int(math.isqrt(n)), 1, -1):
        if n % (f * f) == 0:
            k, m = f, n // (f * f)
            break
    return k, m


def latex_sqrt(n: int) -> str:
    k, m = sqrt_form(n)
    if m == 1:
        return str(k)
    return f"\\sqrt{{{m}}}" if k == 1 else f"{k}\\sqrt{{{m}}}"


def latex_fraction(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


# -- reading answers -----------------------------------------------------------------------------
def extract_answer(response: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`) of the response, else the text after its last `Answer:`."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    lines = [m.group(1) for m in _ANSWER_LINE.finditer(response)]
    if not lines:
        return None
    answer = lines[-1].strip().rstrip(".").strip()
    return answer or None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, braces balanced; None if there is none (or it is open)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0:
        return None
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opening + 1 : i]
    return None


def normalize(answer: str) -> str:
    """The answer without notation that does not change its value, as a plain expression (`5*sqrt(2)`)."""
    text = answer.strip()
    inner = last_boxed(text)
    if inner is not None and text.startswith(("\\boxed", "\\fbox")):
        text = inner
    for old, new in _SPELLINGS:
        text = text.replace(old, new)
    text = re.sub(r"\\(?:text|mathrm|textrm|mbox)\s*\{([^{}]*)\}", r"\1", text)
    text = _DEGREES.sub("", text)
    text = _UNITS.sub("", text)
    if "=" in text:  # "x = 5", "EF = 5"
        text = text.rsplit("=", 1)[1]
    text = _THOUSANDS.sub(r"\1\2", text)
    text = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", text)
    text = re.sub(r"(?:\\sqrt|√)\s*\(?\s*(\d+(?:\.\d+)?)\s*\)?", r"sqrt(\1)", text)
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)  # \frac12
    while "\\frac" in text:  # innermost first
        replaced = re.sub(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))", text)
        if replaced == text:
            break
        text = replaced
    for old, new in (
        ("\\pi", "pi"),
        ("π", "pi"),
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("·", "*"),
        ("×", "*"),
        ("{", "("),
        ("}", ")"),
        ("^", "**"),
    ):
        text = text.replace(old, new)
    return _with_products(re.sub(r"\s+", "", text).lower())


_SPELLINGS = (
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\ ", " "),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\(", ""),
    ("\\)", ""),
    ("\\[", ""),
    ("\\]", ""),
    ("\\$", ""),
    ("$", ""),
    ("\\%", ""),
    ("%", ""),
)
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_TOKEN = re.compile(r"\d+\.?\d*|\.\d+|sqrt|pi|\*\*|[-+*/()]|.")


def _with_products(text: str) -> str:
    """Explicit `*` where a product is implied: `5sqrt(2)`, `25pi`, `2(3)`, `sqrt(2)pi`."""
    tokens = _TOKEN.findall(text)
    out: list[str] = []
    for token in tokens:
        ends_value = bool(out) and (out[-1][0].isdigit() or out[-1][0] == "." or out[-1] in ("pi", ")"))
        if ends_value and (token[0].isdigit() or token[0] == "." or token in ("pi", "sqrt", "(")):
            out.append("*")
        out.append(token)
    return "".join(out)


_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def evaluate(expression: str) -> float | None:
    """The value of a normalized answer built from numbers, `pi`, `sqrt(...)`, + - * / and small powers;
    None for anything else (text, unknown names, a division by zero)."""
    try:
        return _value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 10:
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
    ):
        return math.sqrt(_value(node.args[0]))
    raise ValueError(f"not an answer expression: {ast.dump(node)[:60]}")


def _plain_fraction(expression: str) -> tuple[int, int] | None:
    """`(a, b)` for `a/b` (or `((a)/(b))`) of integers, as written; None for anything else."""
    match = re.fullmatch(r"\(*(-?\d+)\)*/\(*(\d+)\)*", expression)
    if match is None or int(match.group(2)) == 0:
        return None
    return int(match.group(1)), int(match.group(2))


def _is_integer_literal(expression: str) -> bool:
    return re.fullmatch(r"-?\d+(?:\.0*)?", expression) is not None


def is_equivalent(given: str, truth: str, *, rel_tol: float = DEFAULT_REL_TOL) -> bool:
    """Whether the answer `given` has the value of the ground truth `truth` (both as written, LaTeX or plain)."""
    g, t = normalize(given), normalize(truth)
    if not g:
        return False
    if g == t:
        return True
    g_value, t_value = evaluate(g), evaluate(t)
    if g_value is None or t_value is None:
        return False
    if _is_integer_literal(t):  # an integer truth takes an integer answer only
        return _is_integer_literal(g) and g_value == t_value
    g_fraction, t_fraction = _plain_fraction(g), _plain_fraction(t)
    if g_fraction is not None and t_fraction is not None:  # fractions must be given in lowest terms
        return math.gcd(*g_fraction) == 1 and Fraction(*g_fraction) == Fraction(*t_fraction)
    if math.isclose(g_value, t_value, rel_tol=1e-9, abs_tol=1e-12):
        return True
    return "." in g and rel_tol > 0 and math.isclose(g_value, t_value, rel_tol=rel_tol, abs_tol=ABS_TOL)


@cache
def slime_rule() -> Callable[[str, str], bool] | None:
    """slime's `--rm-type math` rule (`grade_answer_verl(response, label)`), or None where slime does not import."""
    try:
        return importlib.import_module("slime.rollout.rm_hub.math_utils").grade_answer_verl
    except Exception:  # not installed, or its dependencies (sympy, pylatexenc) are missing
        return None


def grade(response: str, truths: Sequence[str], *, rule: Rule = "auto", rel_tol: float = DEFAULT_REL_TOL) -> Verdict:
    """The response's final answer against each accepted ground truth. `rule`: "slime" (slime's rule, which
    must import), "own" (this module's), or "auto" (slime's where it imports)."""
    if rule not in ("auto", "slime", "own"):
        raise ValueError(f"grader rule must be 'auto', 'slime' or 'own', got {rule!r}")
    answer = extract_answer(response)
    slime = slime_rule() if rule != "own" else None
    if rule == "slime" and slime is None:
        raise ValueError("grader rule 'slime': slime.rollout.rm_hub.math_utils does not import here")
    if answer is None:
        return Verdict(None, False, "slime" if slime else "own")
    if slime is not None:
        return Verdict(answer, any(slime(f"\\boxed{{{answer}}}", truth) for truth in truths), "slime")
    return Verdict(answer, any(is_equivalent(answer, truth, rel_tol=rel_tol) for truth in truths), "own")
