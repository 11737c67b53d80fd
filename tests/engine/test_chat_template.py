"""render_chat against transformers' apply_chat_template on every fixture template."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError

from helexa.engine import chat_template
from helexa.engine.chat_template import TemplateRenderError, render_chat
from helexa.engine.tokenizer import Tokenizer, load_hf_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA_BOS = "<|begin_of_text|>"
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
# template → (tokenizer folder, .jinja file or None for the folder's tokenizer_config template)
TEMPLATES = {
    "Qwen3-0.6B": ("Qwen3-0.6B", None),
    "Qwen3.5-4B": ("Qwen3-0.6B", "Qwen3.5-4B/Qwen3.5-4B.jinja"),
    "Qwen3-Coder": ("Qwen3-0.6B", "Qwen3-Coder-30B-A3B-Instruct/Qwen3-Coder.jinja"),
    "Llama-3.2-3B": ("Llama-3.2-3B-Instruct", None),
    "Llama-3.1-8B": (
        "Llama-3.2-3B-Instruct",
        "Llama-3.1-8B-Instruct/meta-llama-Llama-3.1-8B-Instruct.jinja",
    ),
    "SmolLM2": ("SmolLM2-135M-Instruct", None),
    "Qwen2.5-0.5B": ("Qwen2.5-0.5B-Instruct", None),
    "DeepSeek-R1-Distill": ("DeepSeek-R1-Distill-Qwen-32B", None),
}
THINKING_TEMPLATES = ["Qwen3-0.6B", "Qwen3.5-4B"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]
ARGUMENTS = {"city": "Zürich", "unit": "celsius"}


def conversation(arguments: object, assistant_content: str | None = "") -> list[dict]:
    return [
        {"role": "system", "content": "You are terse. Ünïcödé is fine."},
        {"role": "user", "content": 'Weather in Zürich? <b>now</b> & "quoted"'},
        {
            "role": "assistant",
            "content": assistant_content,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "☀"}'},
    ]


@pytest.fixture(scope="module")
def model_dirs(fixtures_dir: Path, byte_tokenizer_dir) -> dict[str, Path]:
    """Tokenizer folders; the Llama and DeepSeek ones get a tiny byte-level tokenizer.json."""
    models = fixtures_dir / "models"
    dirs = {n: models / n for n in ("Qwen3-0.6B", "SmolLM2-135M-Instruct", "Qwen2.5-0.5B-Instruct")}
    dirs["Llama-3.2-3B-Instruct"] = byte_tokenizer_dir("Llama-3.2-3B-Instruct", prepend=LLAMA_BOS)
    dirs["DeepSeek-R1-Distill-Qwen-32B"] = byte_tokenizer_dir(
        "DeepSeek-R1-Distill-Qwen-32B", specials=DEEPSEEK_SPECIALS
    )
    return dirs


@pytest.fixture(scope="module")
def pairs(fixtures_dir: Path, model_dirs: dict[str, Path]) -> dict:
    """template name → (our Tokenizer, transformers tokenizer, explicit template or None)."""
    loaded = {
        name: (load_hf_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d))
        for name, d in model_dirs.items()
    }
    out = {}
    for name, (folder, jinja) in TEMPLATES.items():
        ours, hf = loaded[folder]
        template = None
        if jinja is not None:
            template = (fixtures_dir / "models" / jinja).read_text(encoding="utf-8")
            ours = dataclasses.replace(ours, chat_template=template)
        out[name] = (ours, hf, template)
    return out


def hf_render(pair: tuple, messages: list[dict], tools: list | None = TOOLS, **kwargs) -> str:
    _, hf, template = pair
    return hf.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
        **kwargs,
    )


@pytest.mark.parametrize("arguments", ["object", "json-string"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_render_is_byte_identical_to_transformers(pairs: dict, name: str, arguments: str) -> None:
    kwargs = {"date_string": "26 Jul 2024"}
    expected = hf_render(pairs[name], conversation(ARGUMENTS), **kwargs)
    args = ARGUMENTS if arguments == "object" else json.dumps(ARGUMENTS, ensure_ascii=False)
    got = render_chat(pairs[name][0], conversation(args), tools=TOOLS, chat_template_kwargs=kwargs)
    assert got == expected


@pytest.mark.parametrize("name", THINKING_TEMPLATES)
def test_enable_thinking_false_matches_transformers(pairs: dict, name: str) -> None:
    kwargs = {"enable_thinking": False}
    expected = hf_render(pairs[name], conversation(ARGUMENTS), **kwargs)
    got = render_chat(
        pairs[name][0], conversation(ARGUMENTS), tools=TOOLS, chat_template_kwargs=kwargs
    )
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", TEMPLATES)
def test_render_without_tools_matches_transformers(pairs: dict, name: str) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhello?\n</think>\n\nHello!"},
        {"role": "user", "content": "  Bye  "},
    ]
    kwargs = {"date_string": "1 Jan 2025"}
    expected = hf_render(pairs[name], messages, tools=None, **kwargs)
    assert render_chat(pairs[name][0], messages, chat_template_kwargs=kwargs) == expected


# Llama 3.2 defaults date_string to strftime_now; Llama 3.1 to a fixed "26 Jul 2024".
@pytest.mark.parametrize(
    ("name", "today"), [("Llama-3.2-3B", "14 Mar 2025"), ("Llama-3.1-8B", "26 Jul 2024")]
)
def test_date_string_comes_from_the_template_default(
    pairs: dict, name: str, today: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Frozen:
            return cls(2025, 3, 14, 9, 26, 53)

    monkeypatch.setattr(chat_template, "datetime", Frozen)
    monkeypatch.setattr("transformers.utils.chat_template_utils.datetime", Frozen)
    got = render_chat(pairs[name][0], conversation(ARGUMENTS), tools=TOOLS)
    assert got == hf_render(pairs[name], conversation(ARGUMENTS))
    assert f"Today Date: {today}\n" in got


@pytest.mark.parametrize("name", TEMPLATES)
def test_openai_null_content_on_tool_call_turns_renders(pairs: dict, name: str) -> None:
    # transformers drops the null and several templates then fail; we render what "" gives
    # (or what transformers gives, where it copes).
    kwargs = {"date_string": "26 Jul 2024"}
    arguments = json.dumps(ARGUMENTS)
    got = render_chat(
        pairs[name][0], conversation(arguments, None), tools=TOOLS, chat_template_kwargs=kwargs
    )
    assert got == hf_render(pairs[name], conversation(ARGUMENTS, ""), **kwargs)


def test_messages_are_never_mutated(pairs: dict) -> None:
    messages = conversation(json.dumps(ARGUMENTS), None)
    messages[2]["reasoning"] = "thought"
    before = copy.deepcopy(messages)
    render_chat(pairs["Qwen3-0.6B"][0], messages, tools=TOOLS)
    assert messages == before


def test_reasoning_field_aliases_reach_the_template(pairs: dict) -> None:
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "add them"},
    ]
    got = render_chat(pairs["Qwen3-0.6B"][0], messages, add_generation_prompt=False)
    assert got.endswith("<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")


def bare(template: str | dict | None = None, **fields: object) -> Tokenizer:
    """A Tokenizer with only what templates read; the backend is never touched by rendering."""
    return Tokenizer(backend=None, chat_template=template, **fields)  # type: ignore[arg-type]


def render(template: str, messages: list[dict] | None = None, **kwargs: object) -> str:
    return render_chat(bare(template), messages or [{"role": "user", "content": "hi"}], **kwargs)


def test_chatml_fallback_when_the_model_has_no_template() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    ]
    assert render_chat(bare(None), messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nAB<|im_end|>\n<|im_start|>assistant\n"
    )


def test_named_templates_pick_name_then_tool_use_then_default() -> None:
    tok = bare({"default": "D", "tool_use": "T", "rag": "R"})
    hi = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, hi) == "D"
    assert render_chat(tok, hi, tools=TOOLS) == "T"
    assert render_chat(tok, hi, tools=TOOLS, template_name="rag") == "R"
    with pytest.raises(TemplateRenderError, match="nope"):
        render_chat(tok, hi, template_name="nope")
    with pytest.raises(TemplateRenderError, match="default"):
        render_chat(bare({"tool_use": "T"}), hi)


def test_special_tokens_and_kwargs_reach_the_template() -> None:
    tok = bare("{{ bos_token }}|{{ eos_token }}|{{ additional_special_tokens[0] }}|{{ x }}")
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    tok.extra = {"additional_special_tokens": ["<extra>"]}
    got = render_chat(tok, [], chat_template_kwargs={"x": 1})
    assert got == "<s>|</s>|<extra>|1"
    assert (
        render_chat(tok, [], chat_template_kwargs={"x": 1, "eos_token": "E"}) == "<s>|E|<extra>|1"
    )


def test_python_string_methods_work_in_templates() -> None:
    template = (
        "{% set s = '  Hello, World  ' %}"
        "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.split(',')[1] }}|"
        "{{ s.strip().startswith('Hello') }}|{{ s.strip().endswith('World') }}|"
        "{{ s.replace('World', 'there') }}|{{ s.upper() }}|{{ s.lower() }}|{{ 'ab cd'.title() }}|"
        "{{ '{}-{}'.format(1, 'x') }}|{{ ','.join(['a', 'b']) }}|"
        "{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}|"
        "{{ messages[0].content.split('</think>')[-1] }}"
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{% break %}{% endfor %}"
    )
    got = render(template, [{"role": "user", "content": "<think>x</think>answer"}])
    assert got == (
        "Hello, World|Hello, World  |  Hello, World| World  |True|True|  Hello, there  |"
        "  HELLO, WORLD  |  hello, world  |Ab Cd|1-x|a,b|a=1|answer"
    )


def test_tojson_keeps_non_ascii_and_html_and_takes_options() -> None:
    value = {"b": "Zürich <&>", "a": [1, 2]}
    assert render("{{ v | tojson }}", chat_template_kwargs={"v": value}) == (
        '{"b": "Zürich <&>", "a": [1, 2]}'
    )
    assert render(
        "{{ v | tojson(indent=2, sort_keys=true) }}", chat_template_kwargs={"v": value}
    ) == json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)
    assert render(
        "{{ v | tojson(separators=(',', ':')) }}", chat_template_kwargs={"v": value}
    ) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_json_string_arguments_are_parsed_and_bad_json_stays_a_string() -> None:
    template = (
        "{% for c in messages[0].tool_calls %}"
        "{{ c.function.arguments is mapping }}:{{ c.function.arguments | tojson }};"
        "{% endfor %}"
    )
    calls = [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"type": "function", "function": {"name": "g", "arguments": "{not json"}},
        {"type": "function", "function": {"name": "h", "arguments": "[1]"}},
    ]
    got = render(template, [{"role": "assistant", "tool_calls": calls}])
    assert got == 'True:{"a": 1};False:"{not json";False:"[1]";'
    assert calls[0]["function"]["arguments"] == '{"a": 1}'


def test_raise_exception_becomes_template_render_error() -> None:
    with pytest.raises(TemplateRenderError, match="only user and assistant roles") as e:
        render("{{ raise_exception('only user and assistant roles are supported') }}")
    assert "only user and assistant roles" in e.value.message


def test_syntax_errors_and_undefined_calls_are_template_render_errors() -> None:
    with pytest.raises(TemplateRenderError, match="does not compile"):
        render("{% if %}")
    with pytest.raises(TemplateRenderError):
        render("{{ nothing.here() }}")
    with pytest.raises(TemplateRenderError, match="TypeError"):
        render("{{ 'a' + 1 }}")


def test_templates_are_compiled_once() -> None:
    source = "{{ messages | length }} compiled-once"
    assert chat_template._compile(source) is chat_template._compile(source)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ ''['__class__'] }}",
        "{{ messages | attr('__class__') }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ joiner.__init__.__globals__.os }}",
        "{{ lipsum.__globals__ }}",
        "{{ namespace.__init__ }}",
        "{{ messages.__class__.__base__ }}",
        "{{ messages[0].__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ dict.__call__.__globals__ }}",
        "{{ self._TemplateReference__context }}",
        "{{ '{0.__class__}'.format(1) }}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ namespace(_x=1) }}",
        "{{ namespace.mro() }}",
        "{{ cycler.reset.__globals__ }}",
        "{{ lipsum.__code__ }}",
    ],
)
def test_templates_cannot_reach_python_internals(template: str) -> None:
    with pytest.raises(TemplateRenderError, match=r"unsafe|underscore") as e:
        render(template)
    assert isinstance(e.value.__cause__, SecurityError)
