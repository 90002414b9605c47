"""What one request may ask of the gateway: bounds on its body, its tools and its images, each checked before the
work it bounds is done (a body before it is read whole, an image before it is decoded), so that a request past
one is refused with one error naming it and costs next to nothing.

    limits = GatewayLimits(max_body_bytes=16 << 20)
    check_tools(tools, limits)        # RequestError: too many, too large, nested too deep
    check_messages(messages, limits)  # RequestError: a message nested too deep
    check_images(messages, limits)    # RequestError: not a data: URL, too many, too many pixels, no image
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from typing import Any

import orjson
from PIL import Image, UnidentifiedImageError

from engine.agents.history import digest
from engine.agents.request import RequestError
from engine.encoding import images_of
from engine.multimodal import BoundedCache

DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,", re.ASCII)


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """Bounds on one request. Anthropic's own API takes bodies up to 32 MB and 100 images a request."""

    max_body_bytes: int = 16 << 20  # larger: 413, before the body is read
    max_tools: int = 512
    max_tools_bytes: int = 2 << 20  # the tools' JSON schemas, serialized
    max_schema_depth: int = 48  # nesting of a tool's schema (a template renders it recursively)
    max_message_depth: int = 64  # nesting of a message, its calls' arguments included (the same, and it is copied)
    max_images: int = 100  # per request (every image of the conversation so far)
    max_image_pixels: int = 4096 * 4096  # per image, read from its header before it is decoded
    max_request_pixels: int = 128 * 1024 * 1024  # every image of the request together
    max_image_aspect: float = 200.0  # an image's longer side over its shorter (Qwen2-VL's processor takes no more)


def check_tools(tools: list[dict[str, Any]] | None, limits: GatewayLimits) -> None:
    """RequestError where the tools are more, larger or nested deeper than `limits` allow."""
    if not tools:
        return
    if len(tools) > limits.max_tools:
        raise RequestError(f"tools: {len(tools)} tools, more than the {limits.max_tools} a request may offer")
    for i, tool in enumerate(tools):
        if _depth(tool) > limits.max_schema_depth:
            raise RequestError(
                f"tools[{i}]: its schema is nested deeper than {limits.max_schema_depth} levels", param=f"tools.{i}"
            )
    size = len(orjson.dumps(tools))
    if size > limits.max_tools_bytes:
        raise RequestError(f"tools: {size} bytes of tool definitions, more than {limits.max_tools_bytes}")


def check_messages(messages: list[dict[str, Any]], limits: GatewayLimits) -> None:
    """RequestError where a message nests lists and objects deeper than `limits` allow: a template renders it
    recursively (a call's arguments through `tojson`), and the processor copies it, so a deeper one would fail
    its chain rather than the request."""
    for number, message in enumerate(messages, 1):
        if _depth(message) > limits.max_message_depth:
            raise RequestError(
                f"message {number} of the conversation is nested deeper than {limits.max_message_depth} levels"
            )


def check_images(
    messages: list[dict[str, Any]], limits: GatewayLimits, decoded: BoundedCache[str, bool] | None = None
) -> None:
    """RequestError where an image is not a `data:` URL (the gateway reads no file and fetches no URL), where the
    request holds more images than `limits.max_images`, where an image, or all of them together, would decode
    to more pixels than allowed, or is shaped past `limits.max_image_aspect` (each read from its header), and
    then, once within every bound, where an image does not decode whole (a truncated one, whose header reads: it
    would fail its chain when encoded). `decoded`: the digests of images that decoded before (a conversation
    sends its images again with every request), not decoded again."""
    images = images_of(messages)
    if len(images) > limits.max_images:
        raise RequestError(f"the request holds {len(images)} images, more than {limits.max_images}")
    total = 0
    for number, image in enumerate(images, 1):
        if not (isinstance(image, str) and DATA_URL.match(image)):
            raise RequestError(
                f"image {number} is not a data: URL (data:image/<type>;base64,...): the gateway takes images inline "
                "only, and reads no file and fetches no URL"
            )
        width, height = _size(image, number)
        if width * height > limits.max_image_pixels:
            raise RequestError(
                f"image {number} is {width}x{height} pixels, more than {limits.max_image_pixels} pixels an image"
            )
        if min(width, height) < 1 or max(width, height) / min(width, height) > limits.max_image_aspect:
            raise RequestError(
                f"image {number} is {width}x{height} pixels: one side more than {limits.max_image_aspect:g} times the "
                "other"
            )
        total += width * height
    if total > limits.max_request_pixels:
        raise RequestError(f"the request's images hold {total} pixels, more than {limits.max_request_pixels}")
    for number, image in enumerate(images, 1):
        _decode(image, number, decoded)


def _size(url: str, number: int) -> tuple[int, int]:
    try:
        data = base64.b64decode(url.partition(",")[2], validate=True)
        with Image.open(io.BytesIO(data)) as image:  # the header only: nothing is decoded yet
            return image.size
    except Image.DecompressionBombError as exc:  # past twice PIL's own bound, refused as it opened
        raise RequestError(f"image {number} has too many pixels: {exc}") from None
    except (binascii.Error, ValueError, OSError, UnidentifiedImageError) as exc:
        raise RequestError(f"image {number} does not decode: {exc}") from None


def _decode(url: str, number: int, decoded: BoundedCache[str, bool] | None) -> None:
    seen = digest(url)
    if decoded is not None and decoded.get(seen):
        return
    try:
        with Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))) as image:
            image.load()
    except (ValueError, OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise RequestError(f"image {number} does not decode: {exc}") from None
    if decoded is not None:
        decoded.put(seen, True)


def _depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (iteratively: a hostile schema cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest
