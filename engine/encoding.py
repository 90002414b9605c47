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

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import orjson

from engine.errors import ObservationError
from engine.families import NAMES, ModelFamily, find_family
from engine.multimodal import ImagePayloads, load_image
from engine.parsers.base import OutputParser, ParsedTurn

if TYPE_CHECKING:
    from engine.trajectory import Trajectory

ASSISTANT_SENTINEL = "I am the assistant of this dummy conversation."
OBSERVATION_PROBE = "What the env answered, as an observation."  # a probe's content: is it in what is appended?
DUMMY_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": ASSISTANT_SENTINEL},
)
# Text up to this many characters is encoded on the event loop by the async variants: below it the thread
# hop costs more loop time than the tokenizer's share of the work frees (benchmarks/micro/payloads.py measures it).
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


def tools_key(tools: list[dict[str, Any]]) -> str:
    """What `ChatEncoder.for_tools` keeps a tool set's encoder by: a digest of the tools' JSON, its keys sorted. Every
    caller keys by it (the scheduler, for a trajectory's prompt; the session gateway, for each reply), so that a tool
    set has one encoder, built once."""
    try:
        data = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # not JSON, or nested past orjson's depth
        data = repr(tools).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class ChatEncoder:
    """Encodes prompts and observations for one tokenizer (or VLM processor), tool set and template kwargs."""

    max_tool_sets = 64  # encoders `for_tools` keeps, one per tool set, the least recently used out first

    def __init__(
        self,
        tokenizer: Any,
        *,
        processor: Any = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        payloads: ImagePayloads | None = None,
        family: ModelFamily | None = None,
        force_reasoning: bool = False,
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
        self.family = family or find_family(self._renderer.chat_template)
        self.force_reasoning = force_reasoning
        self._prefix: dict[tuple[str, str], tuple[str, int]] = {}  # (role, tool) -> dummy text to its turn end, end id
        self._with_tools: dict[str, ChatEncoder] = {}  # tools' key -> an encoder that renders them, oldest first
        self._dummy = self._dummy_conversation()
        self._end_texts = self._find_end_tokens()
        self.end_of_turn_id = self._end_for({"role": "user"})
        self.vision_token_ids = self._find_vision_tokens()
        self.generation_prompt = self._find_generation_prompt()
        self._arguments_as_text = self._takes_arguments_as_text()
        sampled = self._ids(self.family.stop_tokens) if self.family is not None else []
        self._sampled_ends = frozenset(sampled)
        ends = sampled if self.family is not None else [self.end_of_turn_id]
        self._stop_ids = tuple(dict.fromkeys(t for t in (*ends, self.tokenizer.eos_token_id) if t is not None))

    # -- public ---------------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end the model's turn: the family's stop tokens (the template's end-of-turn token when
        the family is not known) and the tokenizer's EOS."""
        return self._stop_ids

    def call_id(self, name: str, index: int) -> str:
        """A tool call's id as the model writes it: its family's (`ModelFamily.call_id`), else `call00003`."""
        return self.family.call_id(name, index) if self.family is not None else f"call{index:05d}"

    @property
    def parser(self) -> OutputParser | None:
        """The output parser of this model's turns: its family's, else one read off the template (engine/probe.py:
        how it writes a structured call); None where neither reads it (`parser_problem` says why)."""
        return self._probed[0]

    @property
    def parser_problem(self) -> str | None:
        return self._probed[1]

    @functools.cached_property
    def reader(self) -> OutputParser:
        """What reads this model's turns: `parser`, else one that splits off the reasoning by the template's own
        markers and refuses, naming `parser_problem`, to read or write a tool call (never another family's)."""
        if self.parser is not None:
            return self.parser
        from engine.parsers.probed import NoCallsParser

        return NoCallsParser(self.parser_problem or "no family and no call syntax found", **self._reasoning_markers)

    @functools.cached_property
    def _probed(self) -> tuple[OutputParser | None, str | None]:
        if self.family is not None:
            return self.family.parser, None
        from engine.parsers.probed import ProbedParser
        from engine.probe import probe_layout

        layout, problem = probe_layout(self)
        return (ProbedParser(layout) if layout is not None else None), problem

    @property
    def end_texts(self) -> tuple[str, ...]:
        """The tokens (as text) that can end an assistant message in this template: the family's sampled and
        history end tokens the tokenizer has, or the template's one end-of-turn token."""
        return self._end_texts

    @property
    def opens_reasoning(self) -> bool:
        """Whether the generation prompt opens a reasoning block the model continues (Qwen3-Thinking's and
        DeepSeek-R1's `<think>\\n`, MiniMax-M3's `<mm:think>` in its thinking mode): its turns start inside the
        reasoning."""
        opener, closer = self.reasoning_tags
        head, opened, tail = self.generation_prompt.rpartition(opener)
        return self.force_reasoning or (bool(opened) and closer not in tail)

    @functools.cached_property
    def reasoning_tags(self) -> tuple[str, str]:
        """What opens and closes a reasoning block: `<think>` and `</think>` in the engine's families (harmony's
        channels are its parser's), else as the template writes a reasoned reply (engine/probe.py), and `<think>`
        where it writes none."""
        if self.family is None:
            markers = self._reasoning_markers
            if markers["reasoning_open"] and markers["reasoning_close"]:
                return markers["reasoning_open"], markers["reasoning_close"]
        return "<think>", "</think>"

    @functools.cached_property
    def _reasoning_markers(self) -> dict[str, str]:
        """The reasoning block's markers as the template writes a reasoned reply (engine/probe.py)."""
        from engine.probe import reasoning_markers

        return reasoning_markers(self)

    @classmethod
    def for_settings(cls, tokenizer: Any, settings: Any, *, processor: Any = None) -> ChatEncoder:
        """The encoder a run's settings ask for (`chat_template_kwargs`, `model_family`, `reasoning_parser`)."""
        from engine.families import FORCED_REASONING, family_named, has_family

        named = settings.model_family
        if named is None and settings.tokenizer == "qwen2.5" and not getattr(settings, "chat_template", None):
            named = "qwen25"  # the embedded tokenizer's, its VL processor's template (no tools in it) included
        family = family_named(named) if named and has_family(named) else None  # else SGLang's to read
        return cls(
            tokenizer,
            processor=processor,
            chat_template_kwargs=settings.chat_template_kwargs,
            family=family,
            force_reasoning=settings.reasoning_parser in FORCED_REASONING,
        )

    def check_env(
        self, env: str, roles: tuple[str, ...], *, skip_special_tokens: bool, read_by_server: bool = False
    ) -> None:
        """One ValueError at start where an env that declares the roles of its observations cannot run with this
        template: the template cannot render a message of such a role at all (gemma-3 has no tool role), or the
        env reads tool calls (it sends tool observations) and no parser reads this model's: its template is of no
        family the engine has, and no SGLang server reads its turns (`read_by_server`), or its delimiters are
        special tokens decoding drops (`skip_special_tokens`: Kimi-K2's, gpt-oss's, DeepSeek's)."""
        for role in roles:
            if (problem := self.role_problem(role)) is not None:
                raise ValueError(f"env {env} sends {role!r} observations, but the chat template {problem}")
        if "tool" in roles and self.parser is None and not read_by_server:
            raise ValueError(
                f"env {env} reads tool calls, but the chat template is of no model family the engine has a parser "
                f"for ({', '.join(NAMES)}), and its call syntax cannot be read off it ({self.parser_problem}): name "
                "its family with model_family (SGLang's --tool-call-parser name; one the engine lacks is read by "
                "SGLang on its servers)"
            )
        if "tool" in roles and skip_special_tokens and self.parser is not None and not read_by_server:
            special = set(self.tokenizer.all_special_tokens) | {
                t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special
            }
            dropped = [d for d in self.parser.delimiters if d in special]
            if dropped:
                family = f"the {self.family.name} family" if self.family is not None else "the model"
                raise ValueError(
                    f"env {env} reads tool calls, but {family} writes them with special tokens "
                    f"({' '.join(dropped)}) that skip_special_tokens drops from the text the env reads: set "
                    "skip_special_tokens: false (under slime, leave out --rollout-skip-special-tokens)"
                )

    def role_problem(self, role: str) -> str | None:
        """Why the template cannot render an observation of `role` after the model's turn ("cannot render a
        'tool' message: ..."), or None when it can."""
        message: dict[str, Any] = {"role": role, "content": OBSERVATION_PROBE}
        if role == "tool":
            message |= {"tool_call_id": "abcDEF123", "name": "tool"}  # 9 alphanumeric characters, as Mistral checks
        try:
            self.encode_observation(message)
        except Exception as exc:  # noqa: BLE001 -- a template's raise_exception, whatever it raises
            return f"cannot render a {role!r} message after an assistant turn: {' '.join(str(exc).split())}"
        return None

    @functools.cached_property
    def _image_marker(self) -> str | None:
        """The text the template writes for an image (Qwen-VL's `<|image_pad|>`, which the processor expands)."""
        return getattr(self.processor, "image_token", None) if self.processor is not None else None

    @property
    def image_token_id(self) -> int | None:
        """The token an image expands into (`<|image_pad|>` for Qwen-VL); None without a VLM processor."""
        return getattr(self.processor, "image_token_id", None) if self.processor is not None else None

    def for_tools(self, tools: list[dict[str, Any]] | None, *, key: str | None = None) -> ChatEncoder:
        """This encoder, or one like it that renders `tools` (a prompt's own tool set, as slime's
        `--tool-key` puts it in `metadata["tools"]`) into every prompt and observation. The newest
        `max_tool_sets` are kept, by `tools_key(tools)` (`key`: that digest, where a caller has made it already)."""
        if not tools or tools == self.tools:
            return self
        key = key or tools_key(tools)
        encoder = self._with_tools.pop(key, None)
        if encoder is None:
            encoder = ChatEncoder(
                self.tokenizer,
                processor=self.processor,
                tools=tools,
                chat_template_kwargs=self.template_kwargs,
                payloads=self.payloads,
                family=self.family,
                force_reasoning=self.force_reasoning,
            )
        if self.family is None:  # the template is read once, by this encoder, for every tool set
            encoder.__dict__["_probed"] = self._probed
            encoder.__dict__["_reasoning_markers"] = self._reasoning_markers
        self._with_tools[key] = encoder  # the newest last
        while len(self._with_tools) > self.max_tool_sets:
            del self._with_tools[next(iter(self._with_tools))]
        return encoder

    @property
    def cached_tool_sets(self) -> int:
        """How many tool sets `for_tools` keeps an encoder for."""
        return len(self._with_tools)

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
            self.render(prompt, add_generation_prompt=True), images_of(prompt) + list(images or [])
        )

    def encode_observation(self, message: dict[str, Any] | list[dict[str, Any]]) -> Encoded:
        """The tokens that follow the model's end-of-turn token: separator, the observation (a message, or
        several: the results of parallel tool calls, a tool result and a user message), the next generation
        prompt. Raises ObservationError where the template leaves a message's content out of what it appends
        (DeepSeek's and gpt-oss's write only the first system message): the model would never see it."""
        messages = _as_messages(message)
        text = self._render_after_dummy(messages)
        prefix, _ = self._prefix_for(messages[0])
        if not text.startswith(prefix):  # the template renders the dummy turns differently for these messages
            prefix = text[: self._cut(text)[0]]
        delta = text[len(prefix) :]
        if (lost := _lost(delta, messages, self._image_marker)) is not None:
            raise ObservationError(f"the chat template drops the observation's {lost}: the model would never see it")
        return self._encode_text(delta, images_of(messages))

    def closing_ids(
        self, generated: list[int], message: dict[str, Any] | list[dict[str, Any]] | None = None
    ) -> list[int]:
        """What to put before an observation (`message`; a user message if not given) when the model's turn
        did not end the way the template ends it before such a message: the template's token, so the
        trajectory still matches it. A turn that ended on a stop token of its family ends there (gpt-oss's
        `<|return|>` stands where history writes `<|end|>`), except where the stop token opens the next message
        (GLM): then it must be the opener of this message's role."""
        end = self._end_for(_as_messages(message)[0] if message else {"role": "user"})
        last = generated[-1] if generated else None
        if last == end:
            return []
        if self.family is not None and not self.family.opens_next and last in self._sampled_ends:
            return []
        return [end]

    def parse_turn(self, generated: list[int], *, tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        """The model's turn read by its parser (`reader`): content, reasoning and tool calls. Raises the parser's
        MalformedCall, and NoCallSyntax where tools are offered and no parser knows this model's calls."""
        text = self.assistant_text(generated)
        return self.reader.parse(text, tools=tools or self.tools, in_reasoning=self.opens_reasoning)

    def assistant_message(self, generated: list[int]) -> dict[str, Any]:
        """The model's turn as a chat message a re-render takes, as an agent framework or a trainer would
        build it: its content, its reasoning (`reasoning_content`, and harmony's `thinking`) and structured
        `tool_calls`, by its parser. Plain text content when no parser reads this model's turns or the turn holds a
        malformed call."""
        text = self.assistant_text(generated)
        if self.parser is None:
            return {"role": "assistant", "content": text}
        from engine.parsers import MalformedCall

        try:
            parsed = self.parse_turn(generated)
        except MalformedCall:
            return {"role": "assistant", "content": text}
        if not (parsed.reasoning or parsed.tool_calls) and parsed.content.strip() == text.strip():
            return {"role": "assistant", "content": text}  # plain text: as written, not as a parser trims it
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["reasoning_content"] = message["thinking"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [
                self.tool_call(call.id or f"call{i:05d}", call.name, call.arguments)
                for i, call in enumerate(parsed.tool_calls)
            ]
        return message

    def naming_the_calls(
        self, observation: dict[str, Any] | list[dict[str, Any]], generated: list[int], calls_before: int = 0
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Tool messages with the calls they answer named, as templates write them (harmony's header names the
        tool, Kimi-K2's `## Return of functions.name:0`, Mistral's `[TOOL_RESULTS]` its id): a tool message
        that leaves out `tool_call_id` or `name` gets the model's call of its place in this turn (the first
        tool message the first call), its id as the model wrote it, else the family's for the conversation's
        call number (`calls_before` calls answered before this turn). Other messages, a turn without a
        well-formed call and messages past its calls are returned as they are, in the observation's shape."""
        messages = _as_messages(observation)
        unnamed = any(m.get("role") == "tool" and not (m.get("tool_call_id") and m.get("name")) for m in messages)
        if self.parser is None or not unnamed:
            return observation
        from engine.parsers import MalformedCall

        try:
            calls = self.parse_turn(generated).tool_calls
        except MalformedCall:
            return observation
        named, answered = [], 0
        for message in messages:
            if message.get("role") == "tool" and answered < len(calls):
                call = calls[answered]
                call_id = call.id or self.call_id(call.name, calls_before + answered)
                message = {
                    **message,
                    "tool_call_id": message.get("tool_call_id") or call_id,
                    "name": message.get("name") or call.name,
                }
                answered += 1
            named.append(message)
        return named[0] if isinstance(observation, dict) else named

    def tool_call(self, call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A structured tool call as this template takes it (OpenAI's shape): arguments as a mapping, or as
        JSON text where the template writes them by string concatenation (DeepSeek-V3.1's)."""
        value: Any = json.dumps(arguments, ensure_ascii=False) if self._arguments_as_text else arguments
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": value}}

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
            messages.append(self.assistant_message(trajectory.generated_ids(turn).tolist()))
            messages += turn.observation_messages
        ends_with_observation = bool(trajectory.turns) and trajectory.turns[-1].observation is not None
        render = self._encode_text(
            self.render(messages, add_generation_prompt=ends_with_observation or not trajectory.turns),
            images_of(messages),
            payloads=False,  # the token ids are compared; the backend's copies of the images are not needed
        ).token_ids
        actual = trajectory.tokens.tolist()
        position = next((i for i, (a, b) in enumerate(zip(actual, render, strict=False)) if a != b), None)
        if position is None and len(render) < len(actual) and not self._ends_on_opener(actual, len(render)):
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

    def _ends_on_opener(self, actual: list[int], rendered: int) -> bool:
        """Whether the one token past a render is the model's last stop token that opens the next message
        (GLM's `<|user|>`): the model sampled it, the conversation has no next message to render it."""
        opens = self.family is not None and self.family.opens_next
        return opens and len(actual) == rendered + 1 and actual[-1] in self._sampled_ends

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
        self, message: dict[str, Any] | list[dict[str, Any]], *, limiter: anyio.CapacityLimiter | None = None
    ) -> Encoded:
        """`encode_observation`, in a worker thread (of `limiter`, default anyio's) when the messages hold
        images or long text, inline otherwise."""
        return await _run(partial(self.encode_observation, message), _is_heavy(*_as_messages(message)), limiter)

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

    def _find_end_tokens(self) -> tuple[str, ...]:
        """The texts of the tokens that can end an assistant message: the family's, those of them the
        tokenizer has; without a family, the added token the template writes right after an assistant
        message's content."""
        if self.family is not None:
            present = tuple(token for token in self.family.end_tokens if self._ids((token,)))
            if not present:
                raise ValueError(
                    f"the tokenizer has none of the {self.family.name} family's end-of-turn tokens "
                    f"({' '.join(self.family.end_tokens)}); is it that model's tokenizer?"
                )
            return present
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
        return (token,)

    def _takes_arguments_as_text(self) -> bool:
        """Whether the template refuses a tool call's arguments as a mapping but takes them as JSON text."""
        if self.family is None:
            return False
        call = {"id": "call00000", "type": "function", "function": {"name": "tool", "arguments": {"x": "y"}}}
        messages = [*self._dummy[:-1], {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            self.render(messages, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 -- `str + dict` in the template: it concatenates the arguments
            return True
        return False

    def _find_generation_prompt(self) -> str:
        """What the template writes for `add_generation_prompt` after a user message ("" when it is not a
        plain suffix of the render without it)."""
        messages = [*self._dummy, {"role": "user", "content": "x"}]
        with_prompt = self.render(messages, add_generation_prompt=True)
        without = self.render(messages, add_generation_prompt=False)
        return with_prompt[len(without) :] if with_prompt.startswith(without) else ""

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

    def _ids(self, tokens: tuple[str, ...]) -> list[int]:
        """The ids of those of `tokens` the tokenizer has as single tokens."""
        ids = [self.tokenizer.convert_tokens_to_ids(token) for token in tokens]
        return [i for i, token in zip(ids, tokens, strict=True) if i is not None and self._token(i) == token]

    def _token(self, token_id: int) -> str | None:
        return self.tokenizer.convert_ids_to_tokens(token_id)

    def _end_for(self, message: dict[str, Any]) -> int:
        """The token the template ends the model's turn with before a message like this one."""
        return self._prefix_for(message)[1]

    def _prefix_for(self, message: dict[str, Any]) -> tuple[str, int]:
        """The rendered dummy turns before a message like this one, up to and including the end of the dummy
        assistant's turn, and that end token's id; found once per role (and tool name) by rendering one like
        it (its own fields, a stand-in content: templates check fields such as a tool call's id)."""
        key = (message.get("role", "user"), str(message.get("name", "")) if message.get("role") == "tool" else "")
        if key not in self._prefix:
            text = self._render_after_dummy([{**message, "content": "x"}])
            cut, token = self._cut(text)
            self._prefix[key] = text[:cut], self.tokenizer.convert_tokens_to_ids(token)
        return self._prefix[key]

    def _render_after_dummy(self, messages: list[dict[str, Any]]) -> str:
        """The dummy conversation, then `messages`, rendered with the generation prompt. Before tool messages (of
        any family, known or not), the dummy assistant makes the calls they answer (structured `tool_calls`, one per
        leading tool message, the sentinel as an argument), as templates that name the call in the tool's
        header (harmony) or refuse a tool message without a call need; where the template does not write such
        calls (it raises on them, or leaves the sentinel out), after the plain dummy."""
        answers = list(itertools.takewhile(lambda m: m.get("role") == "tool", messages))
        if answers:
            calls = [
                self.tool_call(
                    str(m.get("tool_call_id") or f"call{i:05d}"),
                    str(m.get("name") or "tool"),
                    {"x": ASSISTANT_SENTINEL},
                )
                for i, m in enumerate(answers)
            ]
            dummy = (*self._dummy[:-1], {"role": "assistant", "content": "", "tool_calls": calls})
            try:
                text = self.render([*dummy, *messages], add_generation_prompt=True)
            except Exception:  # noqa: BLE001 -- a template without structured tool calls: the plain dummy
                text = ""
            if ASSISTANT_SENTINEL in text:
                return text
        return self.render([*self._dummy, *messages], add_generation_prompt=True)

    def _cut(self, text: str) -> tuple[int, str]:
        """Index just past the dummy assistant's end-of-turn token in a rendered dummy conversation (the first
        end token after the sentinel's last occurrence), and that token."""
        start = text.rfind(ASSISTANT_SENTINEL)
        found = [(text.find(t, start), t) for t in self._end_texts] if start >= 0 else []
        found = [(at, token) for at, token in found if at >= 0]
        if not found:
            ends = " or ".join(self._end_texts)
            raise ObservationError(f"the chat template rendered the dummy conversation without its turn end ({ends})")
        at, token = min(found)
        return at + len(token), token

    def _for_template(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as templates take them: a `developer` message as the system message (templates render
        that role as nothing, or as gpt-oss's, the same as `system`); for a text tokenizer's template, string
        content: text parts joined, images refused."""
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        if self.processor is not None:
            return messages
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                if images_of([message]):
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


def _lost(delta: str, messages: list[dict[str, Any]], image_marker: str | None) -> str | None:
    """Which message's content (its text, each text part, its images) the rendered `delta` does not carry, named
    ("message 2 (system)"), or None when it carries them all. A text counts as carried as it is (ends trimmed, as
    templates trim), or escaped as a JSON string (templates that `tojson` a tool's result)."""
    images = 0  # of the messages so far: the delta writes a marker for each
    for number, message in enumerate(messages, 1):
        content = message.get("content")
        parts = [content] if isinstance(content, str) else [p.get("text") for p in content or () if isinstance(p, dict)]
        for text in (t.strip() for t in parts if isinstance(t, str)):
            if text and text not in delta and not _escaped_in(text, delta):
                return f"message {number} ({message.get('role')})"
        images += len(images_of([message]))
        if images and image_marker is not None and delta.count(image_marker) < images:
            return f"message {number} ({message.get('role')}) images"
    return None


def _escaped_in(text: str, delta: str) -> bool:
    """Whether `delta` holds `text` as a JSON string writes it (with or without non-ASCII escaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1] in delta or json.dumps(text)[1:-1] in delta


def _as_messages(observation: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An observation as a non-empty list of chat messages."""
    messages = [observation] if isinstance(observation, dict) else list(observation)
    if not messages:
        raise ObservationError("an observation of no messages")
    return messages


def images_of(messages: list[dict[str, Any]]) -> list[Any]:
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
