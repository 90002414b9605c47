"""The embedded model under slime's disk weight path: with no SGLang engine (`--rollout-num-gpus 0`), the
model at `--hf-checkpoint` generates, and each step first loads the newest `weight_vNNNNNN` the trainer
wrote into `--update-weight-disk-dir` (scripts/slime_loop.sh drives this with slime's own train.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bridge.flags import FlagError, check_args
from bridge.service import RolloutService
from bridge.settings import BridgeSettings, settings_from_args
from bridge.slime import EmbeddedSource
from engine.backends.local import LocalBackend
from engine.errors import BackendError, ErrorClass
from engine.models import load_model, load_tokenizer


def save_flipped(target: Path, scale: float = -1.0) -> torch.Tensor:
    """The tiny model with its final norm scaled (argmax and argmin trade places at -1), saved as a trainer
    would; returns the norm it holds."""
    model = load_model("tiny-qwen2")
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    model.save_pretrained(target, safe_serialization=True)
    return model.model.norm.weight.detach().clone()


@pytest.mark.anyio
async def test_update_weights_from_disk_loads_a_saved_model_and_refuses_a_directory_without_weights(tmp_path):
    tokenizer = load_tokenizer()
    model = load_model("tiny-qwen2")
    ids = tokenizer("What is 2 + 3?")["input_ids"]
    norm = save_flipped(tmp_path / "weight_v000001")
    from engine.backends.base import SamplingParams

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    async with LocalBackend(model, tokenizer) as local:
        before = await local.generate(ids, greedy)
        await local.update_weights_from_disk(str(tmp_path / "weight_v000001"), "1")
        after = await local.generate(ids, greedy)
        assert torch.equal(model.model.norm.weight, norm)
        (tmp_path / "empty").mkdir()
        with pytest.raises(BackendError) as excinfo:
            await local.update_weights_from_disk(str(tmp_path / "empty"), "2")
        assert excinfo.value.error_class is ErrorClass.CLIENT and "no *.safetensors" in str(excinfo.value)
        assert await local.weight_version() == "1"
    assert (before.weight_version, after.weight_version) == ("0", "1")
    assert after.token_ids != before.token_ids


def test_each_step_loads_the_newest_weights_written_and_not_an_earlier_runs(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    save_flipped(weights / "weight_v000009", scale=3.0)  # an earlier run's, numbered higher
    past = time.time() - 3600
    os.utime(weights / "weight_v000009", (past, past))
    norm_1 = save_flipped(weights / "weight_v000001")  # what this run's trainer pushed before step 0
    settings = BridgeSettings.embedded(2).model_copy(update={"weights_dir": str(weights)})
    service = RolloutService(settings)
    source = EmbeddedSource(n_samples_per_prompt=2)
    try:
        first = service.rollout(0, 2, source.get_samples(service.wanted(2)))
        assert torch.equal(service.backend._model.model.norm.weight, norm_1)
        norm_2 = save_flipped(weights / "weight_v000002", scale=-0.5)
        second = service.rollout(1, 2, source.get_samples(service.wanted(2)))
        assert torch.equal(service.backend._model.model.norm.weight, norm_2)
        third = service.rollout(2, 2, source.get_samples(service.wanted(2)))  # nothing new: nothing loaded
    finally:
        service.shutdown()
    versions = lambda out: {v for group in out.samples for s in group for v in s.weight_versions}  # noqa: E731
    assert versions(first) == {"1"}
    assert versions(second) == {"2"} and versions(third) == {"2"}


def slime_args(tmp_path: Path, **overrides) -> SimpleNamespace:
    values = {
        "rollout_num_gpus": 0, "rollout_external": False, "sglang_router_ip": "127.0.0.1", "sglang_router_port": 3000,
        "hf_checkpoint": str(tmp_path / "model"), "update_weight_mode": "full", "update_weight_transport": "disk",
        "update_weight_disk_dir": str(tmp_path / "weights"), "update_weight_disk_keep_files": True,
    }  # fmt: skip
    return SimpleNamespace(**(values | overrides))


def test_with_no_sglang_engine_the_model_slime_trains_generates_and_loads_its_weights(tmp_path):
    load_tokenizer().save_pretrained(tmp_path / "model")
    settings = settings_from_args(slime_args(tmp_path))
    assert settings.url is None and settings.backend is None  # the embedded local backend
    assert settings.model == str(tmp_path / "model") and settings.weights_dir == str(tmp_path / "weights")
    check_args(slime_args(tmp_path))
    external = settings_from_args(slime_args(tmp_path, rollout_external=True))
    assert external.url == "http://127.0.0.1:3000" and external.weights_dir is None
    engines = settings_from_args(slime_args(tmp_path, rollout_num_gpus=2))
    assert engines.url == "http://127.0.0.1:3000" and engines.model == "tiny-qwen2"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"update_weight_transport": "nccl"}, "--update-weight-transport 'nccl'"),
        ({"update_weight_mode": "delta"}, "--update-weight-mode 'delta'"),
        ({"update_weight_disk_keep_files": False}, "--update-weight-disk-keep-files is not set"),
    ],
)
def test_with_no_sglang_engine_a_weight_path_the_embedded_model_cannot_follow_is_refused(tmp_path, overrides, named):
    with pytest.raises(FlagError, match="cannot run with these slime flags") as excinfo:
        check_args(slime_args(tmp_path, **overrides))
    assert named in str(excinfo.value)
