"""Every input a user gives, with a bad value: one clear error at start naming what is wrong, or, for what
belongs to one trajectory (its prompt's images, its env, its server replies), that trajectory FAILED with
its error class while the others go on. docs/bad_input.md's table lists each case here by its test id;
the last test keeps the two equal.

`turnstile run` is driven through `engine.cli.main`, against the SGLang double (tests/sglang_double.py)
where a run gets that far; the embedded Qwen tokenizer is read from disk once for the module.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.backends.base import SamplingParams
from engine.cli import main
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner
from engine.models import _qwen_tokenizer_dir, load_tokenizer, packaged_template
from engine.scheduler.reference import run_trajectory
from engine.trajectory import Status, Trajectory
from engine.turn import TurnLimits
from tests.fakes import ScriptedBackend, ScriptedEnv
from tests.net import free_port
from tests.sglang_double import Disconnect, Generate, Raw, SGLangDouble, error_body

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"prompt": [{"role": "user", "content": "good"}], "metadata": {"case": "good"}}
SERVER = lambda url: ("--url", url, "--tokenizer", "qwen2.5")  # noqa: E731 -- the double serves no tokenizer of its own
NO_RETRY = "retry: {backoff_base_s: 0, per_turn: {}}\n"  # a failure ends its trajectory at once
NO_BACKOFF = "retry: {backoff_base_s: 0}\n"  # the default budgets, retried at once
QWEN = packaged_template("qwen2.5")
IMAGE_PAD = 151655  # Qwen-VL's <|image_pad|>
NO_GENERATION_PROMPT = QWEN.replace(
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}", "{%- if 0 %}"
)
assert NO_GENERATION_PROMPT != QWEN
REFUSES_A_WORD = (
    "{%- for m in messages %}{%- if 'forbidden' in m.content %}"
    "{{- raise_exception('the word forbidden is not allowed') }}{%- endif %}{%- endfor %}"
) + QWEN
REWRITES_HISTORY = (  # as Qwen3 does: earlier assistant turns lose their <think> block
    "{%- for m in messages %}"
    "{%- set content = m.content.split('</think>')[-1] if m.role == 'assistant' and not loop.last else m.content %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# One env for the per-trajectory cases: the row's metadata["case"] says what goes wrong; "good" is done
# after one step with reward 1.
CASE_ENV = """
from engine.envs.base import BaseInteractionEnv

IMAGES = {"undecodable-image": b"not an image", "image-of-wrong-type": 5, "image-without-vlm": b"png?"}


class Env(BaseInteractionEnv):
    def __init__(self, image):
        self.image = image

    def reset(self):
        return {}, {}

    def step(self, response_text):
        return {"image": self.image}, self.image is None, {"reward": 1.0} if self.image is None else {}

    def format_observation(self, observation):
        parts = [{"type": "image", "image": observation["image"]}, {"type": "text", "text": "look again"}]
        return {"role": "user", "content": parts}


def build_env(sample=None, args=None, **kw):
    case = sample.metadata.get("case")
    if case == "build-env-raises":
        raise KeyError("no sandbox image for this task")
    if case == "build-env-returns-none":
        return None
    return Env(IMAGES.get(case))
