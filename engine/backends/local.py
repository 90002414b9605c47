"""The embedded default backend: a transformers model served in process, with SGLang's semantics.

    async with LocalBackend.from_name("tiny-qwen2") as backend:
        result = await backend.generate(prompt_ids, SamplingParams(max_new_tokens=32, temperature=0))

One serving loop owns the model. Each pass it prefills the requests that arrived since the last step
(left-padded, as one batch) or else decodes one token for every running row; the step runs in a
worker thread, and between steps the rows that are done resolve their callers at once. New requests
join the running batch at a step boundary (continuous batching): their KV cache is prefilled on its
own, left-padded to a common width and concatenated along the batch. That is exact because every row
carries its own positions (cached keys already hold their rotary phase) and attention mask, so a
short request never waits behind a long one and a row's output does not depend on its company.
Caches of other layer types (sliding window, linear attention) are never merged: new requests then
wait for the running batch to drain. Qwen2.5-VL prefills take their 3D rope positions from the
model's `get_rope_index`; decoded tokens are text, one position after the row's last.

Off the event loop: every model step and weight load runs in a worker thread, and so does image
processing (decoding each payload, the image processor). A request carries every image of its
conversation each turn; each image's `pixel_values` and `image_grid_thw` are kept by its payload
(bounded by `vision_cache_bytes`), so an image is decoded and processed once, not once per turn.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.backends.base import STREAM_BROKEN, FinishReason, GenerateResult, SamplingParams, TokenListener, notify
from engine.backends.sampling import sample
from engine.errors import BackendError, ErrorClass, ObservationError
from engine.multimodal import BoundedCache, load_image

DEFAULT_VISION_CACHE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class LocalBackendStatistics:
    num_requests: int = 0  # admitted
    num_finished: int = 0  # resolved with a result, aborts included
    num_aborted: int = 0  # abort(), a cancelled caller, aclose()
    num_failed: int = 0  # resolved with BackendError(SERVER) from a failed model step (or, streamed, STREAM_BROKEN)
    num_batches: int = 0  # prefills: groups of requests that started or joined the running batch
    num_steps: int = 0  # model steps, prefills included
    largest_batch: int = 0  # most rows running together
    num_generated_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0


@dataclass(eq=False, slots=True)
class _Request:
    input_ids: list[int]
    params: SamplingParams
    rid: str | None
    stop_ids: frozenset[int]
    vision: dict[str, torch.Tensor] | None  # pixel_values, image_grid_thw
    on_tokens: TokenListener | None = None  # None once it raised
    is_streamed: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    result: GenerateResult | BackendError | None = None


@dataclass(slots=True)
class _Batch:
    """Running rows and their model state; row i of every tensor belongs to rows[i]."""

    rows: list[_Request] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [rows, cached tokens], 0 on left padding
    next_pos: torch.Tensor | None = None  # [rows] position of each row's next token
    last: torch.Tensor | None = None  # [rows] the token sampled last: the next decode input

    def select(self, keep: list[int]) -> _Batch:
        """The kept rows, without the left columns none of them attends to."""
        if len(keep) == len(self.rows) or not keep:
            return self if keep else _Batch()
        index = torch.tensor(keep)
        mask = self.mask[index]
        start = int(mask.any(0).int().argmax())
        cache = DynamicCache([(kv.keys[index, :, start:], kv.values[index, :, start:]) for kv in self.cache.layers])
        return _Batch([self.rows[i] for i in keep], cache, mask[:, start:], self.next_pos[index], self.last[index])

    def concat(self, other: _Batch) -> _Batch:
        """Both batches as one, the narrower left-padded to the wider."""
        if not self.rows:
            return other
        width = max(self.mask.shape[1], other.mask.shape[1])
        pad = lambda t: F.pad(t, (0, 0, width - t.shape[-2], 0))  # noqa: E731  [rows, heads, tokens, dim]
        cache = DynamicCache([
            (torch.cat([pad(a.keys), pad(b.keys)]), torch.cat([pad(a.values), pad(b.values)]))
            for a, b in zip(self.cache.layers, other.cache.layers, strict=True)
        ])  # fmt: skip
        mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        pos, last = torch.cat([self.next_pos, other.next_pos]), torch.cat([self.last, other.last])
        return _Batch(self.rows + other.rows, cache, mask, pos, last)

    @property
    def is_joinable(self) -> bool:
        return self.cache is None or all(type(layer) is DynamicLayer for layer in self.cache.layers)


class LocalBackend:
    """The Backend protocol over an in-process transformers causal LM (text, or Qwen2.5-VL with `processor`).
    It streams: a request's listener gets each token as the step that made it ends, on the event loop."""

    streams = True

    def __init__(
        self,
        model,
        tokenizer,
        *,
        processor=None,
        max_batch_size: int = 64,
        weight_version: str = "0",
        vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES,
    ):
        self._model, self._tokenizer, self._processor = model.eval(), tokenizer, processor
        self._vision: BoundedCache[str, dict[str, torch.Tensor]] = BoundedCache(vision_cache_bytes, _tensor_bytes)
        self._max_batch_size, self._weight_version = max_batch_size, weight_version
        self._image_token_id = getattr(model.config, "image_token_id", None)
        self._rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
        # the KV cache's argument, read off the model's class (a wrapped instance forward would hide it): `cache`
        # from transformers 5.24 (`past_key_values` is deprecated there, gone in 5.40), before it `past_key_values`
        # (slime's image: 5.12.1)
        params = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._batch = _Batch()
        self._waiting: list[_Request] = []
        self._live: set[_Request] = set()  # unresolved requests: waiting, prefilling or running
        self._counts: dict[str, int] = {}
        self._model_lock = anyio.Lock()  # held by each model step and each weight update
        self._is_paused = self._is_serving = False

    @classmethod
    def from_name(cls, name: str = "tiny-qwen2", **kwargs: Any) -> LocalBackend:
        """Model, tokenizer and (for a VLM) processor by engine.models name or path."""
        from engine.models import TINY_MODELS, is_vision_model, load_model, load_processor, load_tokenizer

        if is_vision_model(name):
            processor = load_processor("qwen2.5-vl" if name in TINY_MODELS else name)
            return cls(load_model(name), processor.tokenizer, processor=processor, **kwargs)
        return cls(load_model(name), load_tokenizer("qwen2.5" if name in TINY_MODELS else name), **kwargs)

    async def __aenter__(self) -> LocalBackend:
        self._exit_stack = AsyncExitStack()
        task_group = await self._exit_stack.enter_async_context(anyio.create_task_group())
        self._serve_scope, self._wakeup, self._is_serving = anyio.CancelScope(), anyio.Event(), True
        task_group.start_soon(self._serve, name="LocalBackend serving loop")
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        await self.aclose()
        return await self._exit_stack.__aexit__(*exc_info)

    async def aclose(self) -> None:
        """Stop serving; unresolved requests return what they have with finish_reason `abort`."""
        if self._is_serving:
            self._is_serving = False
            await self.abort()
            self._serve_scope.cancel()

    async def generate(
        self, input_ids: Sequence[int], sampling_params: SamplingParams, image_data: Sequence[str] | None = None,
        *, rid: str | None = None, session_id: str | None = None, on_tokens: TokenListener | None = None,
    ) -> GenerateResult:  # fmt: skip
        """One model serves every request, so `session_id` changes nothing. `on_tokens` gets each token as it is
        made (in `_postprocess`, on the event loop, before the request resolves)."""
        if refused := sampling_params.unsupported_locally():
            raise BackendError(ErrorClass.CLIENT, f"the local backend cannot honour {', '.join(refused)}")
        ids = [int(t) for t in input_ids]
        if not ids or min(ids) < 0 or max(ids) >= self._model.config.get_text_config().vocab_size:
            raise BackendError(ErrorClass.CLIENT, f"input_ids must be non-empty vocabulary ids ({len(ids)} given)")
        vision = await self._encode_images(ids, list(image_data or ()))
        if not self._is_serving:
            raise BackendError(ErrorClass.CONNECTION, "local backend is not serving (not entered, or closed)")
        eos = set() if sampling_params.ignore_eos else {self._tokenizer.eos_token_id} - {None}
        stop_ids = frozenset(sampling_params.stop_token_ids) | eos
        request = _Request(ids, sampling_params, rid, stop_ids, vision, on_tokens, is_streamed=on_tokens is not None)
        self._waiting.append(request)
        self._live.add(request)
        self._count("num_requests")
        self._wakeup.set()
        try:
            await request.done.wait()
        finally:
            self._finish(request, "abort")  # no-op once resolved; a cancelled caller's row is dropped
        if isinstance(request.result, BackendError):
            raise request.result
        return request.result

    async def abort(self, rid: str | None = None) -> None:
        for request in list(self._live):
            if rid is None or request.rid == rid:
                self._finish(request, "abort")

    async def pause(self) -> None:
        """Stop decoding once the step in progress (awaited here) ends; requests keep their state."""
        self._is_paused = True
        async with self._model_lock:
            pass

    async def resume(self) -> None:
        self._is_paused = False
        self._wakeup.set()

    async def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: str) -> None:
        """Load (part of) a state dict between two steps; results report `weight_version` from then on."""
        async with self._model_lock:
            await anyio.to_thread.run_sync(self._load_weights, state_dict)
            self._weight_version = weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """SGLang's `update_weights_from_disk`, for the local model: every `*.safetensors` file of a saved
        Hugging Face model directory (a trainer's `save_pretrained`), loaded between two steps."""
        state_dict = await anyio.to_thread.run_sync(read_safetensors, Path(model_path))
        await self.update_weights(state_dict, weight_version)

    async def weight_version(self) -> str | None:
        return self._weight_version

    async def health(self) -> bool:
        return self._is_serving

    async def health_problem(self) -> str | None:
        return None if self._is_serving else "the local model has stopped serving"

    def statistics(self) -> LocalBackendStatistics:
        num_waiting = sum(not r.done.is_set() for r in self._waiting)
        num_running = len(self._live) - num_waiting
        return LocalBackendStatistics(**self._counts, num_waiting=num_waiting, num_running=num_running)

    # -- serving loop: schedule, step, post-process ------------------------------------------

    async def _serve(self) -> None:
        with self._serve_scope:
            while True:
                await self._wait_for_work()
                async with self._model_lock:
                    joining, keep = self._schedule()
                    rows = joining or [self._batch.rows[i] for i in keep]
                    try:
                        self._batch, tokens, logprobs = await anyio.to_thread.run_sync(self._step, keep, joining)
                    except Exception as exc:  # a failed step fails its rows, never the loop
                        self._fail(rows, exc, reset=not joining)
                        continue
                self._count("num_steps")
                self._count("num_batches", int(bool(joining)))
                self._counts["largest_batch"] = max(self._counts.get("largest_batch", 0), len(self._batch.rows))
                self._postprocess(rows, tokens, logprobs)

    async def _wait_for_work(self) -> None:
        while self._is_paused or not self._live:
            if not self._live:
                self._batch = _Batch()  # free the cache while idle
            self._wakeup = anyio.Event()
            await self._wakeup.wait()

    def _schedule(self) -> tuple[list[_Request], list[int]]:
        """Waiting requests to prefill now (up to the free rows; none while an unmergeable batch
        runs), and the indices of the running rows to keep."""
        keep = [i for i, r in enumerate(self._batch.rows) if not r.done.is_set()]
        self._waiting = [r for r in self._waiting if not r.done.is_set()]
        room = self._max_batch_size - len(keep) if self._batch.is_joinable or not keep else 0
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        return joining, keep

    @torch.inference_mode()
    def _step(self, keep: list[int], joining: list[_Request]) -> tuple[_Batch, list[int], list[float]]:
        """In a worker thread: prefill `joining` and merge it into the batch, or decode every row."""
        batch = self._batch.select(keep)
        new, logits = self._prefill(joining) if joining else (batch, self._decode(batch))
        new.last, logprobs = sample(logits, [r.params for r in new.rows])
        return (batch.concat(new) if joining else batch), new.last.tolist(), logprobs.tolist()

    def _prefill(self, rows: list[_Request]) -> tuple[_Batch, torch.Tensor]:
        width = max(len(r.input_ids) for r in rows)
        ids = torch.tensor([[0] * (width - len(r.input_ids)) + r.input_ids for r in rows])
        mask = torch.tensor([[0] * (width - len(r.input_ids)) + [1] * len(r.input_ids) for r in rows])
        images = [r.vision for r in rows if r.vision]
        vision = {key: torch.cat([v[key] for v in images]) for key in images[0]} if images else {}
        if vision and self._rope_index is not None:  # (temporal, height, width) positions of image pads
            mm_types = (ids == self._image_token_id).int()
            positions = self._rope_index(ids, mm_types, image_grid_thw=vision["image_grid_thw"], attention_mask=mask)[0]
        else:
            positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
            **{self._cache_arg: cache},
            logits_to_keep=1, **vision,
        ).logits[:, -1]  # fmt: skip
        next_pos = positions.view(-1, len(rows), width).amax(dim=(0, 2)) + 1
        return _Batch(list(rows), cache, mask, next_pos), logits

    def _decode(self, batch: _Batch) -> torch.Tensor:
        batch.mask = F.pad(batch.mask, (0, 1), value=1)
        logits = self._model(
            input_ids=batch.last[:, None], attention_mask=batch.mask, position_ids=batch.next_pos[:, None],
            use_cache=True, **{self._cache_arg: batch.cache},
        ).logits[:, -1]  # fmt: skip
        batch.next_pos = batch.next_pos + 1
        return logits

    def _postprocess(self, rows: list[_Request], tokens: list[int], logprobs: list[float]) -> None:
        """On the event loop: append each row's token (to its listener too); resolve the rows that are done now,
        not at the end of the batch."""
        for request, token, logprob in zip(rows, tokens, logprobs, strict=True):
            if request.done.is_set():  # aborted or cancelled during the step
                continue
            request.token_ids.append(token)
            request.logprobs.append(logprob)
            self._count("num_generated_tokens")
            request.on_tokens = notify(request.on_tokens, [token])
            if token in request.stop_ids or self._hits_stop_string(request):
                self._finish(request, "stop")
            elif len(request.token_ids) >= request.params.max_new_tokens:
                self._finish(request, "length")

    # -- resolving requests ------------------------------------------------------------------

    def _finish(self, request: _Request, outcome: FinishReason | BackendError, *, broken: str | None = None) -> None:
        """Resolve `request`, once: with what it generated and finish reason `outcome`, or with the error; `broken`:
        why a streamed request ends here as an abort (`meta[STREAM_BROKEN]`)."""
        if request.done.is_set():
            return
        failed = isinstance(outcome, BackendError)
        request.result = outcome if failed else GenerateResult(
            token_ids=list(request.token_ids), logprobs=list(request.logprobs), text=self._text(request, outcome),
            finish_reason=outcome, weight_version=self._weight_version, prompt_tokens=len(request.input_ids),
            meta={} if broken is None else {STREAM_BROKEN: broken},
        )  # fmt: skip
        self._live.discard(request)
        self._count("num_failed" if failed or broken else "num_finished")
        self._count("num_aborted", int(outcome == "abort" and not broken))
        request.done.set()

    def _fail(self, rows: list[_Request], exc: Exception, *, reset: bool) -> None:
        """A failed step fails its rows: SERVER errors, but a streamed row that has tokens ends as a broken stream
        with them (its listener has them; the caller goes on from them)."""
        error = BackendError(ErrorClass.SERVER, f"local model step failed: {type(exc).__name__}: {exc}")
        for request in rows:
            if request.is_streamed and request.token_ids:
                self._finish(request, "abort", broken=error.message)
            else:
                self._finish(request, error)
        if reset:
            self._batch = _Batch()

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    def _text(self, request: _Request, reason: FinishReason) -> str:
        ids, stop = request.token_ids, request.params.stop
        if reason == "stop" and ids and ids[-1] in request.stop_ids:
            ids = ids[:-1]
        text = self._tokenizer.decode(ids, skip_special_tokens=request.params.skip_special_tokens)
        if reason == "stop":  # the text ends before a matched stop string, as SGLang trims it
            text = text[: min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))]
        return text

    def _hits_stop_string(self, request: _Request) -> bool:
        if not (stop := request.params.stop):
            return False
        tail = request.token_ids[-(max(map(len, stop)) + 8) :]  # a just-completed stop string lies in here
        text = self._tokenizer.decode(tail, skip_special_tokens=request.params.skip_special_tokens)
        return any(s in text for s in stop)

    # -- inputs and weights ------------------------------------------------------------------

    async def _encode_images(self, ids: list[int], image_data: list[str]) -> dict[str, torch.Tensor] | None:
        """pixel_values / image_grid_thw of the images (in a worker thread), checked against the image pads in `ids`."""
        if image_data and self._processor is None:
            raise BackendError(ErrorClass.CLIENT, f"{len(image_data)} image(s) sent to a text-only model")
        if self._processor is None or self._image_token_id is None:
            return None
        if not image_data and self._image_token_id not in ids:
            return None
        vision = await anyio.to_thread.run_sync(self._process_images, image_data) if image_data else None
        pads = [len(list(run)) for token, run in groupby(ids) if token == self._image_token_id]
        merge = self._model.config.vision_config.spatial_merge_size
        needed = (vision["image_grid_thw"].prod(-1) // merge**2).tolist() if vision else []
        if pads != needed:
            raise BackendError(
                ErrorClass.CLIENT,
                f"image count mismatch: input_ids hold {len(pads)} image(s) ({sum(pads)} image pads), "
                f"image_data has {len(image_data)} image(s) needing {sum(needed)}",
            )
        return vision

    def _process_images(self, image_data: list[str]) -> dict[str, torch.Tensor]:
        """In a worker thread: each image's processor outputs, from the cache or decoded and processed now (the
        image processor treats the images of a batch one by one, so per image is the same)."""
        parts = []
        for i, data in enumerate(image_data):
            vision = self._vision.get(data)
            if vision is None:
                try:
                    image = load_image(data, what=f"image_data[{i}]")
                except ObservationError as exc:
                    raise BackendError(ErrorClass.CLIENT, exc.message) from exc
                out = self._processor.image_processor(images=[image], return_tensors="pt")
                vision = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
                self._vision.put(data, vision)
            parts.append(vision)
        if len(parts) == 1:
            return dict(parts[0])
        return {key: torch.cat([part[key] for part in parts]) for key in ("pixel_values", "image_grid_thw")}

    def _load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        if unknown := sorted(set(state_dict) - set(self._model.state_dict())):
            raise BackendError(ErrorClass.CLIENT, f"update_weights: unknown parameters {unknown[:5]}")
        self._model.load_state_dict(state_dict, strict=False)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files in `path`, one state dict."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BackendError(ErrorClass.CLIENT, f"update_weights_from_disk: no *.safetensors file in {path}")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(file))
    return state_dict


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
