"""slime's eval datasets (`args.eval_datasets`, built by slime from `--eval-config` or `--eval-prompt-data`)
as the rollout service runs them: each with its own prompts, samples per prompt, sampling settings,
response budget, `rm_type` and `custom_rm_path`, as slime's `eval_rollout_single_dataset` reads them.

Prompts are read by slime's own `slime.utils.data.Dataset` where slime is importable (JSONL or parquet,
`path@[a:b]` slices, `--apply-chat-template` with its kwargs, tools under the tool key, images under
the multimodal keys). Where it is not, `read_prompts` reads the same files the same way. Each prompt
becomes one group of `n_samples_per_eval_prompt` Samples numbered in order, as slime numbers them.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from pathlib import Path
from typing import Any

from bridge.convert import sample_class
from bridge.service import EvalDataset, row_from_group
from bridge.settings import BridgeSettings
from engine.backends.base import SamplingParams

SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")
# EvalDatasetConfig fields that ask for something Turnstile's eval does not do; set, they are refused.
UNSUPPORTED = {
    "custom_generate_function_path": "generation runs in Turnstile's engine with the rollout's env",
    "app_service": "generation runs in Turnstile's engine, not through an app service",
    "message_processor": "slime's per-source processing is not applied by Turnstile's eval",
    "reward_model": "slime's per-source reward config is not applied; use rm_type or custom_rm_path",
    "remote_environment": "envs come from rollout_interaction_env_path",
    "eval_early_stop_remaining": "Turnstile's eval runs every prompt to its end",
    "eval_early_stop_idle_timeout": "Turnstile's eval runs every prompt to its end",
}


class EvalConfigError(ValueError):
    """An eval dataset setting Turnstile cannot honour, or a dataset that cannot be read."""


def eval_datasets(args: Any, settings: BridgeSettings) -> dict[str, EvalDataset]:
    """Every dataset of `args.eval_datasets`, ready to run; the built-in env's prompts when there are none."""
    configs = getattr(args, "eval_datasets", None) if args is not None else None
    if not configs:
        from engine.envs.arith import make_prompts

        rows = make_prompts(4, seed=1_000, vision=settings.vision)
        return {"arith": EvalDataset(rows, 1, settings.sampling, settings.max_tokens)}
    return {cfg.name: _dataset(cfg, args, settings) for cfg in configs}


def _dataset(cfg: Any, args: Any, settings: BridgeSettings) -> EvalDataset:
    for name, why in UNSUPPORTED.items():
        if getattr(cfg, name, None) is not None:
            raise EvalConfigError(f"eval dataset {cfg.name!r}: {name} is set, which Turnstile's eval refuses: {why}")
    pick = lambda field, *attrs, default=None: _pick(cfg, field, args, attrs, default)  # noqa: E731
    n = pick("n_samples_per_eval_prompt", "n_samples_per_eval_prompt", default=1)
    max_tokens = pick("max_response_len", "eval_max_response_len", "rollout_max_response_len") or settings.max_tokens
    sampling = SamplingParams(
        max_new_tokens=settings.max_new_tokens or max_tokens,
        temperature=pick("temperature", "eval_temperature", "rollout_temperature", default=1.0),
        top_p=pick("top_p", "eval_top_p", "rollout_top_p", default=1.0),
        top_k=pick("top_k", "eval_top_k", "rollout_top_k", default=-1),
        stop=tuple(pick("stop", "rollout_stop") or ()),
        stop_token_ids=tuple(pick("stop_token_ids", "rollout_stop_token_ids") or ()),
        skip_special_tokens=bool(pick("skip_special_tokens", "rollout_skip_special_tokens", default=False)),
        min_new_tokens=pick("min_new_tokens", "eval_min_new_tokens") or 0,
        repetition_penalty=pick("repetition_penalty", default=1.0),
    )
    rows = []
    numbered = itertools.count()
    for prompt in _prompts(cfg, args, settings):
        group = []
        for _ in range(n):
            sample = copy.deepcopy(prompt)
            sample.index = next(numbered)
            sample.metadata = _metadata(cfg, sample.metadata)
            sample.custom_rm_path = getattr(cfg, "custom_rm_path", None)
            group.append(sample)
        rows.append(row_from_group(group, rollout_id=-1))
    reward_key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    return EvalDataset(rows, n, sampling, max_tokens, reward_key, getattr(args, "eval_max_context_len", None))


def _pick(cfg: Any, field: str, args: Any, attrs: tuple[str, ...], default: Any) -> Any:
    """The dataset's own setting, else the first of slime's args that is set, else `default` (slime's
    `build_eval_dataset_configs` has usually resolved this already)."""
    value = getattr(cfg, field, None)
    for attr in attrs:
        if value is None:
            value = getattr(args, attr, None)
    return default if value is None else value


def _metadata(cfg: Any, metadata: Any) -> dict[str, Any]:
    """slime's `EvalDatasetConfig.inject_metadata`: the dataset's `rm_type` and metadata overrides."""
    if hasattr(cfg, "inject_metadata"):
        return cfg.inject_metadata(metadata)
    out = dict(metadata) if isinstance(metadata, dict) else {}
    if getattr(cfg, "rm_type", None) is not None:
        out["rm_type"] = cfg.rm_type
    return {**out, **(getattr(cfg, "metadata_overrides", None) or {})}


