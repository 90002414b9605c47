"""The answer forms the geometry grader is held to: (what the model wrote, the ground truth, the verdict).

The env's own rule (`grader.is_equivalent`) gives `is_correct` on every row. slime's `--rm-type math` rule
gives the same verdict except on the rows with `slime_differs`, which says why it gives the other one.
tests/test_geometry_env.py checks the own rule on the table; scripts/geometry_grader_vs_slime.py checks
slime's, from a slime checkout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AnswerForm:
    given: str
    truth: str
    is_correct: bool
    slime_differs: str | None = None  # why slime's rule gives the other verdict; None: it agrees


ANSWER_FORMS: tuple[AnswerForm, ...] = (
    # integers, with the notation around them
    AnswerForm("42", "42", True),
    AnswerForm("$42$", "42", True),
    AnswerForm("42.0", "42", True),
    AnswerForm("x = 42", "42", True),
    AnswerForm("42^\\circ", "42", True),
    AnswerForm("42^{\\circ}", "42", True),
    AnswerForm("42 degrees", "42", True),
    AnswerForm("42°", "42", True, "its rule keeps the unicode degree sign, so '42°' is not a number"),
    AnswerForm("13 cm", "13", True),
    AnswerForm("\\text{13 units}", "13", True, "it keeps the word 'units' inside \\text{}"),
    AnswerForm("1,000", "1000", True),
    AnswerForm("43", "42", False),
    AnswerForm("42.5", "42", False),
    AnswerForm("41.99", "42", False),
    AnswerForm("\\frac{84}{2}", "42", False),
    AnswerForm("", "42", False),
    AnswerForm("forty-two", "42", False),
    # fractions and decimals
    AnswerForm("\\frac{15}{2}", "\\frac{15}{2}", True),
    AnswerForm("\\dfrac{15}{2}", "\\frac{15}{2}", True),
    AnswerForm("15/2", "\\frac{15}{2}", True),
    AnswerForm("7.5", "\\frac{15}{2}", True),
    AnswerForm("\\frac{30}{4}", "\\frac{15}{2}", False),
    AnswerForm("\\frac12", "\\frac{1}{2}", True),
    AnswerForm("0.5", "\\frac{1}{2}", True),
    AnswerForm("7.4", "\\frac{15}{2}", False),
    AnswerForm("6.67", "\\frac{20}{3}", True, "a rounded decimal equals a fraction only within a tolerance"),
    AnswerForm("6.7", "\\frac{20}{3}", False),
    # square roots
    AnswerForm("5\\sqrt{2}", "5\\sqrt{2}", True),
    AnswerForm("5 \\sqrt{2}", "5\\sqrt{2}", True),
    AnswerForm("\\sqrt{50}", "5\\sqrt{2}", True),
    AnswerForm("5\\sqrt2", "5\\sqrt{2}", True),
    AnswerForm("5*sqrt(2)", "5\\sqrt{2}", True),
    AnswerForm("7.07", "5\\sqrt{2}", True, "a rounded decimal equals a root only within a tolerance"),
    AnswerForm("7.07", "7.07", True),
    AnswerForm("7.1", "5\\sqrt{2}", False),
    AnswerForm("4\\sqrt{2}", "5\\sqrt{2}", False),
    AnswerForm("\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt{2}}{2}", True),
    AnswerForm("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", True),
    # multiples of pi
    AnswerForm("25\\pi", "25\\pi", True),
    AnswerForm("25 \\pi", "25\\pi", True),
    AnswerForm("$25\\pi$", "25\\pi", True),
    AnswerForm("\\pi \\cdot 25", "25\\pi", True),
    AnswerForm("25\\pi \\text{ cm}^2", "25\\pi", True),
    AnswerForm("78.54", "25\\pi", True, "a rounded decimal equals a multiple of pi only within a tolerance"),
    AnswerForm("78.54", "78.54", True),
    AnswerForm("78", "25\\pi", False),
    AnswerForm("24\\pi", "25\\pi", False),
    AnswerForm("\\frac{25\\pi}{2}", "\\frac{25\\pi}{2}", True),
    AnswerForm("12.5\\pi", "\\frac{25\\pi}{2}", True),
)


def disagreements(rule: Callable[[str, str], bool], *, is_slime: bool) -> list[tuple[AnswerForm, bool]]:
    """The rows where `rule(given, truth)` is not the table's verdict for it (slime's where `is_slime`), with
    the verdict it gave; empty when it agrees on every row."""
    out = []
    for form in ANSWER_FORMS:
        expected = form.is_correct if not (is_slime and form.slime_differs) else not form.is_correct
        verdict = bool(rule(form.given, form.truth))
        if verdict != expected:
            out.append((form, verdict))
    return out