"""


@pytest.fixture(autouse=True)
def embedded_tokenizer_read_once(monkeypatch, tokenizer):
    """`load_tokenizer("qwen2.5")` gets a copy of the session's tokenizer instead of reading it from disk
    again (a copy: a run's own chat template stays its own); every other directory loads as it would."""
    from transformers import AutoTokenizer

    embedded, real = _qwen_tokenizer_dir(), AutoTokenizer.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        return copy.copy(tokenizer) if Path(path) == embedded else real(path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)


def run(tmp_path, capsys, *argv: str) -> tuple[int, list[dict], str]:
    """`turnstile run *argv`: its exit status, the trajectories it wrote and what it printed on stderr."""
    out = tmp_path / "out.jsonl"
    try:
        code = main(["run", "--out", str(out), *argv])
    except SystemExit as exited:  # argparse's exit, on a bad flag or a refused setting
        code = exited.code
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return code, records, capsys.readouterr().err


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def write_rows(tmp_path, *rows) -> str:
    return write(tmp_path / "rows.jsonl", "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def only_bad_one_failed(records: list[dict]) -> dict:
    """The one FAILED trajectory of a run whose others all completed."""
    failed = [r for r in records if r["status"] == "failed"]
    assert len(failed) == 1 and len(records) >= 2, [(r["status"], r["errors"]) for r in records]
    assert all(r["status"] == "completed" for r in records if r is not failed[0])
    return failed[0]


def refused_at_start(code: int, records: list[dict], err: str, message: str) -> None:
    assert code == 2 and not records, err
    assert message in err, err
    # argparse's own errors come after `turnstile run`'s one-line usage; every other error alone
    is_argparses = any(word in message for word in ("invalid", "argument", "unrecognized"))
    assert "usage: turnstile [-h]" not in err and err.count("usage: ") <= is_argparses, err


# -- `turnstile run` flags ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--max-turnz", "3"], "unrecognized arguments: --max-turnz 3", id="unknown-flag"),
        pytest.param(["--max-turns", "six"], "argument --max-turns: invalid int value: 'six'", id="not-a-number"),
        pytest.param(["--max-turns", "0"], "max_turns: Input should be greater than 0 (given 0)", id="out-of-range"),
        pytest.param(["--policy", "lifo"], "argument --policy: invalid choice: 'lifo'", id="not-a-choice"),
        pytest.param(["--top-p", "0"], "top_p: Input should be greater than 0 (given 0.0)", id="top-p-zero"),
        pytest.param(["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0", id="no-prompts"),
        pytest.param(
            ["--env-workers", "-1"],
            "env_workers: Input should be greater than or equal to 0 (given -1)",
            id="env-workers-negative",
        ),
        pytest.param(["--backend", "sglang"], "backend kind 'sglang' needs a url", id="sglang-without-url"),
        pytest.param(
            ["--backend", "local", "--url", "http://h:1"],
            "url http://h:1 is for the sglang backend",
            id="local-with-url",
        ),
        pytest.param(
            ["--url", "localhost:30000"], "url 'localhost:30000': give it as http://host:port", id="url-without-scheme"
        ),
        pytest.param(
            ["--metrics-port", "70000"], "metrics_port: Input should be less than or equal to 65535", id="port-range"
        ),
        pytest.param(["--metrics-port", "BUSY"], "--metrics-port BUSY: cannot serve there: ", id="port-in-use"),
        pytest.param(
            ["--metrics-host", "no-such-host.invalid", "--metrics-port", "0"],
            "--metrics-host no-such-host.invalid --metrics-port 0: cannot serve there",
            id="unknown-metrics-host",
        ),
        pytest.param(
            ["--out", "FILE/out.jsonl"],
            "--out FILE/out.jsonl: cannot write there: FILE is not a directory",
            id="out-not-writable",
        ),
        pytest.param(
            ["--tokenizer", "/no/such/tokenizer"],
            "tokenizer '/no/such/tokenizer': not 'qwen2.5' and not a directory",
            id="tokenizer-missing",
        ),
        pytest.param(["--tokenizer", "EMPTY"], "tokenizer 'EMPTY' does not load: ", id="tokenizer-not-a-tokenizer"),
        pytest.param(
            ["--model", "tiny-llama"], "model 'tiny-llama': not one of tiny-qwen2, tiny-qwen2.5-vl", id="model-unknown"
        ),
        pytest.param(
            ["--vision", "--tokenizer", "EMPTY"],
            "--tokenizer and --chat-template are not read with it",
            id="vision-with-tokenizer",
        ),
        pytest.param(
            ["--url", "http://127.0.0.1:9", "--model", "tiny-qwen2.5-vl"],
            "model: not read by the sglang backend",
            id="model-with-sglang",
        ),
    ],
)
def test_a_bad_flag_is_one_error_at_start(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        places = {"EMPTY": str(tmp_path / "empty"), "FILE": str(tmp_path / "file"), "BUSY": str(busy.getsockname()[1])}
        argv = [re.sub("|".join(places), lambda m: places[m.group()], a) for a in argv]
        message = re.sub("|".join(places), lambda m: places[m.group()], message)
        refused_at_start(*run(tmp_path, capsys, "--num-prompts", "1", *argv), message)


@pytest.mark.parametrize("argv", [pytest.param([], id="local-backend"), pytest.param(["--vision"], id="vision")])
def test_the_local_backend_or_vision_without_torch_is_one_error_at_start(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as where the torch extra is missing
    what = "--vision (the Qwen2.5-VL processor)" if argv else "the local backend (no --url)"
    why = "import of torch halted; None in sys.modules"
    message = f"{what} needs torch and torchvision, which do not import here ({why}): pip install 'turnstile[torch]'"
    refused_at_start(*run(tmp_path, capsys, "--num-prompts", "1", *argv), message)


# -- `turnstile run --config` YAML ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        pytest.param("max_turns: [1\n", "run.yaml: not valid YAML at line 2, column 1: expected ','", id="not-yaml"),
        pytest.param("- max_turns\n", "run.yaml: expected a mapping of settings, got list", id="not-a-mapping"),
        pytest.param(None, "No such file or directory: ", id="no-such-file"),
        pytest.param(
            "max_genrating: 9\n",
            "run.yaml: max_genrating: not a setting (did you mean max_generating?)",
            id="unknown-key",
        ),
        pytest.param("ray_actor: rollout\n", "run.yaml: ray_actor: read under slime only", id="slime-only-key"),
        pytest.param(
            "env_step_timeout: 5\n", "run.yaml: env_step_timeout: now retry.env_step_timeout_s", id="moved-key"
        ),
        pytest.param("max_turns: six\n", "run.yaml: max_turns: Input should be a valid integer", id="bad-value"),
        pytest.param(
            "retry: {per_try: 1}\n",
            "run.yaml: retry.per_try: not a setting (did you mean per_turn?)",
            id="unknown-retry-key",
        ),
        pytest.param(
            "retry:\n  env_step_timout_s: 3\n",
            "run.yaml: retry.env_step_timout_s: not a setting (did you mean env_step_timeout_s?)",
            id="nested-typo",
        ),
        pytest.param(
            "retry: {per_turn: {oom: 1}}\n",
            "run.yaml: retry.per_turn.oom.[key]: Input should be 'connection'",
            id="unknown-error-class",
        ),
        pytest.param(
            "num_prompts: 0\n",
            "run.yaml: num_prompts: must be a whole number of at least 1, got 0",
            id="num-prompts-zero",
        ),
        pytest.param(
            "repetition_penalty: 1.2\n",
            "the local backend cannot honour repetition_penalty=1.2",
            id="needs-sglang",
        ),
        pytest.param("request_timeout_s: 30\n", "request_timeout_s: not read by the local backend", id="sglang-only"),
        pytest.param(
            "ray_address: auto\n",
            "ray_address applies to env workers only: set env_workers too",
            id="env-worker-knob-without-workers",
        ),
    ],
)
def test_a_bad_run_yaml_is_one_error_at_start(tmp_path, capsys, yaml_text, message):
    config = tmp_path / "run.yaml"
    if yaml_text is not None:
        config.write_text(yaml_text)
    refused_at_start(*run(tmp_path, capsys, "--num-prompts", "1", "--config", str(config)), message)


# -- slime's custom config: top-level keys and the `turnstile:` section ---------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {"turnstile": {"max_env_step": 3}},
            "turnstile.max_env_step: not a setting (did you mean max_env_steps?)",
            id="unknown-key",
        ),
        pytest.param(
            {"turnstile": {"retry": {"env_step_timout_s": 3}}},
            "turnstile.retry.env_step_timout_s: not a setting (did you mean env_step_timeout_s?)",
            id="nested-typo",
        ),
        pytest.param(
            {"turnstile": {"temperature": 0.5}},
            "turnstile.temperature: set by slime's `--rollout-temperature`; set that instead",
            id="slime-decides",
        ),
        pytest.param(
            {"turnstile": {"log_level": "info"}}, "turnstile.log_level: read by `turnstile run` only", id="run-only"
        ),
        pytest.param(
            {"turnstile": ["max_env_steps"]}, "turnstile: expected a mapping of settings, got list", id="not-a-mapping"
        ),
        pytest.param(
            {"turnstile": {"max_env_steps": 0}},
            "turnstile.max_env_steps: Input should be greater than 0 (given 0)",
            id="bad-value",
        ),
        pytest.param(
            {"turnstile": {"env_workers": 2, "env_worker_capacity": 0}},
            "turnstile.env_worker_capacity: Input should be greater than 0 (given 0)",
            id="env-worker-capacity-zero",
        ),
        pytest.param(
            {"max_turns": 0},
            "slime's `max_turns:` at the top of the custom config (max_turns): Input should be greater than 0",
            id="top-level-max-turns",
        ),
        pytest.param(
            {"rollout_stop": "</answer>"},
            "slime's `--rollout-stop` (stop): Input should be a valid tuple (given '</answer>')",
            id="rollout-stop-not-a-list",
        ),
        pytest.param(
            {"apply_chat_template_kwargs": "enable_thinking"},
            "slime's `--apply-chat-template-kwargs` (chat_template_kwargs): Input should be a valid dictionary",
            id="template-kwargs-not-a-mapping",
        ),
    ],
)
def test_a_bad_slime_custom_config_is_one_error_at_start(values, message):
    from bridge.settings import settings_from_args

    with pytest.raises(ValueError) as refused:
        settings_from_args(SimpleNamespace(**values))
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        pytest.param("turnstile: {max_env_steps: [\n", "not valid YAML", id="not-yaml"),
        pytest.param(
            "turnstile: {polcy: fifo}\n", "turnstile.polcy: not a setting (did you mean policy?)", id="unknown-key"
        ),
        pytest.param("- turnstile\n", "serve.yaml: expected a mapping, got list", id="not-a-mapping"),
    ],
)
def test_a_bad_serve_config_is_one_error_at_start(tmp_path, capsys, yaml_text, message):
    code = main(["serve", "--config", write(tmp_path / "serve.yaml", yaml_text)])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--ray-address", "auto"],
            "env workers: no Ray cluster at ray_address 'auto': Could not find any running Ray instance",
            id="ray-address-without-cluster",
        ),
        pytest.param([], "env_workers needs Ray, which is not installed here", id="ray-not-installed"),
    ],
)
def test_env_workers_without_ray_are_one_error_at_start(tmp_path, capsys, monkeypatch, argv, message):
    ray = pytest.importorskip("ray", reason="Ray is part of the dev extra")
    if ray.is_initialized():
        pytest.skip("this process is connected to Ray already: env workers would start there")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if not argv:
        monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is not installed
    refused_at_start(*run(tmp_path, capsys, "--num-prompts", "1", "--env-workers", "1", *argv), message)


