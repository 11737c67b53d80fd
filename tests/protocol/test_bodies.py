"""The API documents' body types (`helexa.protocol.bodies`) hold every field the parsers
read: a field a parser takes, or refuses by name, is one a client can find documented."""

from __future__ import annotations

from typing import Any

from helexa.node.loading import parse_load_options
from helexa.protocol import bodies
from helexa.protocol.anthropic import to_openai_chat
from helexa.protocol.openai import parse_chat_request, parse_completion_request
from helexa.protocol.responses import parse_responses_request


class Reads(dict):
    """A body that remembers which of its fields were looked at."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def fields(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def test_every_chat_field_the_parser_reads_is_documented():
    message = Reads(role="user", content="hi")
    body = Reads(model="m", messages=[message])
    parse_chat_request(body)
    assert body.read and body.read <= fields(bodies.ChatCompletionBody)
    assert message.read and message.read <= fields(bodies.ChatMessage)


def test_every_chat_tool_field_the_parser_reads_is_documented():
    function = Reads(name="f", parameters={"type": "object"})
    tool = Reads(type="function", function=function)
    parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    )
    assert tool.read <= fields(bodies.FunctionTool)
    assert function.read <= fields(bodies.FunctionDefinition)


def test_every_completions_field_the_parser_reads_is_documented():
    body = Reads(model="m", prompt="hi")
    parse_completion_request(body)
    assert body.read and body.read <= fields(bodies.CompletionBody)


def test_every_responses_field_the_parser_reads_is_documented():
    body = Reads(model="m", input="hi")
    parse_responses_request(body)
    assert body.read and body.read <= fields(bodies.ResponsesBody)


def test_every_messages_field_the_parser_reads_is_documented():
    body = Reads(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    to_openai_chat(body)
    assert body.read and body.read <= fields(bodies.MessagesBody)


def test_every_count_tokens_field_the_parser_reads_is_documented():
    body = Reads(model="m", messages=[{"role": "user", "content": "hi"}])
    to_openai_chat(body, counting=True)
    assert body.read and body.read <= fields(bodies.CountTokensBody)


def test_every_load_field_the_node_reads_is_documented():
    body = Reads(model_id="org/name")
    parse_load_options(body)
    assert body.read and body.read <= fields(bodies.LoadBody)
