"""Geometry figures as data, drawn with PIL.

A `Figure` is a tuple of primitives (segments, circles, angle marks, labels) in figure units with y
pointing up; `render` fits it into an image. The same figure gives every picture the env shows: the
problem as asked, the same with the unknown highlighted and a hint written under it, and a zoom on the
unknown. Items marked `focus` are the unknown: they are what the highlight colours and the zoom frames.

    figure = Figure((Segment((0, 0), (4, 0), label="4"), Segment((0, 0), (0, 3), label="3"),
                     Segment((4, 0), (0, 3), label="x", focus=True)))
    render(figure)                                   # the problem's image
    render(figure, highlight=True, hint="a^2 + b^2 = c^2")
    render(figure, highlight=True, zoom=True)        # the unknown, enlarged
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

Point = tuple[float, float]
DEFAULT_SIZE = (224, 224)
INK, FOCUS_INK, HINT_INK = "black", (220, 30, 30), (20, 20, 160)


@dataclass(frozen=True, slots=True)
class Segment:
    a: Point
    b: Point
    label: str = ""
    focus: bool = False
    dashed: bool = False
    ticks: int = 0  # equal-length marks across the middle
    away: Point | None = None  # the label goes on the side away from here (default: the figure's centre)


@dataclass(frozen=True, slots=True)
class Circle:
    center: Point
    radius: float
    focus: bool = False


@dataclass(frozen=True, slots=True)
class Angle:
    """The angle at `vertex` between the rays towards `p` and `q` (the one under 180°)."""

    vertex: Point
    p: Point
    q: Point
    label: str = ""
    focus: bool = False
    is_right: bool = False  # drawn as a small square


@dataclass(frozen=True, slots=True)
class Label:
    """Text at `at`, pushed away from `away` (a figure's centre, for vertex letters)."""

    at: Point
    text: str
    away: Point | None = None
    focus: bool = False


Item = Segment | Circle | Angle | Label


@dataclass(frozen=True, slots=True)
class Figure:
    items: tuple[Item, ...]

    def points(self) -> list[Point]:
        """Every point the drawing must show (a circle by its bounding box)."""
        out: list[Point] = []
        for item in self.items:
            if isinstance(item, Segment):
                out += [item.a, item.b]
            elif isinstance(item, Circle):
                (x, y), r = item.center, item.radius
                out += [(x - r, y - r), (x + r, y + r)]
            elif isinstance(item, Angle):
                out.append(item.vertex)
            else:
                out.append(item.at)
        return out


@lru_cache(maxsize=8)
def font(size: int) -> ImageFont.FreeTypeFont:
    """PIL's bundled font (ASCII and the degree sign; no pi or root signs: write `pi`, `sqrt`)."""
    return ImageFont.load_default(size=size)


def render(
    figure: Figure,
    size: tuple[int, int] = DEFAULT_SIZE,
    *,
    labels: bool = True,
    highlight: bool = False,
    hint: str | None = None,
    zoom: bool = False,
) -> Image.Image:
    """The figure drawn black on white. `highlight`: the focus items in red; `hint`: text in blue under
    the figure; `zoom`: the region around the focus items, enlarged to the full size."""
    width, height = size
    text_size = max(10, width // 16)
    hint_size = max(9, text_size - 2)
    band = _hint_lines(hint, width, hint_size) if hint else []
    figure_height = height - len(band) * (hint_size + 3) - (6 if band else 0)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    to_pixels = _fit(figure.points(), (width, figure_height), margin=max(text_size * 2, width // 7))
    centre = _centre([to_pixels(p) for p in figure.points()])
    painter = _Painter(draw, to_pixels, centre, text_size, labels=labels, highlight=highlight)
    for item in figure.items:
        painter.paint(item)
    for i, line in enumerate(band):
        draw.text((6, figure_height + 3 + i * (hint_size + 3)), line, fill=HINT_INK, font=font(hint_size))
    if zoom:
        image = _zoom(image, [to_pixels(p) for p in _focus_points(figure)], figure_height)
    return image


def _hint_lines(hint: str, width: int, text_size: int) -> list[str]:
    per_line = max(8, int((width - 12) / (text_size * 0.55)))
    return textwrap.wrap(hint, per_line)[:4]


def _fit(points: list[Point], size: tuple[int, int], margin: int):
    """A map from figure units (y up) to pixels (y down) that fits `points` inside `size` less `margin`."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    span_x, span_y = max(xs) - min(xs) or 1.0, max(ys) - min(ys) or 1.0
    scale = min((size[0] - 2 * margin) / span_x, (size[1] - 2 * margin) / span_y)
    left = (size[0] - span_x * scale) / 2 - min(xs) * scale
    top = (size[1] - span_y * scale) / 2 + max(ys) * scale
    return lambda p: (left + p[0] * scale, top - p[1] * scale)


def _centre(points: list[tuple[float, float]]) -> tuple[float, float]:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


def _focus_points(figure: Figure) -> list[Point]:
    focus = Figure(tuple(item for item in figure.items if item.focus))
    return focus.points() or figure.points()


def _zoom(image: Image.Image, points: list[tuple[float, float]], figure_height: int) -> Image.Image:
    """The square around `points` (at least half the figure's side, padded), resized to the image's size."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    side = max(max(xs) - min(xs), max(ys) - min(ys)) + image.width * 0.2
    side = min(max(side, min(image.width, figure_height) / 2), image.width, figure_height)
    cx, cy = (min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2
    left = min(max(cx - side / 2, 0), image.width - side)
    top = min(max(cy - side / 2, 0), figure_height - side)
    box = (round(left), round(top), round(left + side), round(top + side))
    return image.crop(box).resize(image.size, Image.Resampling.LANCZOS)


class _Painter:
    """Draws one item at a time in pixel space."""

    def __init__(self, draw: ImageDraw.ImageDraw, to_pixels, centre, text_size: int, *, labels: bool, highlight: bool):
        self.draw, self.to_pixels, self.centre, self.text_size = draw, to_pixels, centre, text_size
        self.labels, self.highlight = labels, highlight

    def paint(self, item: Item) -> None:
        ink = FOCUS_INK if self.highlight and item.focus else INK
        width = 3 if self.highlight and item.focus else 2
        if isinstance(item, Segment):
            self._segment(item, ink, width)
        elif isinstance(item, Circle):
            (x, y), r = (
                self.to_pixels(item.center),
                abs(self.to_pixels((item.radius, 0))[0] - self.to_pixels((0, 0))[0]),
            )
            self.draw.ellipse((x - r, y - r, x + r, y + r), outline=ink, width=width)
            self.draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=INK)
        elif isinstance(item, Angle):
            self._angle(item, ink, width)
        elif self.labels:
            self._label(item, ink)

    def _segment(self, item: Segment, ink, width: int) -> None:
        (ax, ay), (bx, by) = self.to_pixels(item.a), self.to_pixels(item.b)
        if item.dashed:
            for i in range(0, 20, 2):
                t0, t1 = i / 20, (i + 1) / 20
                self.draw.line(
                    (ax + (bx - ax) * t0, ay + (by - ay) * t0, ax + (bx - ax) * t1, ay + (by - ay) * t1),
                    fill=ink,
                    width=width,
                )
        else:
            self.draw.line((ax, ay, bx, by), fill=ink, width=width)
        length = math.hypot(bx - ax, by - ay) or 1.0
        nx, ny = -(by - ay) / length, (bx - ax) / length  # unit normal
        mx, my = (ax + bx) / 2, (ay + by) / 2
        for k in range(item.ticks):
            shift = (k - (item.ticks - 1) / 2) * 5
            tx, ty = mx + (bx - ax) / length * shift, my + (by - ay) / length * shift
            self.draw.line((tx - nx * 6, ty - ny * 6, tx + nx * 6, ty + ny * 6), fill=ink, width=2)
        if self.labels and item.label:
            ox, oy = self.centre if item.away is None else self.to_pixels(item.away)
            side = 1 if (mx - ox) * nx + (my - oy) * ny >= 0 else -1
            gap = self.text_size * 0.9
            self._text((mx + side * nx * gap, my + side * ny * gap), item.label, ink)

    def _angle(self, item: Angle, ink, width: int) -> None:
        vx, vy = self.to_pixels(item.vertex)
        a1 = math.degrees(math.atan2(self.to_pixels(item.p)[1] - vy, self.to_pixels(item.p)[0] - vx))
        a2 = math.degrees(math.atan2(self.to_pixels(item.q)[1] - vy, self.to_pixels(item.q)[0] - vx))
        span = (a2 - a1) % 360
        start, span = (a1, span) if span <= 180 else (a2, 360 - span)
        radius = self.text_size * 1.2
        if item.is_right:
            u = (math.cos(math.radians(start)), math.sin(math.radians(start)))
            v = (math.cos(math.radians(start + span)), math.sin(math.radians(start + span)))
            s = radius * 0.6
            corner = [
                (vx + u[0] * s, vy + u[1] * s),
                (vx + (u[0] + v[0]) * s, vy + (u[1] + v[1]) * s),
                (vx + v[0] * s, vy + v[1] * s),
            ]
            self.draw.line(corner, fill=ink, width=width)
        else:
            box = (vx - radius, vy - radius, vx + radius, vy + radius)
            self.draw.arc(box, start=start, end=start + span, fill=ink, width=width)
        if self.labels and item.label:
            middle = math.radians(start + span / 2)
            gap = radius + self.text_size * (0.9 if span > 40 else 1.6)
            self._text((vx + math.cos(middle) * gap, vy + math.sin(middle) * gap), item.label, ink)

    def _label(self, item: Label, ink) -> None:
        x, y = self.to_pixels(item.at)
        if item.away is not None:
            ox, oy = self.to_pixels(item.away)
            length = math.hypot(x - ox, y - oy) or 1.0
            x, y = x + (x - ox) / length * self.text_size * 0.9, y + (y - oy) / length * self.text_size * 0.9
        self._text((x, y), item.text, ink)

    def _text(self, at: tuple[float, float], text: str, ink) -> None:
        self.draw.text(at, text, fill=ink, font=font(self.text_size), anchor="mm")