# -- slime's args -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "messages"),
    [
        pytest.param({"rollout_top_p": 0.9}, ["--rollout-top-p 0.9: Below 1, slime's trainer needs"], id="top-p"),
        pytest.param(
            {"use_rollout_routing_replay": True, "buffer_filter_path": "my.filter"},
            ["--use-rollout-routing-replay True: ", "--buffer-filter-path 'my.filter': "],
            id="two-at-once",
        ),
        pytest.param(
            {"custom_generate_function_path": "my.generate"},
            ["--custom-generate-function-path 'my.generate': "],
            id="custom-generate",
        ),
    ],
)
def test_a_refused_slime_flag_is_one_error_at_start(args, messages):
    from bridge.flags import FlagError
    from bridge.slime import SERVICE_ATTRIBUTE, service_for

    slime_args = SimpleNamespace(**args)
    with pytest.raises(FlagError) as refused:
        service_for(slime_args, group_size=None)
    assert str(refused.value).startswith("Turnstile's rollout cannot run with these slime flags:")
    for message in messages:
        assert message in str(refused.value)
    assert getattr(slime_args, SERVICE_ATTRIBUTE, None) is None  # nothing was started


def test_generate_rollout_without_a_data_source_is_one_error_but_with_no_args_either_runs_the_embedded_default():
    from bridge.slime import SERVICE_ATTRIBUTE, generate_rollout

    slime_args = SimpleNamespace(rollout_batch_size=1, n_samples_per_prompt=1)
    with pytest.raises(ValueError) as refused:
        generate_rollout(slime_args, 0, None)
    assert str(refused.value) == (
        "generate_rollout: data_source is None: slime passes its RolloutDataSource; call it with one, or with "
        "args=None and no data source for the embedded default"
    )
    assert getattr(slime_args, SERVICE_ATTRIBUTE, None) is None  # nothing was started

    out = generate_rollout(None, 0, None)  # the embedded default, prompts and all: the README's smoke test
    assert len(out.samples) == 2 and all(len(group) == 4 for group in out.samples)
    for group in out.samples:
        assert len({s.group_index for s in group}) == 1 and len({s.prompt[0]["content"] for s in group}) == 1
        assert all(s.response_length == len(s.loss_mask) == len(s.rollout_log_probs) > 0 for s in group)
    again = generate_rollout(None, 1, None)  # the next step takes the next prompts
    assert {g[0].group_index for g in again.samples}.isdisjoint({g[0].group_index for g in out.samples})


def test_rm_type_without_slime_is_refused_at_start():
    from bridge.rewards import HookError, SlimeScoring, slime_rm_hub

    if slime_rm_hub() is not None:
        pytest.skip("slime imports here: its rm_hub scores --rm-type")
    with pytest.raises(HookError, match=re.escape("--rm-type 'math' is slime's reward rule (slime.rollout.rm_hub)")):
        SlimeScoring(SimpleNamespace(rm_type="math"), tokenizer=None)


def test_a_hook_path_that_does_not_load_is_refused_at_start():
    from bridge.rewards import HookError, SlimeScoring

    message = "--custom-rm-path 'no_such_pkg.reward' does not load: ModuleNotFoundError"
    with pytest.raises(HookError, match=re.escape(message)):
        SlimeScoring(SimpleNamespace(custom_rm_path="no_such_pkg.reward"), tokenizer=None)


