"""Images on both sides of a rollout.

Rollout side: `image_payload` turns an image into what SGLang's `/generate` takes in `image_data`
(a `data:image/png;base64,...` string, as slime sends it). PNG encoding is the costliest step of an
image turn (tens of milliseconds for a 448x448 photo), so `ImagePayloads` keeps each payload by the
image's pixels: an image is encoded once however many trajectories (a group's shared prompt image),
turns or re-renders carry it. Training side: a `TrainInputBuffer` collects each turn's processor
outputs (`pixel_values`, `image_grid_thw`, ...) and merges them once at the end, one `torch.cat` per
key, instead of re-concatenating the growing tensors every turn. torch is not imported here: a tensor
can only come from a caller that has imported it (a processor, the local backend), and until then no
value is one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from PIL import Image, UnidentifiedImageError

from engine.errors import ObservationError

# Processor outputs that are per token of the text, not per image: they are rebuilt from the token
# ids by the trainer and are never part of the train inputs.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
PER_TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"})


def load_image(source: Any, *, what: str = "image") -> Image.Image:
    """An RGB PIL image from a PIL image, raw bytes, a file path, or a (data-URL) base64 string.

    Raises ObservationError naming `what` and the reason when the source does not decode.
    """
    if isinstance(source, Image.Image):
        image = source
    else:
        try:
            image = Image.open(io.BytesIO(_image_bytes(source)))
            image.load()
        except (OSError, ValueError, binascii.Error, UnidentifiedImageError, Image.DecompressionBombError) as exc:
            raise ObservationError(f"{what} does not decode ({_describe(source)}): {exc}") from exc
    return image if image.mode == "RGB" else image.convert("RGB")


def image_payload(image: Image.Image) -> str:
    """The `image_data` entry SGLang takes for one image: a PNG as a base64 data URL."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


DEFAULT_PAYLOAD_CACHE_BYTES = 256 << 20
K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """A mapping bounded by the total `size` of its values (default `len`), least recently used out first. A
    value larger than the bound is not kept. Thread-safe."""

    def __init__(self, max_bytes: int, size: Callable[[V], int] = len):
        self.max_bytes, self._size_of = max_bytes, size
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        return self._size

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V) -> None:
        size = self._size_of(value)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._size += size - (old[1] if old else 0)
            self._entries[key] = (value, size)
            while self._size > self.max_bytes:
                self._size -= self._entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._size = 0


class ImagePayloads:
    """`image_payload` with a memory: each distinct image (by mode, size and pixels) is encoded once while
    its payload stays in the cache. A payload string is shared by every trajectory that carries the image,
    so the cache costs no copy while they hold it.

    Bounded by `max_bytes` of payload text, least recently used out first. Thread-safe: encodes run
    outside the lock, and a thread asking for an image another thread is encoding waits for that
    payload instead of encoding it again. `encodes` counts the images actually encoded.

        payloads = ImagePayloads()
        payloads(image)        # "data:image/png;base64,...", encoded on the first call only
    """

    def __init__(self, max_bytes: int = DEFAULT_PAYLOAD_CACHE_BYTES):
        self.encodes = 0
        self._cache: BoundedCache[tuple, str] = BoundedCache(max_bytes)
        self._pending: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def __call__(self, image: Image.Image) -> str:
        key = _pixels_key(image)
        while True:
            with self._lock:
                payload = self._cache.get(key)
                if payload is not None:
                    return payload
                pending = self._pending.get(key)
                if pending is None:
                    self._pending[key] = threading.Event()
                    break
            pending.wait()  # another thread is encoding this image: take its payload (or encode, if it failed)
        try:
            payload = image_payload(image)
            with self._lock:
                self.encodes += 1
                self._cache.put(key, payload)
        finally:
            with self._lock:
                self._pending.pop(key).set()
        return payload

    def clear(self) -> None:
        self._cache.clear()


def _pixels_key(image: Image.Image) -> tuple:
    """What the payload of `image` depends on: its mode, size and pixels (hashed; blake2b releases the GIL)."""
    return image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).digest()


def _image_bytes(source: Any) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, Path):
        return source.read_bytes()
    if not isinstance(source, str):
        raise ValueError(f"unsupported image type {type(source).__name__}")
    if source.startswith("data:"):
        _, _, data = source.partition(",")
        return base64.b64decode(data, validate=True)
    if len(source) < 1024 and (Path(source).is_file() or source.lower().endswith(IMAGE_SUFFIXES)):
        return Path(source).read_bytes()  # a missing file raises "No such file or directory"
    return base64.b64decode(source, validate=True)


def _describe(source: Any) -> str:
    text = repr(source) if not isinstance(source, (bytes, bytearray)) else f"{len(source)} bytes"
    return text if len(text) <= 60 else text[:57] + "..."


class TrainInputBuffer:
    """Per-turn processor outputs, merged once at the end.

    Merge rule per key: tensors are concatenated along dim 0 (one `torch.cat`); lists and tuples
    are concatenated; any other value (0-d tensors and numpy arrays included) must be equal in every
    turn that has the key and is kept once. Turns that disagree, or give different kinds of value
    for one key, are an error naming the key. Keys in PER_TOKEN_KEYS are never collected.
    """

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: dict[str, list[Any]] = {}

    def add(self, inputs: dict[str, Any] | None) -> None:
        for key, value in (inputs or {}).items():
            if value is not None and key not in PER_TOKEN_KEYS:
                self._parts.setdefault(key, []).append(value)

    def __len__(self) -> int:
        return max((len(v) for v in self._parts.values()), default=0)

    def merge(self) -> dict[str, Any] | None:
        """The merged train inputs, or None when no turn had any."""
        if not self._parts:
            return None
        return {key: _merge_values(key, values) for key, values in self._parts.items()}


def _merge_values(key: str, values: list[Any]) -> Any:
    kinds = {_kind(v) for v in values}
    if len(kinds) > 1:
        raise TypeError(f"train input {key!r}: turns give different kinds of value ({', '.join(sorted(kinds))})")
    kind, first = kinds.pop(), values[0]
    if kind == "tensor":
        import torch  # already imported: the values are its tensors

        try:
            return first if len(values) == 1 else torch.cat(values, dim=0)
        except RuntimeError as exc:
            raise ValueError(f"train input {key!r}: per-turn tensors do not concatenate: {exc}") from exc
    if kind == "list":
        return [item for value in values for item in value]
    if any(not _equal(v, first) for v in values[1:]):
        raise ValueError(f"train input {key!r}: turns disagree on a non-tensor value ({values!r:.200})")
    return first


def _kind(value: Any) -> str:
    torch = sys.modules.get("torch")  # None until something imports torch; until then no value is a tensor
    if torch is not None and isinstance(value, torch.Tensor) and value.dim() > 0:
        return "tensor"
    return "list" if isinstance(value, (list, tuple)) else "other"


def _equal(a: Any, b: Any) -> bool:
    if hasattr(a, "shape") or hasattr(b, "shape"):  # tensors and numpy arrays compare element-wise
        return getattr(a, "shape", None) == getattr(b, "shape", None) and bool((a == b).all())
    return bool(a == b)