def _prompts(cfg: Any, args: Any, settings: BridgeSettings) -> list[Any]:
    """The dataset's prompts as slime Samples: read by slime's Dataset when slime imports, else here."""
    chat = _first(getattr(cfg, "apply_chat_template", None), getattr(args, "apply_chat_template", False))
    kwargs = _first(getattr(cfg, "apply_chat_template_kwargs", None), getattr(args, "apply_chat_template_kwargs", {}))
    keys = _first(getattr(cfg, "multimodal_keys", None), getattr(args, "multimodal_keys", None))
    fields = {
        "prompt_key": _first(getattr(cfg, "input_key", None), "input"),
        "label_key": getattr(cfg, "label_key", None),
        "metadata_key": _first(getattr(cfg, "metadata_key", None), "metadata"),
        "tool_key": getattr(cfg, "tool_key", None),
        "multimodal_keys": keys,
        "apply_chat_template": bool(chat),
        "apply_chat_template_kwargs": kwargs or {},
    }
    try:
        from slime.utils.data import Dataset
        from slime.utils.processing_utils import load_processor, load_tokenizer
    except ImportError:
        return read_prompts(cfg.path, settings=settings, **fields)
    checkpoint = getattr(args, "hf_checkpoint", None)
    tokenizer = load_tokenizer(checkpoint, trust_remote_code=True)
    processor = load_processor(checkpoint, trust_remote_code=True)
    max_length = getattr(args, "eval_max_prompt_len", None)
    return list(Dataset(cfg.path, tokenizer=tokenizer, processor=processor, max_length=max_length, **fields).samples)


def read_prompts(
    path: str,
    *,
    settings: BridgeSettings,
    prompt_key: str = "input",
    label_key: str | None = None,
    metadata_key: str = "metadata",
    tool_key: str | None = None,
    multimodal_keys: dict[str, str] | None = None,
    apply_chat_template: bool = False,
    apply_chat_template_kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """A prompt file (JSONL or parquet, `path@[a:b]` for a slice of its rows) as slime Samples, read the
    way slime's Dataset reads it: a string prompt becomes a user message when a template is applied or
    images come with it; `<image>` in the text takes the row's next image (under `multimodal_keys["image"]`);
    the row's tools go to `metadata["tools"]`; with `apply_chat_template` the prompt is rendered to text."""
    Sample = sample_class()
    image_key = (multimodal_keys or {}).get("image")
    renderer = _renderer(settings) if apply_chat_template else None
    samples = []
    for number, row in enumerate(_rows(path)):
        metadata = dict(row.get(metadata_key) or {})
        tools = row.get(tool_key) if tool_key else None
        if isinstance(tools, str):
            tools = json.loads(tools)
        if tools is not None:
            metadata["tools"] = list(tools)
        prompt = row.get(prompt_key)
        if prompt is None:
            raise EvalConfigError(f"{path}: row {number} has no {prompt_key!r}")
        images = list(row.get(image_key) or []) if image_key else []
        if isinstance(prompt, str) and (apply_chat_template or images):
            prompt = [{"role": "user", "content": prompt}]
        if images:
            prompt = _with_images(prompt, images, where=f"{path}: row {number}")
        if renderer is not None:
            text = renderer.apply_chat_template(
                prompt, tools=tools, tokenize=False, add_generation_prompt=True, **(apply_chat_template_kwargs or {})
            )
            prompt, multimodal = text, ({"images": images} if images else None)
        else:
            multimodal = None
        label = row.get(label_key) if label_key else None
        samples.append(Sample(prompt=prompt, label=label, metadata=metadata, multimodal_inputs=multimodal))
    return samples


def _rows(path: str) -> list[dict[str, Any]]:
    match = SLICE.match(path)
    real = match["path"] if match else path
    if not Path(real).exists():
        raise EvalConfigError(f"eval dataset {real!r} does not exist")
    if real.endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(real).read_text().splitlines() if line.strip()]
    elif real.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise EvalConfigError(f"eval dataset {real!r}: reading parquet needs pyarrow") from exc
        rows = pq.read_table(real).to_pylist()
    else:
        raise EvalConfigError(f"eval dataset {real!r}: not .jsonl or .parquet")
    if match:
        bound = lambda text: int(text) if text else None  # noqa: E731
        rows = rows[bound(match["start"]) : bound(match["stop"])]
    return rows


def _with_images(messages: list[dict[str, Any]], images: list[Any], *, where: str) -> list[dict[str, Any]]:
    """Each `<image>` in a message's text becomes an image part holding the next of `images`."""
    pending = list(images)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts: list[dict[str, Any]] = []
            for piece in re.split(r"(<image>)", content):
                if piece == "<image>":
                    if not pending:
                        raise EvalConfigError(f"{where}: more <image> placeholders than images")
                    image = pending.pop(0)
                    parts.append(image if isinstance(image, dict) else {"type": "image", "image": image})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            message = {**message, "content": parts}
        out.append(message)
    if pending:
        raise EvalConfigError(f"{where}: {len(pending)} more image(s) than <image> placeholders")
    return out


def _renderer(settings: BridgeSettings) -> Any:
    """What renders the chat template: the VLM processor for a vision model, else the tokenizer."""
    from bridge.service import _processor
    from engine.models import load_tokenizer

    processor = _processor(settings.tokenizer, vision=settings.vision)
    return processor if processor is not None else load_tokenizer(settings.tokenizer)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)
