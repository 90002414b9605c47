"""Prompt and observation encoding by delta tokens, exact for templates that only append.

A trajectory is built turn by turn: the prompt's tokens, then per turn the model's tokens up to and
including its end-of-turn token, then the observation's tokens. For this to equal a full re-render
of the conversation, the observation must carry everything the chat template writes after the
model's end-of-turn token (Qwen's newline after `<|im_end|>`, the next role header, the generation
prompt). So an observation is encoded as the text of

    render(DUMMY_MESSAGES + [observation], add_generation_prompt=True)

(without the dummy system message for a template that refuses the system role)
after the dummy assistant's end-of-turn token. That cut is found once per (encoder, observation
role) and cached; each turn only the observation's suffix is tokenized, so the system prompt and
the tools preamble appear once. Tokenizing the suffix alone is exact because the cut falls right
after an added token, where tokenizers split anyway.

Templates that rewrite history (Qwen3 drops earlier `<think>` blocks) cannot be exact: the
trajectory keeps what the model saw, and `drift_check` re-renders the whole conversation and
names the first turn where the two differ.

    encoder = ChatEncoder(tokenizer)                       # or ChatEncoder(processor.tokenizer, processor=processor)
    prompt = encoder.encode_prompt(messages)               # Encoded(token_ids, image_data, train_inputs)
    obs = encoder.encode_observation({"role": "user", "content": "Wrong, try again."})

From the event loop, call the async variants: `await encoder.aencode_prompt(...)`,
`await encoder.aencode_observation(message)`, `await encoder.adrift_check(trajectory)`. Each runs its
sync twin in a worker thread when the work is heavy (images: decoding, the processor, PNG encoding,
all of which release the GIL; or text past `INLINE_MAX_CHARS`, whose tokenization does too), inline
otherwise, where a thread hop (about 65 us) would cost more than it frees. Results, and exceptions,
are the sync twin's.

Thread-safety (checked against transformers 5.24, tokenizers 0.23, Jinja2 3.1): one encoder may run in
several threads at once. A fast tokenizer's encode only reads the Rust tokenizer as long as nobody changes
its truncation or padding settings (the encoder never does, and its constructor makes the one call that
settles them); the processor and the image processor keep no state across calls; transformers compiles a
chat template once (an lru_cache) and Jinja renders a compiled template without shared state (the
assistant-mask tracker lives in a ContextVar). The encoder's own caches (dummy-prefix cut per role, tool
variants, image payloads) are filled idempotently or under a lock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from engine.errors import ObservationError
from engine.multimodal import ImagePayloads, load_image

if TYPE_CHECKING:
    from engine.trajectory import Trajectory

ASSISTANT_SENTINEL = "I am the assistant of this dummy conversation."
DUMMY_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": ASSISTANT_SENTINEL},
)
# Text up to this many characters is encoded on the event loop by the async variants: below it the thread
# hop costs more loop time than the tokenizer's share of the work frees (benchmarks/payloads.py measures it).
INLINE_MAX_CHARS = 4096
CHARS_PER_TOKEN = 4  # about, for English text: a drift check of INLINE_MAX_CHARS / 4 tokens runs inline
# Images shared by every encoder that is not given its own cache.
SHARED_PAYLOADS = ImagePayloads()


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids for the trajectory, images for the backend, processor outputs for the trainer."""

    token_ids: list[int]
    image_data: list[str] = field(default_factory=list)
    train_inputs: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class DriftReport:
    """Where the turn-by-turn trajectory and a full re-render of its conversation first differ.

    `turn` is the index of the turn holding the first difference (None: the prompt), `part` is
    "prompt", "generated" or "observation". `trailing` counts render tokens past the trajectory's
    end (the template's separator after the last end-of-turn token), which are not a difference.
    """

    exact: bool
    position: int | None = None
    turn: int | None = None
    part: str | None = None
    expected: str = ""  # full render around the difference, decoded
    actual: str = ""  # trajectory around the difference, decoded
    trailing: int = 0

    def describe(self) -> str:
        if self.exact:
            return "exact: the trajectory equals the full re-render"
        where = "the prompt" if self.turn is None else f"turn {self.turn} ({self.part})"
        return (
            f"drift at token {self.position}, in {where}: render has {self.expected!r}, trajectory has {self.actual!r}"
        )


