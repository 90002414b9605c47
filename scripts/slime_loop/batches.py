"""What the CPU trainer does to slime's rollout data and its weights that needs nothing of slime (tested
without a checkout in tests/test_slime_loop.py)."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


def windows(data: dict[str, Any]) -> None:
    """Each sample cut to its response and the one prompt token before it (`full_tokens` keeps the whole
    sample for the forward). slime's loss and log-prob code read the logits of response positions only
    (`logits[start - 1 : end - 1]` of each sample), so the loss is the same; what is saved is the
    151,936-way output layer, its log-softmax and entropy over the prompt's positions."""
    data["full_tokens"] = data["tokens"]
    data["tokens"] = [t[-(r + 1) :] for t, r in zip(data["tokens"], data["response_lengths"], strict=True)]
    data["total_lengths"] = [r + 1 for r in data["response_lengths"]]


def window_logits(model: Any, full_tokens: list[torch.Tensor], window_lengths: list[int]) -> torch.Tensor:
    """[1, sum(window_lengths), V] float32 logits: each sample's last `window_lengths[i]` positions, laid end to
    end as Megatron's packed forward lays out samples. One padded forward for the whole micro-batch (padding on
    the right, so no sample's positions or attention change); only the windows' hidden states go through the
    output layer."""
    lengths = [len(t) for t in full_tokens]
    ids = torch.zeros(len(full_tokens), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(full_tokens):
        ids[i, : len(t)], mask[i, : len(t)] = t, 1
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    kept = torch.cat([hidden[i, n - w : n] for i, (n, w) in enumerate(zip(lengths, window_lengths, strict=True))])
    return model.get_output_embeddings()(kept).float().unsqueeze(0)


def freeze(model: torch.nn.Module, args: Any) -> None:
    """slime's `--only-train-params-name-list` and `--freeze-params-name-list` (regexes, `re.search` on each
    parameter's name), applied in slime's order (megatron_utils/model_provider.py `freeze_model_params`): the
    first leaves only what it matches trainable, then the second freezes what it matches. The names are the
    Hugging Face model's (`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`), not
    Megatron's. Raises ValueError when nothing is left to train."""
    only, frozen = getattr(args, "only_train_params_name_list", None), getattr(args, "freeze_params_name_list", None)
    for name, param in model.named_parameters():
        if only:
            param.requires_grad = any(re.search(pattern, name) for pattern in only)
        if frozen and any(re.search(pattern, name) for pattern in frozen):
            param.requires_grad = False
    if not any(param.requires_grad for param in model.parameters()):
        raise ValueError(
            f"--only-train-params-name-list {only} / --freeze-params-name-list {frozen} leave no parameter to train"
        )


def invert_loss_masks(data: dict[str, Any]) -> None:
    """The negative control: loss mask 1 where the environment wrote and 0 where the model did, with
    `rollout_mask_sums` recomputed by slime's rule (each rollout's mask total)."""
    data["loss_masks"] = [1 - m for m in data["loss_masks"]]
    if "rollout_mask_sums" in data:
        totals: dict[Any, float] = {}
        for rid, mask in zip(data["rollout_ids"], data["loss_masks"], strict=True):
            totals[rid] = totals.get(rid, 0.0) + float(mask.sum())
        data["rollout_mask_sums"] = torch.tensor([totals[rid] for rid in data["rollout_ids"]], dtype=torch.float32)


def save_hf(model: Any, target: Path) -> None:
    """`save_pretrained` into a sibling temporary directory, then renamed: a reader never sees half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
