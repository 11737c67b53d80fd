"""The request and answer bodies as the wire carries them, as types: what each role's
OpenAPI document (`helexa.web.openapi`) is generated from. No I/O, no behaviour.

The parsers beside this module (`openai.py`, `responses.py`, `anthropic.py`) are what
validates a body; these types only describe it, and a test holds the two together: every
field a parser reads is a field here. Answers are described by their fields as the node and
the gateway write them; fields the types leave out are never relied upon by clients.
"""

# No `from __future__ import annotations`: TypedDict reads `Required[...]` at class
# creation only from evaluated annotations (`__required_keys__`).
from typing import Any, Literal, Required, TypedDict

# -- OpenAI chat completions ------------------------------------------------------------------


class ContentPart(TypedDict, total=False):
    """`{type: "text", text}` or `{type: "image_url", image_url: {url}}`; other part types
    are passed to chat templates that know them."""

    type: Required[str]
    text: str
    image_url: dict[str, Any]


class FunctionCall(TypedDict, total=False):
    name: Required[str]
    arguments: str | dict[str, Any]  # a JSON string (or, leniently, an object)


class ToolCall(TypedDict, total=False):
    id: str
    type: Literal["function"]
    function: Required[FunctionCall]


class ChatMessage(TypedDict, total=False):
    role: Required[Literal["system", "developer", "user", "assistant", "tool"]]
    content: str | list[ContentPart] | None
    name: str
    tool_calls: list[ToolCall]  # assistant messages only
    tool_call_id: str  # tool messages: the call this answers
    reasoning_content: str  # an assistant's earlier reasoning, for templates that keep it


class FunctionDefinition(TypedDict, total=False):
    name: Required[str]
    description: str
    parameters: dict[str, Any]  # a JSON Schema
    strict: bool  # calls must match `parameters` exactly


class FunctionTool(TypedDict, total=False):
    type: Literal["function"]
    function: Required[FunctionDefinition]


class NamedToolChoice(TypedDict, total=False):
    type: Literal["function"]
    function: Required[dict[str, str]]  # {name}


class StreamOptions(TypedDict, total=False):
    include_usage: bool  # a last chunk with the usage and no choices


class ResponseFormat(TypedDict, total=False):
    """`{type: "text"}`, `{type: "json_object"}` or `{type: "json_schema", json_schema:
    {name, schema, strict}}`: what the output must parse as."""

    type: Required[Literal["text", "json_object", "json_schema"]]
    json_schema: dict[str, Any]


class StructuredOutputs(TypedDict, total=False):
    """vLLM's constraint on the output (its `regex`, `choice` and `grammar` are refused)."""

    json: dict[str, Any]  # a JSON Schema
    json_object: bool


class _SamplingBody(TypedDict, total=False):
    """What chat and completions requests share (vLLM's extensions included)."""

    model: Required[str]
    stream: bool
    stream_options: StreamOptions
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    stop: str | list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    skip_special_tokens: bool
    user: str
    logit_bias: dict[str, float]  # token id (as a string) → bias in -100..100
    response_format: ResponseFormat
    guided_json: dict[str, Any] | str
    structured_outputs: StructuredOutputs
    # refused with a 400 naming them (only JSON output can be constrained):
    guided_regex: None
    guided_choice: None
    guided_grammar: None


class ChatCompletionBody(_SamplingBody, total=False):
    """`POST /v1/chat/completions`."""

    messages: Required[list[ChatMessage]]
    max_completion_tokens: int
    logprobs: bool
    top_logprobs: int
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice
    parallel_tool_calls: bool
    chat_template_kwargs: dict[str, Any]  # e.g. {"enable_thinking": false}
    reasoning_effort: str  # "none" turns reasoning off


class CompletionBody(_SamplingBody, total=False):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    # text, token ids, or a batch of one of either (batches of more are refused)
    prompt: Required[str | list[Any]]
    echo: bool
    logprobs: int
    suffix: None  # not supported


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any]
    completion_tokens_details: dict[str, Any]


class AssistantMessage(TypedDict, total=False):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]


class ChatChoice(TypedDict, total=False):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: str | int | None  # the stop string or token id that ended it