class ChatEncoder:
    """Encodes prompts and observations for one tokenizer (or VLM processor), tool set and template kwargs."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        processor: Any = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        payloads: ImagePayloads | None = None,
    ):
        self.tokenizer = tokenizer
        self.processor = processor
        self.tools = tools
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.payloads = SHARED_PAYLOADS if payloads is None else payloads  # image -> backend payload, encoded once
        self._renderer = processor if processor is not None else tokenizer
        if not getattr(self._renderer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
            raise ValueError(f"tokenizer {name!r} has no chat template; set one (chat_template=...) before encoding")
        self._prefix: dict[str, str] = {}  # observation role -> dummy text up to the end-of-turn token
        self._with_tools: dict[str, ChatEncoder] = {}  # tools (as JSON) -> an encoder that renders them
        self._dummy = self._dummy_conversation()
        self.end_of_turn_id, self._end_of_turn_text = self._find_end_of_turn()
        self.vision_token_ids = self._find_vision_tokens()

    # -- public ---------------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end the model's turn: the template's end-of-turn token and the tokenizer's EOS."""
        eos = self.tokenizer.eos_token_id
        return tuple(dict.fromkeys(t for t in (self.end_of_turn_id, eos) if t is not None))

    @property
    def image_token_id(self) -> int | None:
        """The token an image expands into (`<|image_pad|>` for Qwen-VL); None without a VLM processor."""
        return getattr(self.processor, "image_token_id", None) if self.processor is not None else None

    def for_tools(self, tools: list[dict[str, Any]] | None) -> ChatEncoder:
        """This encoder, or one like it that renders `tools` (a prompt's own tool set, as slime's
        `--tool-key` puts it in `metadata["tools"]`) into every prompt and observation; cached per tool set."""
        if not tools or tools == self.tools:
            return self
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._with_tools:
            self._with_tools[key] = ChatEncoder(
                self.tokenizer,
                processor=self.processor,
                tools=tools,
                chat_template_kwargs=self.template_kwargs,
                payloads=self.payloads,
            )
        return self._with_tools[key]

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self._renderer.apply_chat_template(
            self._for_template(messages),
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def encode_prompt(self, prompt: list[dict[str, Any]] | str, images: list[Any] | None = None) -> Encoded:
        """The prompt with the generation prompt appended, as the model will first see it. A string is
        a prompt already rendered with the chat template (slime's `--apply-chat-template`), encoded as
        it is, with `images` for its image pads."""
        if isinstance(prompt, str):
            return self._encode_text(prompt, list(images or []))
        return self._encode_text(
            self.render(prompt, add_generation_prompt=True), _images_of(prompt) + list(images or [])
        )

    def encode_observation(self, message: dict[str, Any]) -> Encoded:
        """The tokens that follow the model's end-of-turn token: separator, the observation, the next
        generation prompt."""
        text = self.render([*self._dummy, message], add_generation_prompt=True)
        prefix = self._prefix_for(message)
        if not text.startswith(prefix):  # the template renders the dummy turns differently for this message
            prefix = text[: self._cut(text)]
        return self._encode_text(text[len(prefix) :], _images_of([message]))

    def closing_ids(self, generated: list[int]) -> list[int]:
        """What to put before an observation when the model's turn did not end with its end-of-turn
        token (a stop string, say): that token, so the trajectory still matches the template."""
        return [] if generated and generated[-1] == self.end_of_turn_id else [self.end_of_turn_id]

    def assistant_text(self, generated: list[int]) -> str:
        """The model's turn as message content for a re-render: decoded, end-of-turn token dropped."""
        return self._decode_turn(generated, skip_special_tokens=False)

    def response_text(self, generated: list[int], *, skip_special_tokens: bool = True) -> str:
        """The model's turn as the env reads it, as SGLang's `text` has it (special tokens skipped unless
        the request said otherwise); its end-of-turn token is dropped either way."""
        return self._decode_turn(generated, skip_special_tokens=skip_special_tokens)

    def _decode_turn(self, generated: list[int], *, skip_special_tokens: bool) -> str:
        if generated and generated[-1] in self.stop_token_ids:
            generated = generated[:-1]
        return self.tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)

    def drift_check(self, trajectory: Trajectory) -> DriftReport:
        """Re-render the trajectory's whole conversation and compare it with its tokens (its prompt must
        be chat messages, not text rendered elsewhere)."""
        if isinstance(trajectory.prompt, str):
            raise ValueError("drift_check needs the prompt as chat messages; this trajectory's was rendered text")
        messages = list(trajectory.prompt)
        for turn in trajectory.turns:
            messages.append(
                {"role": "assistant", "content": self.assistant_text(trajectory.generated_ids(turn).tolist())}
            )
            if turn.observation is not None:
                messages.append(turn.observation)
        ends_with_observation = bool(trajectory.turns) and trajectory.turns[-1].observation is not None
        render = self._encode_text(
            self.render(messages, add_generation_prompt=ends_with_observation or not trajectory.turns),
            _images_of(messages),
            payloads=False,  # the token ids are compared; the backend's copies of the images are not needed
        ).token_ids
        actual = trajectory.tokens.tolist()
        position = next((i for i, (a, b) in enumerate(zip(actual, render, strict=False)) if a != b), None)
        if position is None and len(render) < len(actual):
            position = len(render)
        if position is None:
            return DriftReport(exact=True, trailing=len(render) - len(actual))
        turn, part = _locate(trajectory, position)
        window = slice(max(0, position - 3), position + 8)
        return DriftReport(
            exact=False,
            position=position,
            turn=turn,
            part=part,
            expected=self.tokenizer.decode(render[window], skip_special_tokens=False),
            actual=self.tokenizer.decode(actual[window], skip_special_tokens=False),
        )

    # -- from the event loop -----------------------------------------------------------------------------
    async def aencode_prompt(
        self,
        prompt: list[dict[str, Any]] | str,
        images: list[Any] | None = None,
        *,
        limiter: anyio.CapacityLimiter | None = None,
    ) -> Encoded:
        """`encode_prompt`, in a worker thread (of `limiter`, default anyio's) when the prompt holds images or
        long text, inline otherwise."""
        call = partial(self.encode_prompt, prompt, images)
        heavy = bool(images) or (_is_heavy(prompt) if isinstance(prompt, str) else _is_heavy(*prompt))
        return await _run(call, heavy, limiter)

    async def aencode_observation(
        self, message: dict[str, Any], *, limiter: anyio.CapacityLimiter | None = None
    ) -> Encoded:
        """`encode_observation`, in a worker thread (of `limiter`, default anyio's) when the message holds
        images or long text, inline otherwise."""
        return await _run(partial(self.encode_observation, message), _is_heavy(message), limiter)

    async def adrift_check(
        self, trajectory: Trajectory, *, limiter: anyio.CapacityLimiter | None = None
    ) -> DriftReport:
        """`drift_check`, in a worker thread (of `limiter`, default anyio's) unless the trajectory is short and
        has no images: it re-renders and re-tokenizes the whole conversation."""
        heavy = bool(trajectory.image_data) or len(trajectory.tokens) > INLINE_MAX_CHARS // CHARS_PER_TOKEN
        return await _run(partial(self.drift_check, trajectory), heavy, limiter)

    # -- internals ------------------------------------------------------------------------------------
    def _dummy_conversation(self) -> tuple[dict[str, Any], ...]:
        """DUMMY_MESSAGES, or the same without its system message for a template that refuses the system
        role (Gemma's raise on one): the cut after the dummy assistant's turn is the same either way."""
        try:
            self.render([*DUMMY_MESSAGES, {"role": "user", "content": "x"}], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 -- a template's raise_exception, whatever it raises
            return DUMMY_MESSAGES[1:]
        return DUMMY_MESSAGES

    def _find_end_of_turn(self) -> tuple[int, str]:
        """The added token the template writes right after an assistant message's content."""
        text = self.render([*self._dummy, {"role": "user", "content": "x"}], add_generation_prompt=True)
        start = text.rfind(ASSISTANT_SENTINEL)
        if start < 0:
            raise ValueError("the chat template drops assistant messages; delta encoding cannot find the turn end")
        tail = text[start + len(ASSISTANT_SENTINEL) :]
        first = self.tokenizer(tail, add_special_tokens=False)["input_ids"][:1]
        token = self.tokenizer.convert_ids_to_tokens(first[0]) if first else None
        if token is None or token not in self.tokenizer.get_added_vocab() or not tail.startswith(token):
            raise ValueError(
                f"the chat template writes {tail[:40]!r} after the assistant's content, not an end-of-turn token; "
                "delta encoding needs one to split turns"
            )
        return first[0], token

    def _find_vision_tokens(self) -> frozenset[int]:
        """Tokens only the VLM processor writes, never the model: the image and video placeholders, and
        the added tokens the chat template marks an image with (Qwen-VL's `<|vision_start|>` and
        `<|vision_end|>`). Empty without a processor. A model turn that samples one is cut before it
        (`engine.turn.generate_turn`): sent back to the server or the trainer, its tokens would no longer
        match the images."""
        if self.processor is None:
            return frozenset()
        ids = {getattr(self.processor, name, None) for name in ("image_token_id", "video_token_id")} - {None}
        text = {"type": "text", "text": "x"}
        image = [{"role": "user", "content": [{"type": "image"}, text]}]
        try:
            with_image = self.render(image, add_generation_prompt=False)
            without = self.render([{"role": "user", "content": [text]}], add_generation_prompt=False)
        except Exception:  # noqa: BLE001 -- a template without image parts marks no image: the placeholders only
            return frozenset(ids)
        marks = set(self.tokenizer.encode(with_image, add_special_tokens=False))
        marks -= set(self.tokenizer.encode(without, add_special_tokens=False))
        return frozenset(ids | (marks & set(self.tokenizer.added_tokens_decoder)))

    def _prefix_for(self, message: dict[str, Any]) -> str:
        """The rendered dummy turns before a message of this role, found once per role by rendering one
        like it (its own fields, a stand-in content: templates check fields such as a tool call's id)."""
        role = message.get("role", "user")
        if role not in self._prefix:
            probe = {**message, "content": "x"}
            text = self.render([*self._dummy, probe], add_generation_prompt=True)
            self._prefix[role] = text[: self._cut(text)]
        return self._prefix[role]

    def _cut(self, text: str) -> int:
        """Index just past the dummy assistant's end-of-turn token in a rendered dummy conversation."""
        start = text.rfind(ASSISTANT_SENTINEL + self._end_of_turn_text)
        if start < 0:
            raise ObservationError("the chat template rendered the dummy conversation without its turn end")
        return start + len(ASSISTANT_SENTINEL) + len(self._end_of_turn_text)

    def _for_template(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A text tokenizer's template wants string content: join text parts, refuse images."""
        if self.processor is not None:
            return messages
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                if _images_of([message]):
                    raise ObservationError(
                        f"a {message.get('role')!r} message holds images but the encoder has no VLM processor"
                    )
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
                message = {**message, "content": content}
            out.append(message)
        return out

    def _encode_text(self, text: str, images: list[Any], *, payloads: bool = True) -> Encoded:
        if self.processor is None:
            return Encoded(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        pil_images = [load_image(image, what=f"image {i + 1} of {len(images)}") for i, image in enumerate(images)]
        outputs = self.processor(text=[text], images=pil_images or None, return_tensors="pt")
        token_ids = outputs["input_ids"][0].tolist()
        train_inputs = {k: v for k, v in outputs.items() if k not in ("input_ids", "attention_mask")}
        image_data = [self.payloads(image) for image in pil_images] if payloads else []
        return Encoded(token_ids, image_data, train_inputs if pil_images else None)


async def _run(call: Any, heavy: bool, limiter: anyio.CapacityLimiter | None) -> Any:
    return await anyio.to_thread.run_sync(call, limiter=limiter) if heavy else call()


def _is_heavy(*parts: Any) -> bool:
    """Whether encoding these (a rendered prompt, or chat messages) is worth a worker thread: any image, or more
    than INLINE_MAX_CHARS of text."""
    chars = 0
    for part in parts:
        if isinstance(part, str):
            chars += len(part)
            continue
        content = part.get("content") if isinstance(part, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for item in content:
                if not isinstance(item, dict):
                    continue
                if item.get("type") == "image" or "image" in item:
                    return True
                text = item.get("text")
                chars += len(text) if isinstance(text, str) else 0
        if chars > INLINE_MAX_CHARS:
            return True
    return chars > INLINE_MAX_CHARS


def _images_of(messages: list[dict[str, Any]]) -> list[Any]:
    """Images in the messages' content parts, in order (`{"type": "image", "image": ...}`)."""
    return [
        part.get("image")
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and (part.get("type") == "image" or "image" in part)
    ]


def _locate(trajectory: Trajectory, position: int) -> tuple[int | None, str]:
    """Which turn (and which part of it) a token position of the trajectory belongs to."""
    offset = position - trajectory.prompt_length
    if offset < 0:
        return None, "prompt"
    for turn in reversed(trajectory.turns):
        if offset >= turn.start:
            return turn.index, "generated" if offset < turn.start + turn.num_generated else "observation"
    return None, "prompt"