# -- the env path -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "message"),
    [
        pytest.param(None, "env module 'no_such_pkg.env' does not import: ModuleNotFoundError", id="no-such-module"),
        pytest.param("", "env module file 'ENV' does not exist", id="no-such-file"),
        pytest.param(
            "raise RuntimeError('no sandbox client')\n",
            "env module file 'ENV' does not import: RuntimeError('no sandbox client')",
            id="import-raises",
        ),
        pytest.param("def make_env(): ...\n", "env module 'ENV' has no build_env", id="no-build-env"),
        pytest.param(
            "build_env = 3\n", "env module 'ENV': build_env is a int, not callable", id="build-env-not-callable"
        ),
        pytest.param(
            "def build_env(): ...\n",
            "env module 'ENV': build_env() takes neither build_env(sample=..., args=...)",
            id="build-env-takes-no-sample",
        ),
        pytest.param(
            "def build_env(sample=None, args=None): ...\nformat_observation = 'obs'\n",
            "env module 'ENV': format_observation is not callable",
            id="format-observation-not-callable",
        ),
        pytest.param("YAML", "env module 'no_such_pkg.env' does not import", id="yaml-rollout-interaction-env-path"),
        pytest.param(
            "HERE",
            """env module 'my_env' does not import: ModuleNotFoundError("No module named 'my_env'"); my_env.py is a """
            "file here: give it as a path, my_env.py, or put its folder on PYTHONPATH",
            id="a-file-here-named-as-a-module",
        ),
    ],
)
def test_an_env_path_that_does_not_load_is_one_error_at_start(tmp_path, capsys, monkeypatch, module, message):
    env = tmp_path / "my_env.py"
    if module == "HERE":  # `--env my_env` beside my_env.py: not on sys.path, as a console script runs
        env.write_text("def build_env(sample=None, args=None): ...\n")
        monkeypatch.chdir(tmp_path)
        argv = ["--env", "my_env"]
    elif module == "YAML":  # slime's key, in `turnstile run`'s YAML; under slime, the same loader at service start
        argv = ["--config", write(tmp_path / "run.yaml", "rollout_interaction_env_path: no_such_pkg.env\n")]
    elif module is None:
        argv = ["--env-path", "no_such_pkg.env"]
    else:
        if module:
            env.write_text(module)
        argv = ["--env-path", str(env)]
    refused_at_start(*run(tmp_path, capsys, "--num-prompts", "1", *argv), message.replace("ENV", str(env)))


# -- prompt rows --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "message"),
    [
        pytest.param('{"prompt": [', "rows.jsonl:2: not a JSON object: ", id="not-json"),
        pytest.param(
            '["hi"]', "rows.jsonl:2: 'prompt' must be a list of chat messages or rendered text", id="not-an-object"
        ),
        pytest.param(
            {"label": "4"}, "rows.jsonl:2: 'prompt' must be a list of chat messages or rendered text", id="no-prompt"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "hi"}]},
            "rows.jsonl:2: no 'prompt', but 'messages': a row gives its chat messages (or rendered text) as 'prompt'",
            id="messages-not-prompt",
        ),
        pytest.param(
            {"prompt": 4},
            "rows.jsonl:2: 'prompt' must be a list of chat messages or rendered text",
            id="prompt-a-number",
        ),
        pytest.param({"prompt": []}, "rows.jsonl:2: 'prompt' is empty", id="prompt-empty"),
        pytest.param({"prompt": ""}, "rows.jsonl:2: 'prompt' is empty", id="rendered-prompt-empty"),
        pytest.param(
            {"prompt": ["hi"]},
            "rows.jsonl:2: prompt message 0 must be an object with a string 'role', got 'hi'",
            id="message-not-an-object",
        ),
        pytest.param(
            {"prompt": [{"content": "hi"}]},
            "rows.jsonl:2: prompt message 0 must be an object with a string 'role'",
            id="message-without-role",
        ),
        pytest.param(
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "usr", "content": "hi"}]},
            "rows.jsonl:2: prompt message 1 has role 'usr' (did you mean 'user'?): one of system, developer, user, "
            "assistant, tool (a chat template renders another role as nothing, or raises)",
            id="unknown-role",
        ),
        pytest.param(
            {"prompt": [{"role": "user", "content": 4}]},
            "rows.jsonl:2: prompt message 0: 'content' must be text or a list of parts, not int",
            id="content-a-number",
        ),
        pytest.param(
            {"prompt": "hi", "metadata": "easy"},
            "rows.jsonl:2: 'metadata' must be an object, not str",
            id="metadata-not-an-object",
        ),
        pytest.param(
            {"prompt": "hi", "images": "a.png"},
            "rows.jsonl:2: 'images' must be a list of images, not str",
            id="images-not-a-list",
        ),
        pytest.param(None, "rows.jsonl: no prompt rows in the file", id="no-rows"),
        pytest.param("MISSING", "No such file or directory: ", id="no-such-file"),
    ],
)
def test_a_bad_prompt_row_is_one_error_at_start_naming_its_line(tmp_path, capsys, row, message):
    rows = tmp_path / "rows.jsonl"
    if row is None:
        rows.write_text("\n")
    elif row != "MISSING":
        write_rows(tmp_path, GOOD, row)
    refused_at_start(*run(tmp_path, capsys, "--prompts", str(rows)), message)


@pytest.mark.parametrize(
    ("bad", "argv", "message"),
    [
        pytest.param(
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": "bm90IGFuIGltYWdl"}]}]},
            ["--vision"],
            "image 1 of 1 does not decode ('bm90IGFuIGltYWdl'): cannot identify image file",
            id="image-does-not-decode",
        ),
        pytest.param(
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": 7}]}]},
            ["--vision"],
            "image 1 of 1 does not decode (7): unsupported image type int",
            id="image-of-wrong-type",
        ),
        pytest.param(
            {
                "prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                "images": ["data:image/png;base64,AAAA"],
            },
            ["--vision"],
            "image 1 of 1 does not decode ('data:image/png;base64,AAAA')",
            id="rendered-prompt-image",
        ),
        pytest.param(
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]},
            [],
            "a 'user' message holds images but the encoder has no VLM processor",
            id="image-without-vlm",
        ),
        pytest.param(
            {"prompt": [{"role": "user", "content": "a forbidden question"}]},
            ["--chat-template", "REFUSES"],
            "the word forbidden is not allowed",
            id="template-raises",
        ),
    ],
)
def test_a_prompt_that_does_not_encode_fails_its_trajectory_only(tmp_path, capsys, bad, argv, message):
    rows = write_rows(tmp_path, GOOD, {**bad, "metadata": {"case": "bad"}})
    argv = [write(tmp_path / "refuses.jinja", REFUSES_A_WORD) if a == "REFUSES" else a for a in argv]
    env = write(tmp_path / "case_env.py", CASE_ENV)
    with SGLangDouble() as server:
        code, records, err = run(tmp_path, capsys, *SERVER(server.url), "--prompts", rows, "--env-path", env, *argv)
    assert code == 0, err
    failed = only_bad_one_failed(records)
    [error] = failed["errors"]
    assert (failed["stop_reason"], error["class"], failed["metadata"]["case"]) == ("encode_error", "bad_prompt", "bad")
    where = f"group {failed['group_id']}, member {failed['index']}"
    assert error["message"].startswith(f"the prompt of {where} does not encode: ")
    assert message in error["message"] and failed["turns"] == []


