"""Model families: what the encoder and the parsers need to know beyond a chat template's text.

A family is named as SGLang's `--tool-call-parser` names it (slime users already set it for SGLang and for
slime's agent path). It says how a model turn ends, which the template alone does not:

- the tokens generation stops on (`stop_tokens`, from the model's generation config): Qwen's `<|im_end|>`;
  GLM-4.5+'s `<|user|>` and `<|observation|>`, which open the next message (`opens_next`: the model's turn
  ends on the opener of what follows, so the observation starts after it and that token is the model's);
  gpt-oss's `<|return|>` and `<|call|>`;
- the end tokens the template writes into history where the model sampled one of those (`history_ends`:
  harmony writes `<|end|>` where the model sampled `<|return|>`);
- the model's special tokens (`special_tokens`), so a template can be checked over the embedded Qwen
  vocabulary as the model's own tokenizer would split it;
- the output parser (`engine.parsers`) that reads a turn's content, reasoning and tool calls, and the
  reasoning parser's name.

What the generation prompt injects (`<think>\\n` for Qwen3-Thinking and DeepSeek-R1) and how a tool call is
written into history are read from the template itself (`ChatEncoder.generation_prompt`,
`ChatEncoder.opens_reasoning`), not kept here.

    family = find_family(tokenizer.chat_template)     # or family_named("glm45"); None: not a known family
    encoder = ChatEncoder(tokenizer, family=family)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.parsers import OutputParser


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str  # SGLang's --tool-call-parser name, and the output parser's
    reasoning_parser: str | None  # SGLang's --reasoning-parser name (None: the family does not reason)
    markers: tuple[str, ...]  # all of these in a chat template's text: the template is this family's
    stop_tokens: tuple[str, ...]  # generation stops on these (and on the tokenizer's EOS)
    history_ends: tuple[str, ...] = ()  # written into history where the model sampled a stop token
    opens_next: bool = False  # the stop tokens open the next message (GLM): they are not a turn's end alone
    special_tokens: tuple[str, ...] = ()  # the model's control tokens its template and its syntax write
    models: str = ""  # the models it covers, for people
    eos_token: str | None = None  # the model's EOS and BOS (templates write them), where not Qwen's
    bos_token: str | None = None

    @property
    def parser(self) -> OutputParser:
        from engine.parsers import get_parser

        return get_parser(self.name)

    def call_id(self, name: str, index: int) -> str:
        """A tool call's id as the model writes it: Kimi-K2's `functions.NAME:INDEX`, else 9 alphanumeric
        characters (Mistral's templates refuse other ids)."""
        return f"functions.{name}:{index}" if self.name == "kimi_k2" else f"call{index:05d}"

    @property
    def end_tokens(self) -> tuple[str, ...]:
        """Every token that can end an assistant message, sampled or written by the template."""
        return tuple(dict.fromkeys((*self.stop_tokens, *self.history_ends)))


_GLM_TOKENS = (
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "<tool_response>", "</tool_response>",
)  # fmt: skip
_DEEPSEEK_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)  # fmt: skip

# In the order a template is matched against them: the most specific markers first.
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "gpt-oss", "gpt-oss", ("<|channel|>", "<|call|>"),
        stop_tokens=("<|return|>", "<|call|>"), history_ends=("<|end|>",),
        special_tokens=(
            "<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>",
        ),
        models="gpt-oss-20b, gpt-oss-120b (harmony)", eos_token="<|return|>", bos_token="<|startoftext|>",
    ),
    ModelFamily(
        "glm47", "glm45", ("<|observation|>", "<tool_call>{function-name}<arg_key>"),
        stop_tokens=("<|user|>", "<|observation|>"), opens_next=True, special_tokens=_GLM_TOKENS,
        models="GLM-4.7, GLM-4.7-Flash",
    ),
    ModelFamily(
        "glm45", "glm45", ("<|observation|>", "<arg_key>"),
        stop_tokens=("<|user|>", "<|observation|>"), opens_next=True, special_tokens=_GLM_TOKENS,
        models="GLM-4.5, GLM-4.5-Air, GLM-4.6",
    ),
    ModelFamily(
        "kimi_k2", "kimi_k2", ("<|tool_calls_section_begin|>",),
        stop_tokens=("<|im_end|>",),
        special_tokens=(
            "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>",
        ),
        models="Kimi-K2-Instruct, Kimi-K2-Thinking", eos_token="[EOS]", bos_token="[BOS]",
    ),
    ModelFamily(
        "deepseekv31", "deepseek-v3", ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"),
        stop_tokens=("<｜end▁of▁sentence｜>",), special_tokens=_DEEPSEEK_TOKENS,
        eos_token="<｜end▁of▁sentence｜>", bos_token="<｜begin▁of▁sentence｜>",
        models="DeepSeek-V3.1, DeepSeek-R1 (its generation prompt opens <think>)",
    ),
    ModelFamily(
        "qwen3_coder", "qwen3", ("<|im_start|>", "<function=", "<parameter="),
        stop_tokens=("<|im_end|>",), models="Qwen3-Coder",
    ),
    ModelFamily(
        "qwen25", "qwen3", ("<|im_start|>", "<tool_call>"),
        stop_tokens=("<|im_end|>",), models="Qwen2.5, Qwen3, Qwen3-*-2507 (Instruct and Thinking)",
    ),
    ModelFamily(
        "llama3", None, ("<|start_header_id|>",),
        stop_tokens=("<|eot_id|>", "<|eom_id|>"),
        special_tokens=(
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>", "<|python_tag|>",
        ),
        models="Llama-3.1, Llama-3.2, Llama-3.3", bos_token="<|begin_of_text|>",
    ),
    ModelFamily(
        "mistral", None, ("[TOOL_CALLS]",),
        stop_tokens=("</s>",),
        special_tokens=(
            "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]",
        ),
        models="Mistral-Nemo, Mistral-Small-3.x, Devstral", eos_token="</s>", bos_token="<s>",
    ),
)  # fmt: skip
NAMES = tuple(family.name for family in FAMILIES)


