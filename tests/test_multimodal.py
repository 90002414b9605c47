"""Images for the backend (payload and loading) and the train-input buffer merged once at the end."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.errors import ErrorClass, ObservationError
from engine.multimodal import BoundedCache, ImagePayloads, TrainInputBuffer, image_payload, load_image


@pytest.fixture
def image() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, size=(24, 40, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.mode == b.mode == "RGB" and np.array_equal(np.asarray(a), np.asarray(b))


# -- images ----------------------------------------------------------------------------------------


def test_payload_round_trip_keeps_pixels(image):
    payload = image_payload(image)
    assert payload.startswith("data:image/png;base64,")
    assert same_pixels(load_image(payload), image)


def test_load_image_from_bare_base64_bytes_and_file(image, tmp_path):
    data = png_bytes(image)
    path = tmp_path / "obs.png"
    path.write_bytes(data)
    sources = [base64.b64encode(data).decode(), data, bytearray(data), str(path), Path(path), image]
    for source in sources:
        assert same_pixels(load_image(source), image), type(source).__name__


def test_load_image_converts_to_rgb(image):
    assert same_pixels(load_image(png_bytes(image.convert("RGBA"))), image)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (b"not an image at all", "cannot identify image file"),
        ("data:image/png;base64,!!!", "Only base64 data is allowed"),
        (Path("/no/such/dir/obs.png"), "No such file"),
        ("/no/such/dir/obs.png", "No such file"),
        (12345, "unsupported image type int"),
    ],
)
def test_undecodable_image_is_observation_error_naming_what(source, reason):
    with pytest.raises(ObservationError) as caught:
        load_image(source, what="turn 3 image")
    assert caught.value.error_class is ErrorClass.BAD_OBSERVATION
    assert caught.value.message.startswith("turn 3 image does not decode (")
    assert reason in caught.value.message


def test_truncated_png_is_observation_error(image):
    data = png_bytes(image)
    with pytest.raises(ObservationError, match=r"observation image does not decode \(\d+ bytes\)"):
        load_image(data[: len(data) // 2], what="observation image")


# -- TrainInputBuffer ------------------------------------------------------------------------------


@pytest.fixture
def cat_calls(monkeypatch) -> list[int]:
    """Counts torch.cat calls; each entry is how many tensors one call joined."""
    calls: list[int] = []
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting_cat)
    return calls


def turn(rows: int, grid: tuple[int, int, int]) -> dict:
    return {
        "pixel_values": torch.full((rows, 1176), float(rows)),
        "image_grid_thw": torch.tensor([grid]),
        "input_ids": torch.ones(1, 7, dtype=torch.long),
        "attention_mask": torch.ones(1, 7, dtype=torch.long),
        "mm_token_type_ids": torch.zeros(1, 7, dtype=torch.long),
        "second_per_grid_ts": [1.0],
        "patch_size": 14,
    }


def test_merge_concatenates_once_per_key(cat_calls):
    buffer = TrainInputBuffer()
    for rows, grid in [(16, (1, 4, 4)), (48, (1, 6, 8)), (4, (1, 2, 2))]:
        buffer.add(turn(rows, grid))
    assert len(buffer) == 3 and cat_calls == []  # nothing is joined while turns arrive
    merged = buffer.merge()
    assert cat_calls == [3, 3]  # pixel_values and image_grid_thw, each in one call
    assert set(merged) == {"pixel_values", "image_grid_thw", "second_per_grid_ts", "patch_size"}
    assert merged["pixel_values"].shape == (68, 1176)
    assert merged["pixel_values"][:, 0].tolist() == [16.0] * 16 + [48.0] * 48 + [4.0] * 4
    assert merged["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8], [1, 2, 2]]
    assert merged["second_per_grid_ts"] == [1.0, 1.0, 1.0]
    assert merged["patch_size"] == 14


def test_single_turn_needs_no_cat(cat_calls):
    buffer = TrainInputBuffer()
    buffer.add(turn(16, (1, 4, 4)))
    assert buffer.merge()["pixel_values"].shape == (16, 1176) and cat_calls == []


def test_unequal_scalars_name_the_key():
    buffer = TrainInputBuffer()
    buffer.add({"patch_size": 14})
    buffer.add({"patch_size": 16})
    with pytest.raises(ValueError, match="train input 'patch_size': turns disagree"):
        buffer.merge()


def test_tensor_mixed_with_other_value_names_the_key():
    buffer = TrainInputBuffer()
    buffer.add({"pixel_values": torch.zeros(2, 3)})
    buffer.add({"pixel_values": [[0.0, 0.0, 0.0]]})
    with pytest.raises(TypeError, match="train input 'pixel_values'"):
        buffer.merge()


def test_numpy_and_zero_dim_values_follow_the_equality_rule():
    buffer = TrainInputBuffer()
    buffer.add({"patch": np.array([14, 14]), "scale": torch.tensor(2.0)})
    buffer.add({"patch": np.array([14, 14]), "scale": torch.tensor(2.0)})
    merged = buffer.merge()
    assert merged["patch"].tolist() == [14, 14] and float(merged["scale"]) == 2.0
    buffer.add({"patch": np.array([28, 28])})
    with pytest.raises(ValueError, match="'patch': turns disagree"):
        buffer.merge()


def test_a_list_then_a_tensor_for_one_key_names_the_key():
    buffer = TrainInputBuffer()
    buffer.add({"sizes": [1, 2]})
    buffer.add({"sizes": torch.ones(2)})
    with pytest.raises(TypeError, match="'sizes': turns give different kinds of value"):
        buffer.merge()


def test_tensors_that_do_not_concatenate_name_the_key():
    buffer = TrainInputBuffer()
    buffer.add({"pixel_values": torch.ones(4, 3)})
    buffer.add({"pixel_values": torch.ones(4, 5)})
    with pytest.raises(ValueError, match="'pixel_values': per-turn tensors do not concatenate"):
        buffer.merge()


def test_empty_buffer_merges_to_none():
    buffer = TrainInputBuffer()
    assert buffer.merge() is None
    buffer.add(None)
    buffer.add({})
    buffer.add({"input_ids": torch.ones(1, 3), "attention_mask": torch.ones(1, 3), "pixel_values": None})
    assert len(buffer) == 0 and buffer.merge() is None


def test_real_processor_outputs_merge_to_one_row_per_patch(processor):
    """Two turns with images of different sizes: one row of pixel_values per patch of image_grid_thw."""
    buffer = TrainInputBuffer()
    for size in [(56, 56), (112, 84)]:
        outputs = processor(
            text=["<|vision_start|><|image_pad|><|vision_end|>What is shown?"],
            images=[Image.new("RGB", size, "white")],
            return_tensors="pt",
        )
        buffer.add(dict(outputs))
    merged = buffer.merge()
    assert set(merged) == {"pixel_values", "image_grid_thw"}
    grids = merged["image_grid_thw"]
    assert grids.shape == (2, 3) and grids[0].tolist() != grids[1].tolist()
    assert merged["pixel_values"].shape[0] == int(grids.prod(dim=-1).sum())


# -- bounded caches ------------------------------------------------------------------------------------


def test_bounded_cache_evicts_the_least_recently_used_and_keeps_its_size():
    cache = BoundedCache(max_bytes=10)
    cache.put("a", "xxxx")
    cache.put("b", "yyyy")
    assert cache.get("a") == "xxxx"  # now "b" is the least recently used
    cache.put("c", "zzzz")
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == ("xxxx", None, "zzzz")
    assert (len(cache), cache.size) == (2, 8)
    cache.put("a", "xx")  # replacing a value counts its new size
    assert cache.size == 6
    cache.put("huge", "h" * 11)  # larger than the bound: not kept, nothing evicted
    assert (cache.get("huge"), len(cache), cache.size) == (None, 2, 6)
    cache.clear()
    assert (len(cache), cache.size, cache.get("a")) == (0, 0, None)


def test_image_payloads_equal_image_payload(image):
    payloads = ImagePayloads()
    assert payloads(image) == image_payload(image)
    assert payloads(image.convert("RGBA")) == image_payload(image.convert("RGBA"))  # the mode is part of the key
    assert payloads.encodes == 2