# -- chat templates -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "message"),
    [
        pytest.param("MISSING", "chat template 'MISSING': no such file (and not Jinja text", id="file-missing"),
        pytest.param(
            "qwen.j2", "chat template 'qwen.j2': no such file (and not Jinja text", id="neither-file-nor-jinja"
        ),
        pytest.param(
            "{% for m in messages %}{{ m.content }",
            "the chat template does not render: TemplateSyntaxError: ",
            id="not-valid-jinja",
        ),
        pytest.param(
            "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}",
            "the chat template drops assistant messages; delta encoding cannot find the turn end",
            id="drops-assistant-turns",
        ),
        pytest.param(
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
            "after the assistant's content, not an end-of-turn token",
            id="no-end-of-turn-token",
        ),
        pytest.param(
            "NO_TEMPLATE",
            "has no chat template; pass chat_template= (Jinja text or a .jinja file)",
            id="tokenizer-without-template",
        ),
        pytest.param("--vision", "--tokenizer and --chat-template are not read with it", id="with-vision"),
    ],
)
def test_a_chat_template_that_cannot_work_is_one_error_at_start(tmp_path, capsys, template, message):
    missing = str(tmp_path / "missing.jinja")
    if template == "NO_TEMPLATE":  # a tokenizer saved without a template, and no --chat-template
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
        argv = ["--tokenizer", str(tmp_path / "tok")]
    elif template == "--vision":
        argv = ["--vision", "--chat-template", write(tmp_path / "t.jinja", QWEN)]
    else:
        argv = ["--chat-template", missing if template == "MISSING" else template]
    refused_at_start(*run(tmp_path, capsys, "--num-prompts", "1", *argv), message.replace("MISSING", missing))


def test_a_template_without_a_generation_prompt_is_taken_as_it_is():
    """Today: accepted. Nothing tells it from a template whose turn end is its generation prompt (Mistral's
    `[/INST]`), so the prompt (and every observation) ends where the template stops: the model is asked to
    go on from the end of the user's turn, with no assistant header."""
    encoder = ChatEncoder(load_tokenizer("qwen2.5", chat_template=NO_GENERATION_PROMPT))
    text = encoder.tokenizer.decode(encoder.encode_prompt([{"role": "user", "content": "hi"}]).token_ids)
    observation = encoder.tokenizer.decode(encoder.encode_observation({"role": "user", "content": "no"}).token_ids)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n") and observation == "\n<|im_start|>user\nno<|im_end|>\n"


@pytest.mark.anyio
async def test_a_template_that_rewrites_history_runs_and_the_drift_check_names_the_turn():
    """Today: accepted. The trajectory keeps the tokens the model saw; `drift_check` (every N-th trajectory
    with `drift_check_every`, counted as turnstile_drift_checks_total{result="drift"}) names the first turn a
    full re-render differs in."""
    encoder = ChatEncoder(load_tokenizer("qwen2.5", chat_template=REWRITES_HISTORY))
    ids = lambda text: encoder.tokenizer(text, add_special_tokens=False)["input_ids"] + [encoder.end_of_turn_id]  # noqa: E731
    backend = ScriptedBackend([ids("<think>6 times 7</think>42"), ids("42")])
    env = ScriptedEnv([{"role": "user", "content": "sure?"}, {"role": "user", "content": "yes"}])
    trajectory = await run_trajectory(
        Trajectory(prompt=[{"role": "user", "content": "6 * 7?"}]),
        backend=backend,
        env=EnvRunner(env),
        encoder=encoder,
        sampling=SamplingParams(max_new_tokens=32, stop_token_ids=encoder.stop_token_ids),
        limits=TurnLimits(max_turns=2),
    )
    assert trajectory.status is Status.COMPLETED and not trajectory.errors
    report = encoder.drift_check(trajectory)
    assert (report.exact, report.turn, report.part) == (False, 0, "generated")
    assert "<think>" in report.actual and "<think>" not in report.expected


# -- what an env gives back: its env, and its observations' images -------------------------------------


@pytest.mark.parametrize(
    ("case", "argv", "error_class", "stop_reason", "message"),
    [
        pytest.param(
            "build-env-raises",
            [],
            "env_exception",
            "env_error",
            "env module 'ENV': build_env raised KeyError('no sandbox image for this task') (retry budget spent after 1",
            id="build-env-raises",
        ),
        pytest.param(
            "build-env-returns-none",
            [],
            "env_exception",
            "env_error",
            "env module 'ENV': build_env returned NoneType, which has no step() or astep()",
            id="build-env-returns-none",
        ),
        pytest.param(
            "undecodable-image",
            ["--vision"],
            "bad_observation",
            "encode_error",
            "image 1 of 1 does not decode (12 bytes): cannot identify image file",
            id="undecodable-image",
        ),
        pytest.param(
            "image-of-wrong-type",
            ["--vision"],
            "bad_observation",
            "encode_error",
            "image 1 of 1 does not decode (5): unsupported image type int",
            id="image-of-wrong-type",
        ),
        pytest.param(
            "image-without-vlm",
            [],
            "bad_observation",
            "encode_error",
            "a 'user' message holds images but the encoder has no VLM processor",
            id="image-without-vlm",
        ),
    ],
)
def test_an_env_that_fails_fails_its_trajectory_only(tmp_path, capsys, case, argv, error_class, stop_reason, message):
    env = write(tmp_path / "case_env.py", CASE_ENV)
    rows = write_rows(tmp_path, GOOD, {"prompt": [{"role": "user", "content": "bad"}], "metadata": {"case": case}})
    config = write(tmp_path / "run.yaml", NO_BACKOFF)
    with SGLangDouble() as server:
        code, records, err = run(
            tmp_path,
            capsys,
            *SERVER(server.url),
            "--prompts",
            rows,
            "--env-path",
            env,
            "--config",
            config,
            "--max-new-tokens",
            "4",
            *argv,
        )
    assert code == 0, err
    failed = only_bad_one_failed(records)
    assert (failed["stop_reason"], failed["errors"][-1]["class"], failed["metadata"]["case"]) == (
        stop_reason,
        error_class,
        case,
    )
    assert message.replace("ENV", env) in failed["errors"][-1]["message"]