def find_family(template: str | None) -> ModelFamily | None:
    """The family whose markers all appear in a chat template's text; None when no family's do."""
    if not template:
        return None
    return next((f for f in FAMILIES if all(marker in template for marker in f.markers)), None)


def family_named(name: str) -> ModelFamily:
    """The family of an SGLang `--tool-call-parser` name; ValueError naming the known ones otherwise."""
    for family in FAMILIES:
        if family.name == ALIASES.get(name, name):
            return family
    raise ValueError(f"model family {name!r}: not one of {', '.join(NAMES)}")


ALIASES = {"glm": "glm45", "qwen": "qwen25"}  # SGLang's other names for the same parsers
# SGLang's reasoning parsers of these families' syntax; the first two start every turn inside the reasoning.
FORCED_REASONING = ("qwen3-thinking", "deepseek-r1")
REASONING_PARSERS = (*FORCED_REASONING, "qwen3", "glm45", "kimi", "kimi_k2", "deepseek-v3", "gpt-oss")


# Every parser name SGLang registers (SGLang 0.5.23: sglang/srt/function_call/parser_names.py and
# sglang/srt/parser/reasoning_parser_names.py; the SGLang tier checks these against the installed SGLang). A name
# here that no family above has is read by SGLang itself, on SGLang servers (engine/backends/sglang_read.py).
SGLANG_TOOL_CALL_PARSERS = (
    "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4", "deepseekv41",
    "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo",
    "minicpm5", "mistral", "muse", "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25", "step3",
    "step3p5", "minimax-m2", "minimax-m3", "nanbeige", "trinity", "interns1", "hermes", "hunyuan", "gigachat3",
    "gigachat35", "gemma4", "inkling", "iquest_q1", "response_template",
)  # fmt: skip
SGLANG_REASONING_PARSERS = (
    "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41", "dots", "glm45", "ling3",
    "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "mimo", "muse", "poolside_v1", "qwen3",
    "qwen3-thinking", "minimax", "minimax-append-think", "minimax-m3", "nanbeige", "step3", "step3p5", "mistral",
    "nemotron_3", "granite_thinking_parser", "interns1", "gemma4", "inkling", "iquest_q1", "cohere_command4",
    "gigachat35", "response_template",
)  # fmt: skip


def has_family(name: str) -> bool:
    """Whether the engine has a family (and its own output parser) for this SGLang tool-call parser name."""
    return ALIASES.get(name, name) in NAMES


def family_name(name: str | None) -> str | None:
    """A tool-call parser name as a setting takes it: one of SGLang's (a family's, SGLang's aliases resolved, or
    one only SGLang reads); ValueError for a name SGLang does not have either."""
    if name is None:
        return None
    if has_family(name):
        return family_named(name).name
    if name not in SGLANG_TOOL_CALL_PARSERS:
        raise ValueError(
            f"model family {name!r}: not a tool-call parser SGLang has; the engine's own families are "
            f"{', '.join(NAMES)}, and on SGLang servers any of SGLang's: {', '.join(SGLANG_TOOL_CALL_PARSERS)}"
        )
    return name


def reasoning_parser_name(name: str | None) -> str | None:
    """One of SGLang's reasoning parser names; ValueError otherwise. The engine's own parsers read those in
    REASONING_PARSERS; the others are read by SGLang on its servers."""
    if name is not None and name not in (*REASONING_PARSERS, *SGLANG_REASONING_PARSERS):
        raise ValueError(
            f"reasoning parser {name!r}: not one SGLang has; the engine reads {', '.join(REASONING_PARSERS)}, "
            f"and on SGLang servers any of SGLang's: {', '.join(SGLANG_REASONING_PARSERS)}"
        )
    return name