class ChatCompletion(TypedDict, total=False):
    """A whole chat answer (`stream` false)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkChoice(TypedDict, total=False):
    index: int
    delta: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(TypedDict, total=False):
    """One server-sent event of a streamed chat answer; the stream ends `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None


class CompletionChoice(TypedDict, total=False):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


class Completion(TypedDict, total=False):
    """A whole completions answer, or (object `text_completion` too) one streamed event."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Model(TypedDict, total=False):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(TypedDict):
    """Every error on the OpenAI routes (and the node's management routes)."""

    error: ErrorDetail


# -- OpenAI Responses ------------------------------------------------------------------------


class ResponsesBody(TypedDict, total=False):
    """`POST /v1/responses`: `input` is a string or a list of items (messages,
    `function_call`, `function_call_output`, `reasoning`); nothing is stored."""

    model: Required[str]
    input: Required[str | list[dict[str, Any]]]
    instructions: str
    stream: bool
    max_output_tokens: int
    temperature: float
    top_p: float
    seed: int
    user: str
    tools: list[dict[str, Any]]  # function tools, flat: {type, name, parameters, …}
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]  # {format: {type: "json_schema", name, schema, strict}}
    reasoning: dict[str, Any]  # {effort}
    metadata: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    previous_response_id: None  # refused: conversations are not stored


class ResponseObject(TypedDict, total=False):
    """A Responses answer (`object: "response"`); streamed, its `response.*` events."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: str
    output: list[dict[str, Any]]
    usage: dict[str, Any]


class ResponseEvent(TypedDict, total=False):
    """One server-sent event of a streamed Responses answer (`response.created`,
    `response.output_text.delta`, …, `response.completed`): the fields its type carries."""

    type: Required[str]
    sequence_number: int
    response: ResponseObject
    output_index: int
    content_index: int
    item_id: str
    item: dict[str, Any]
    part: dict[str, Any]
    delta: str
    text: str
    arguments: str


# -- Anthropic Messages ------------------------------------------------------------------------


class AnthropicMessage(TypedDict, total=False):
    role: Required[Literal["user", "assistant"]]
    content: Required[str | list[dict[str, Any]]]  # text, image, tool_use, tool_result, …


class MessagesBody(TypedDict, total=False):
    """`POST /v1/messages`."""

    model: Required[str]
    messages: Required[list[AnthropicMessage]]
    max_tokens: Required[int]
    system: str | list[dict[str, Any]]
    stream: bool
    temperature: float
    top_p: float
    top_k: int
    stop_sequences: list[str]
    tools: list[dict[str, Any]]  # {name, description, input_schema}
    tool_choice: dict[str, Any]  # {type: auto|any|tool|none, name}
    thinking: dict[str, Any]  # {type: enabled|adaptive|disabled, budget_tokens}
    output_config: dict[str, Any]  # {format: {type: "json_schema", schema}}
    output_format: dict[str, Any]  # the beta's name for output_config.format
    metadata: dict[str, Any]


class CountTokensBody(TypedDict, total=False):
    """`POST /v1/messages/count_tokens`: a Messages body without `max_tokens`."""

    model: Required[str]
    messages: Required[list[AnthropicMessage]]
    system: str | list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: dict[str, Any]
    thinking: dict[str, Any]
    output_config: dict[str, Any]
    output_format: dict[str, Any]


class MessageAnswer(TypedDict, total=False):
    """A whole Messages answer; streamed, Anthropic's `message_start` … `message_stop` events."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]  # text, thinking, tool_use blocks
    stop_reason: str | None
    stop_sequence: str | None
    usage: dict[str, int]


class MessageEvent(TypedDict, total=False):
    """One server-sent event of a streamed Messages answer (`message_start`,
    `content_block_start`, `content_block_delta`, …, `message_stop`, `ping`)."""

    type: Required[str]
    message: MessageAnswer
    index: int
    content_block: dict[str, Any]
    delta: dict[str, Any]
    usage: dict[str, int]


class TokenCount(TypedDict):
    input_tokens: int


class AnthropicErrorBody(TypedDict):
    """Every error on the Anthropic routes: `{type: "error", error: {type, message}}`."""

    type: Literal["error"]
    error: dict[str, str]


# -- the node's own routes -----------------------------------------------------------------


class TokenizeBody(TypedDict, total=False):
    """`POST /tokenize`: a chat body (`messages`, `tools`, the template applied) or a
    completions body (`prompt`)."""

    model: Required[str]
    messages: list[ChatMessage]
    tools: list[FunctionTool]
    prompt: str | list[int]
    add_generation_prompt: bool
    chat_template_kwargs: dict[str, Any]


class Tokens(TypedDict, total=False):
    count: int
    tokens: list[int]
    max_model_len: int


class LoadBody(TypedDict, total=False):
    """`POST /models/load`: a hub id, or a path under `[node] model_dirs`."""

    model_id: Required[str]
    quant: str
    dtype: str
    devices: list[int]
    tensor_parallel: int
    revision: str
    # speculative decoding for this model (wire.SPECULATIVE_METHODS); absent: [engine]'s
    speculative_method: str  # "ngram" | "draft_model" | "mtp" | "off"
    speculative_model: str  # the draft model's id; with "draft_model" only, and required there
    num_speculative_tokens: int  # 1..16 tokens a draft proposes; absent: [engine]'s
    # this model's KV cache; absent: [engine]'s
    kv_cache_dtype: str  # "auto" | "float32" | "float16"
    max_model_len: int  # the longest context it serves
    kv_cache_memory_mb: int  # its KV pool


class UnloadBody(TypedDict):
    model_id: str