# -- server URLs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        pytest.param(
            None, "is not healthy: SGLang server at URL is unreachable: GET /workers: ConnectError", id="unreachable"
        ),
        pytest.param(
            lambda s: s.reply_next("/workers", Raw(200, "<html>It works!</html>", "text/html")),
            "is not healthy: SGLang server at URL: GET /workers: the reply is not JSON; reply: <html>It works!</html>",
            id="not-sglang",
        ),
        pytest.param(
            lambda s: s.reply_next("/health", Raw(404, {"detail": "Not Found"})),
            "the sglang backend at URL is not healthy: GET /health answered HTTP 404: nothing at URL serves SGLang's "
            "API (an SGLang server or an sglang-router answers 200)",
            id="no-health-route",
        ),
        pytest.param(
            lambda s: setattr(s, "healthy", False),
            "the sglang backend at URL is not healthy: GET /health answered HTTP 503: the server is starting (loading "
            "its model) or has no healthy worker; try once it answers 200",
            id="starting",
        ),
        pytest.param(
            lambda s: s.reply_next("/workers", Raw(200, {"workers": [], "total": 0})),
            'sglang-router at URL lists no workers (GET /workers: {"workers": [], "total": 0}): no worker has '
            "registered with it yet, or none is reachable from it",
            id="router-without-workers",
        ),
        pytest.param(
            lambda s: s.reply_next("/model_info", Raw(200, {"model_path": "m"})),
            "turnstile: SGLang server at URL: GET /model_info: no weight_version in the reply",
            id="no-weight-version",
        ),
    ],
)
def test_a_server_url_that_is_no_sglang_server_is_one_error_at_start(tmp_path, capsys, setup, message):
    if setup is None:
        url = f"http://127.0.0.1:{free_port()}"
        code, records, err = run(tmp_path, capsys, *SERVER(url), "--num-prompts", "1")
    else:
        with SGLangDouble() as server:
            setup(server)
            url = server.url
            code, records, err = run(tmp_path, capsys, *SERVER(url), "--num-prompts", "1")
            assert not server.requests_to("/generate")
    refused_at_start(code, records, err, message.replace("URL", url))


@pytest.mark.parametrize(
    ("model_info", "message"),
    [
        pytest.param(
            None,
            "--url without --tokenizer: the server's tokenizer is not known (URL/model_info: the server serves "
            "'double', whose tokenizer 'double' is not a directory here): give it with --tokenizer DIR (--tokenizer "
            "qwen2.5 for the built-in Qwen2.5 one)",
            id="not-here",
        ),
        pytest.param(
            Raw(404, {"detail": "Not Found"}),
            "--url without --tokenizer: the server's tokenizer is not known (URL/model_info: HTTP 404)",
            id="no-model-info",
        ),
    ],
)
def test_a_url_without_a_tokenizer_that_is_not_here_is_one_error_at_start(tmp_path, capsys, model_info, message):
    """The built-in Qwen2.5 tokenizer is never guessed for a server's model."""
    with SGLangDouble() as server:
        if model_info is not None:
            server.reply_next("/model_info", model_info)
        code, records, err = run(tmp_path, capsys, "--url", server.url, "--num-prompts", "1")
        assert not server.requests_to("/generate")
    refused_at_start(code, records, err, message.replace("URL", server.url))


def test_a_url_without_a_tokenizer_where_nothing_listens_is_one_error_saying_so(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, records, err = run(tmp_path, capsys, "--url", url, "--num-prompts", "1")
    refused_at_start(
        code, records, err, f"turnstile: error: the server at {url} is unreachable: GET /model_info: ConnectError: "
    )
    assert "(asked for its tokenizer, as --tokenizer is not given)" in err and "--tokenizer DIR" not in err


def test_a_url_without_a_tokenizer_takes_the_servers_own_where_it_is_here(tmp_path, capsys):
    here = str(_qwen_tokenizer_dir())
    with SGLangDouble() as server:
        server.reply_next("/model_info", Raw(200, {"model_path": "/models/q", "tokenizer_path": here}))
        code, records, err = run(tmp_path, capsys, "--url", server.url, "--num-prompts", "1", "--max-turns", "1")
    assert code == 0 and len(records) == 1, err
    assert f"turnstile: tokenizer {here} (the server's, from GET /model_info)" in err


# -- server replies -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "error_class", "message"),
    [
        pytest.param(
            Raw(500, error_body(500, "CUDA OOM")), "server", "POST /generate: HTTP 500; reply: ", id="http-5xx"
        ),
        pytest.param(
            Raw(400, error_body(400, "bad sampling")), "client", "POST /generate: HTTP 400; reply: ", id="http-4xx"
        ),
        pytest.param(
            Raw(200, "OK", "text/plain"), "malformed", "POST /generate: the reply is not JSON; reply: OK", id="not-json"
        ),
        pytest.param(
            Generate(drop=("meta_info",)),
            "malformed",
            "POST /generate: the reply has no meta_info object",
            id="no-meta-info",
        ),
        pytest.param(
            Generate(drop=("meta_info.output_token_logprobs",)),
            "malformed",
            "meta_info.output_token_logprobs is missing (was return_logprob sent?)",
            id="no-logprobs",
        ),
        pytest.param(
            Generate(drop=("meta_info.prompt_tokens",)),
            "malformed",
            "meta_info.prompt_tokens is missing or not an integer",
            id="no-prompt-tokens",
        ),
        pytest.param(Generate(drop=("text",)), "malformed", "POST /generate: the reply has no text", id="no-text"),
        pytest.param(
            Generate(finish="eos"), "malformed", "unknown finish_reason {'type': 'eos'}", id="unknown-finish-reason"
        ),
        pytest.param(
            Generate(token_ids=[15, 16], output_ids=[15]),
            "malformed",
            "output_ids has 1 tokens but output_token_logprobs has 2",
            id="token-counts-disagree",
        ),
        pytest.param(Disconnect(), "connection", "is unreachable: POST /generate: RemoteProtocolError", id="no-answer"),
    ],
)
def test_a_bad_server_reply_fails_its_trajectory_only(tmp_path, capsys, reply, error_class, message):
    config = write(tmp_path / "run.yaml", NO_RETRY)
    with SGLangDouble() as server:
        server.script(reply)
        code, records, err = run(
            tmp_path, capsys, *SERVER(server.url), "--num-prompts", "2", "--max-turns", "2", "--config", config
        )
    assert code == 0, err
    failed = only_bad_one_failed(records)
    [error] = failed["errors"]
    assert (failed["stop_reason"], error["class"], error["stage"]) == ("backend_error", error_class, "backend")
    assert error["message"].startswith(f"SGLang server at {server.url}") and message in error["message"]


