"""Seeded geometry problems, each with a figure and an exact answer.

`generate(seed, kind)` gives the same `Problem` for the same arguments, so a prompt row only needs to
carry its seed and kind for the env to rebuild the figure it draws hints on. Kinds: the third angle of
a triangle, the hypotenuse or a leg of a right triangle (Pythagoras), the area and the circumference
of a circle, a side of a similar triangle, angles on a straight line, the base angle of an isosceles
triangle, the area of a triangle from base and height.

Answers are exact and written as LaTeX (`13`, `5\\sqrt{2}`, `25\\pi`, `\\frac{15}{2}`); `answers` adds
the value to two decimals when the exact one is not a short decimal, so a rounded answer counts too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from engine.envs.geometry.drawing import Angle, Circle, Figure, Label, Point, Segment
from engine.envs.geometry.grader import latex_fraction, latex_sqrt


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str
    question: str  # what is asked, about the figure
    description: str  # the figure in words, for a text-only model
    answer: str  # exact, LaTeX: the row's label
    value: float
    hint: str  # ASCII: it is drawn into the hint image too
    figure: Figure

    @property
    def answers(self) -> list[str]:
        """The accepted ground truths: the exact answer, and its value to two decimals when that differs."""
        rounded = f"{self.value:.2f}"
        return [self.answer] if math.isclose(float(rounded), self.value, abs_tol=1e-12) else [self.answer, rounded]


def _centre(*points: Point) -> Point:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


def _triangle(a: Point, b: Point, c: Point, names: str = "ABC") -> list[Label]:
    """The vertex letters, each pushed outwards."""
    centre = _centre(a, b, c)
    return [Label(p, name, away=centre) for p, name in zip((a, b, c), names, strict=True)]


def _from_angles(alpha: float, beta: float) -> tuple[Point, Point, Point]:
    """Triangle ABC with AB = 1 on the x axis and the given angles at A and B (degrees)."""
    gamma = math.radians(180 - alpha - beta)
    ac = math.sin(math.radians(beta)) / math.sin(gamma)
    return (0.0, 0.0), (1.0, 0.0), (ac * math.cos(math.radians(alpha)), ac * math.sin(math.radians(alpha)))


def triangle_angle(rng: random.Random) -> Problem:
    alpha = rng.randint(30, 85)
    beta = rng.randint(30, min(85, 150 - alpha))
    a, b, c = _from_angles(alpha, beta)
    items = [
        Segment(a, b),
        Segment(b, c),
        Segment(c, a),
        Angle(a, b, c, f"{alpha}°"),
        Angle(b, c, a, f"{beta}°"),
        Angle(c, a, b, "x", focus=True),
        *_triangle(a, b, c),
    ]
    return Problem(
        "triangle_angle",
        "Find the angle x at C, in degrees.",
        f"Triangle ABC has angle A = {alpha}° and angle B = {beta}°; x is the angle at C.",
        str(180 - alpha - beta),
        180 - alpha - beta,
        "The three angles of a triangle add up to 180°.",
        Figure(tuple(items)),
    )


def right_hypotenuse(rng: random.Random) -> Problem:
    legs = rng.randint(3, 12), rng.randint(3, 12)
    c, b, a = (0.0, 0.0), (float(legs[0]), 0.0), (0.0, float(legs[1]))
    items = [
        Segment(c, b, str(legs[0])),
        Segment(c, a, str(legs[1])),
        Segment(a, b, "x", focus=True),
        Angle(c, b, a, is_right=True),
        *_triangle(a, b, c),
    ]
    square = legs[0] ** 2 + legs[1] ** 2
    return Problem(
        "right_hypotenuse",
        "Find the length of the hypotenuse x.",
        f"Right triangle ABC has its right angle at C, legs BC = {legs[0]} and AC = {legs[1]}; x is the hypotenuse AB.",
        latex_sqrt(square),
        math.sqrt(square),
        "Pythagoras: a^2 + b^2 = c^2, c the side opposite the right angle.",
        Figure(tuple(items)),
    )


def right_leg(rng: random.Random) -> Problem:
    hypotenuse = rng.randint(5, 15)
    leg = rng.randint(2, hypotenuse - 2)
    other = math.sqrt(hypotenuse**2 - leg**2)
    c, b, a = (0.0, 0.0), (float(leg), 0.0), (0.0, other)
    items = [
        Segment(c, b, str(leg)),
        Segment(c, a, "x", focus=True),
        Segment(a, b, str(hypotenuse)),
        Angle(c, b, a, is_right=True),
        *_triangle(a, b, c),
    ]
    return Problem(
        "right_leg",
        "Find the length of the leg x.",
        f"Right triangle ABC has its right angle at C, hypotenuse AB = {hypotenuse} and leg BC = {leg}; x is AC.",
        latex_sqrt(hypotenuse**2 - leg**2),
        other,
        "Pythagoras: a^2 + b^2 = c^2, so a leg is sqrt(c^2 - b^2).",
        Figure(tuple(items)),
    )


def circle_area(rng: random.Random) -> Problem:
    r = rng.randint(2, 12)
    items = (Circle((0.0, 0.0), r, focus=True), Segment((0.0, 0.0), (float(r), 0.0), f"r = {r}"), Label((0, 0), "O"))
    return Problem(
        "circle_area",
        "Find the area of the circle.",
        f"A circle with centre O has radius {r}.",
        f"{r * r}\\pi",
        math.pi * r * r,
        "The area of a circle is pi * r^2.",
        Figure(items),
    )


def circle_circumference(rng: random.Random) -> Problem:
    r = rng.randint(2, 12)
    if rng.random() < 0.5:
        items = (Circle((0.0, 0.0), r, focus=True), Segment((-float(r), 0.0), (float(r), 0.0), f"d = {2 * r}"))
        given = f"diameter {2 * r}"
    else:
        items = (Circle((0.0, 0.0), r, focus=True), Segment((0.0, 0.0), (0.0, float(r)), f"r = {r}"))
        given = f"radius {r}"
    return Problem(
        "circle_circumference",
        "Find the circumference of the circle.",
        f"A circle has {given}.",
        f"{2 * r}\\pi",
        2 * math.pi * r,
        "The circumference is 2 * pi * r = pi * d.",
        Figure(items),
    )


def similar_triangles(rng: random.Random) -> Problem:
    ab, bc = rng.randint(2, 9), rng.randint(2, 9)
    de = rng.randint(ab + 1, 2 * ab)
    turn = math.radians(rng.randint(55, 80))  # the angle at B
    k = de / ab

    def shape(scale: float, dx: float) -> tuple[Point, Point, Point]:
        a, b = (dx, 0.0), (dx + ab * scale, 0.0)
        return a, b, (b[0] + bc * scale * math.cos(math.pi - turn), bc * scale * math.sin(math.pi - turn))

    a, b, c = shape(1.0, 0.0)
    d, e, f = shape(k, max(b[0], c[0]) + (ab + de) * 0.3)
    small, large = _centre(a, b, c), _centre(d, e, f)
    items = [
        Segment(a, b, str(ab), away=small),
        Segment(b, c, str(bc), away=small),
        Segment(c, a),
        *_triangle(a, b, c),
        Segment(d, e, str(de), away=large),
        Segment(e, f, "x", focus=True, away=large),
        Segment(f, d),
        *_triangle(d, e, f, "DEF"),
    ]
    answer = Fraction(bc * de, ab)
    return Problem(
        "similar_triangles",
        "Triangle ABC is similar to triangle DEF. Find x = EF.",
        f"Triangle ABC is similar to triangle DEF, with AB = {ab}, BC = {bc} and DE = {de}; x is EF.",
        latex_fraction(answer),
        float(answer),
        "Similar triangles: EF / BC = DE / AB.",
        Figure(tuple(items)),
    )


def line_angles(rng: random.Random) -> Problem:
    given = rng.randint(25, 155)
    o, p, q = (0.0, 0.0), (-1.0, 0.0), (1.0, 0.0)
    r = (math.cos(math.radians(given)), math.sin(math.radians(given)))
    items = (
        Segment(p, q),
        Segment(o, r),
        Angle(o, q, r, f"{given}°"),
        Angle(o, r, p, "x", focus=True),
        Label(p, "P", away=o),
        Label(q, "Q", away=o),
        Label(r, "R", away=o),
        Label(o, "O", away=(0.0, 1.0)),
    )
    return Problem(
        "line_angles",
        "P, O and Q lie on a straight line. Find the angle x, in degrees.",
        f"P, O and Q lie on a straight line; the ray OR makes angle ROQ = {given}°; x is angle POR.",
        str(180 - given),
        180 - given,
        "Angles on a straight line add up to 180°.",
        Figure(items),
    )


def isosceles_base(rng: random.Random) -> Problem:
    apex = 2 * rng.randint(10, 70)
    base = (180 - apex) // 2
    b, c = (-1.0, 0.0), (1.0, 0.0)
    a = (0.0, math.tan(math.radians(base)))
    items = [
        Segment(a, b, ticks=1),
        Segment(a, c, ticks=1),
        Segment(b, c),
        Angle(a, b, c, f"{apex}°"),
        Angle(b, c, a, "x", focus=True),
        *_triangle(a, b, c),
    ]
    return Problem(
        "isosceles_base",
        "AB = AC. Find the angle x at B, in degrees.",
        f"Triangle ABC has AB = AC and angle A = {apex}°; x is the angle at B.",
        str(base),
        base,
        "The base angles of an isosceles triangle are equal; all three add up to 180°.",
        Figure(tuple(items)),
    )


def triangle_area(rng: random.Random) -> Problem:
    base, height = rng.randint(4, 14), rng.randint(3, 12)
    foot = round(base * rng.uniform(0.25, 0.75), 2)
    a, b, c, h = (0.0, 0.0), (float(base), 0.0), (foot, float(height)), (foot, 0.0)
    items = [
        Segment(a, b, str(base), focus=True),
        Segment(b, c),
        Segment(c, a),
        Segment(c, h, str(height), focus=True, dashed=True),
        Angle(h, b, c, is_right=True),
        *_triangle(a, b, c),
    ]
    answer = Fraction(base * height, 2)
    return Problem(
        "triangle_area",
        "Find the area of triangle ABC.",
        f"Triangle ABC has base AB = {base} and height {height} from C to AB.",
        latex_fraction(answer),
        float(answer),
        "The area of a triangle is base * height / 2.",
        Figure(tuple(items)),
    )


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    fn.__name__: fn
    for fn in (
        triangle_angle,
        right_hypotenuse,
        right_leg,
        circle_area,
        circle_circumference,
        similar_triangles,
        line_angles,
        isosceles_base,
        triangle_area,
    )
}
KINDS = tuple(GENERATORS)


def generate(seed: int, kind: str | None = None) -> Problem:
    """The problem for `seed`, of `kind` (one of KINDS; None: drawn from the seed)."""
    rng = random.Random(seed)
    kind = kind if kind is not None else rng.choice(KINDS)
    if kind not in GENERATORS:
        raise ValueError(f"unknown geometry problem kind {kind!r}; one of {', '.join(KINDS)}")
    return GENERATORS[kind](rng)