def test_a_failed_reply_is_retried_within_its_class_budget(tmp_path, capsys):
    config = write(tmp_path / "run.yaml", NO_BACKOFF)
    with SGLangDouble() as server:
        server.script(Raw(503, error_body(503, "overloaded")))
        code, records, err = run(
            tmp_path, capsys, *SERVER(server.url), "--num-prompts", "2", "--max-turns", "2", "--config", config
        )
    assert code == 0 and {r["status"] for r in records} == {"completed"}, err
    assert sorted(r["metadata"].get("retries", {}).get("server", 0) for r in records) == [0, 1]


def test_a_vision_token_the_model_samples_fails_its_trajectory_only(tmp_path, capsys):
    """A random or early policy samples `<|image_pad|>`: sent back, SGLang could not match it to an image,
    nor could the trainer. Its turn keeps the tokens before it; that trajectory ends, no other."""
    rows, env = write_rows(tmp_path, GOOD, GOOD), write(tmp_path / "case_env.py", CASE_ENV)
    with SGLangDouble() as server:
        server.script(Generate(token_ids=[15, IMAGE_PAD, 16]))
        code, records, err = run(
            tmp_path, capsys, "--url", server.url, "--prompts", rows, "--env-path", env, "--vision"
        )
    assert code == 0, err
    failed = only_bad_one_failed(records)
    [error] = failed["errors"]
    assert (failed["stop_reason"], error["class"], error["stage"]) == ("encode_error", "bad_response", "encode")
    assert error["message"] == (
        "turn 0: the model sampled '<|image_pad|>' (token 151655) at its token 1, a token only the VLM "
        "processor writes; the turn is cut before it"
    )
    prompt_length = failed["prompt_length"]
    assert failed["tokens"][prompt_length:] == [15] and failed["loss_mask"] == [1]
    assert [turn["num_generated"] for turn in failed["turns"]] == [1]


# -- the table ----------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param(
            {"prompt": [{"role": "user", "content": "x"}], "metadata": "oops"},
            "the prompt row of group 1: 'metadata' must be an object, not str",
            id="metadata-not-an-object",
        ),
        pytest.param(
            {"prompt": [{"role": "robot", "content": "x"}]},
            "the prompt row of group 1: prompt message 0 has role 'robot': one of system, developer, user, assistant, "
            "tool (a chat template renders another role as nothing, or raises)",
            id="unknown-role",
        ),
    ],
)
async def test_a_bad_row_from_a_python_source_fails_its_own_group_only(tokenizer, bad, message):
    from engine.engine import EngineConfig, RolloutEngine
    from tests.fakes import DeterministicBackend
    from tests.test_engine import env_factory, rows

    source = [rows(1)[0], bad]
    async with RolloutEngine(
        backend=DeterministicBackend(), encoder=ChatEncoder(tokenizer), env_factory=env_factory(), source=source,
        config=EngineConfig(n_samples_per_prompt=2, max_failed_share=1.0),
    ) as engine:  # fmt: skip
        groups = sorted(await engine.rollout(2), key=lambda g: g.group_id)
    assert [len(g.trajectories) for g in groups] == [2, 2]
    assert {t.status for t in groups[0].trajectories} == {Status.COMPLETED}
    for trajectory in groups[1].trajectories:
        assert (trajectory.status, str(trajectory.stop_reason)) == (Status.FAILED, "encode_error")
        assert trajectory.errors[-1].message == message


@pytest.mark.anyio
async def test_an_engine_that_cannot_start_raises_its_own_error(tokenizer):
    from engine.engine import EngineConfig, RolloutEngine
    from tests.fakes import DeterministicBackend
    from tests.test_engine import env_factory

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        engine = RolloutEngine(
            backend=DeterministicBackend(), encoder=ChatEncoder(tokenizer), env_factory=env_factory(), source=[],
            config=EngineConfig(metrics_port=taken.getsockname()[1]),
        )  # fmt: skip
        with pytest.raises(OSError, match="[Aa]ddress already in use"):
            async with engine:
                pass


def test_a_ray_address_nothing_answers_on_is_one_error_at_once():
    from engine.envs.ray_workers import _check_reachable
    from tests.net import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=rf"no Ray cluster at ray_address '{address}': cannot connect"):
        _check_reachable(address)
    for left_to_ray in ("auto", "local", "ray://head:10001", None):
        _check_reachable(left_to_ray)


def test_the_docs_table_names_every_case_and_every_case_is_in_it():
    section = (ROOT / "docs" / "bad_input.md").read_text()
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| input ")]
    named = [re.findall(r"`(test_\w+(?:\[[\w-]+\])?)`", row.rsplit(" | ", 1)[-1]) for row in rows]
    assert rows and all(named), [row for row, names in zip(rows, named, strict=True) if not names]
    cases = set()
    for name, test in vars(sys.modules[__name__]).items():
        if not name.startswith("test_") or name == "test_the_docs_table_names_every_case_and_every_case_is_in_it":
            continue
        marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
        cases |= {f"{name}[{param.id}]" for m in marks for param in m.args[1]} if marks else {name}
    listed = {name for names in named for name in names}
    assert listed - cases == set(), "docs/bad_input.md names tests that do not exist"
    assert cases - listed == set(), "tests docs/bad_input.md's table does not list"


# -- agent requests to the session gateway (engine/agents, docs/agents.md) --------------------------------
PICTURE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
CHAT, RESPONSES, MESSAGES = "v1/chat/completions", "v1/responses", "v1/messages"
USER = [{"role": "user", "content": "x"}]
TOOL_USE = [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]
DEEP: dict = {"type": "string"}
for _ in range(60):
    DEEP = {"type": "object", "properties": {"a": DEEP}}
NEST: list = []
for _ in range(100):
    NEST = [NEST]
AGENT_CASES = [  # the API, the body, the status, the error message (or its start)
    pytest.param(CHAT, {"messages": USER}, 404, "no open session 'nobody'", id="unknown-session"),
    pytest.param(CHAT, b"{oops", 400, "the body is not JSON", id="not-json"),
    pytest.param(CHAT, {"messages": USER, "n": 2}, 400, "n=2: a session samples one reply per request", id="n-above-1"),
    pytest.param(
        CHAT, {"messages": USER, "tool_choice": "required"}, 400,
        "tool_choice='required': the policy chooses its own calls", id="forced-tool-choice",
    ),
    pytest.param(
        CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400,
        "messages[0].role is 'robot'; one of system, developer, user, assistant, tool", id="unknown-role",
    ),
    pytest.param(
        CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400,
        "messages[0] is a tool message without tool_call_id", id="tool-message-without-id",
    ),
    pytest.param(
        CHAT, {"messages": [{"role": "tool", "tool_call_id": {"id": "call_9"}, "content": "x"}]}, 400,
        "messages[0] is a tool message without tool_call_id (a string)", id="tool-call-id-not-a-string",
    ),
    pytest.param(
        CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0] is a user message without content",
        id="message-without-content",
    ),
    pytest.param(
        CHAT, {"messages": [{"role": "user", "content": "x", "name": NEST}]}, 400,
        "message 1 of the conversation is nested deeper than 64 levels", id="message-nested-too-deep",
    ),
    pytest.param(
        CHAT, {"messages": [*USER, {"role": "tool", "tool_call_id": "call_9", "content": "42"}]}, 400,
        "a tool result answers tool call 'call_9', which no assistant turn before it made",
        id="tool-result-for-no-call",
    ),
    pytest.param(
        CHAT, {"messages": USER, "temperature": 0.3}, 400, "temperature: the rollout's sampling settings rule",
        id="client-sampling-refused",
    ),
    pytest.param(
        CHAT, {"messages": [{"role": "user", "content": [PICTURE]}]}, 400,
        "the request holds images, but the policy takes none (no VLM processor)", id="images-without-processor",
    ),
    pytest.param(
        RESPONSES, {"input": "x", "previous_response_id": "resp_1"}, 400,
        "previous_response_id: the gateway keeps no responses; send the whole input (store: false)",
        id="previous-response-id",
    ),
    pytest.param(
        CHAT, {"messages": USER}, 401,
        "invalid API key: give this session's key (or the gateway's) as x-api-key or Authorization: Bearer",
        id="wrong-key",
    ),
    pytest.param(
        CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
        400, "tools[0]: its schema is nested deeper than 48 levels", id="tool-schema-too-deep",
    ),
    pytest.param(
        CHAT, b"{" + b" " * (17 << 20) + b"}", 413,
        "the request body is 17825794 bytes, more than the 16777216 bytes a request may send", id="body-too-large",
    ),
    pytest.param(
        RESPONSES, {"input": [{"role": "user", "content": "x"},
                              {"type": "function_call_output", "call_id": "call_9", "output": "42"}]}, 400,
        "a tool result answers tool call 'call_9', which no assistant turn before it made",
        id="function-call-output-for-no-call",
    ),
    pytest.param(
        MESSAGES, {"max_tokens": 8, "messages": [{"role": "user", "content": TOOL_USE}]}, 400,
        "messages.0.content.0: a 'tool_use' block has no place in a user message", id="block-out-of-place",
    ),
    pytest.param(MESSAGES, {"messages": USER}, 400, "max_tokens: Field required", id="no-max-tokens"),
    pytest.param(
        MESSAGES, {"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "42"}]}]}, 400,
        "a tool result answers tool call 'toolu_9', which no assistant turn before it made",
        id="tool-result-block-for-no-call",
    ),
]  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body", "status", "message"), AGENT_CASES)
async def test_a_bad_agent_request_is_the_apis_own_error_and_ends_nothing_else(path, body, status, message, tokenizer):
    import httpx2

    from tests.gateway_kit import PROMPT, gateway_over, sampled

    encoder = ChatEncoder(tokenizer)
    gateway, _ = gateway_over(encoder, [sampled(encoder, "Fine.")], client_sampling="refuse")
    async with gateway.serving(), httpx2.AsyncClient(base_url=gateway.url, timeout=60) as http:
        session = gateway.open_session()
        where = "nobody" if status == 404 else session.id
        key = {404: gateway.key, 401: "sk-guessed"}.get(status, session.key)
        content = body if isinstance(body, bytes) else json.dumps({"model": "policy", **body}).encode()
        reply = await http.post(f"/sessions/{where}/{path}", content=content, headers={"x-api-key": key})
        assert reply.status_code == status
        error = reply.json()["error"]  # OpenAI's {"error": {...}}; Anthropic's {"type": "error", "error": {...}}
        assert error["message"] == message or error["message"].startswith(message), error["message"]
        good = await http.post(
            f"/sessions/{session.id}/{CHAT}",
            json={"model": "policy", "messages": PROMPT},
            headers={"x-api-key": session.key},
        )
        assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == "Fine."
        (trajectory,) = await gateway.finish(session.id)
    assert trajectory.status is Status.COMPLETED and gateway.counts[f"bad_requests:{status}"] == 1
