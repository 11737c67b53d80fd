"""OpenAI response shapes for a `Generation`: whole responses, SSE chunks, model cards."""

from __future__ import annotations

from typing import Any

from helexa.engine.sequence import RequestOutput, TokenLogprob
from helexa.engine.tokenizer import Tokenizer
from helexa.node.generation import Generation
from helexa.node.served import ServedModel
from helexa.protocol.assistant_output import AssistantOutput, Pieces, ToolCallOut


def _head(gen: Generation, *, chunk: bool) -> dict[str, Any]:
    if gen.is_chat:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": gen.id, "object": obj, "created": gen.created, "model": gen.served.id}


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[].logprobs` of chat: `{content: [{token, logprob, bytes, top_logprobs}]}`."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ],
        "refusal": None,
    }


def completion_logprobs(
    tok: Tokenizer, lps: list[TokenLogprob], text_offset: int = 0
) -> dict[str, Any]:
    """Legacy completions logprobs: parallel arrays plus `{token: logprob}` alternatives."""
    tokens, offsets, top = [], [], []
    for lp in lps:
        text = _token_text(tok, lp.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top.append({_token_text(tok, t): v for t, v in lp.top})
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def full_response(gen: Generation) -> dict[str, Any]:
    """The non-streaming body once every choice has finished."""
    tok = gen.served.tokenizer
    choices = []
    for i, c in enumerate(gen.choices):
        text = "".join(c.text)
        choice: dict[str, Any] = {"index": i}
        if gen.is_chat:
            assert c.output is not None
            choice["message"] = chat_message(c.output)
            choice["logprobs"] = chat_logprobs(tok, c.logprobs) if gen.req.logprobs else None
        else:
            echo = gen.echo_text
            choice["text"] = echo + text
            choice["logprobs"] = (
                completion_logprobs(tok, c.logprobs, len(echo))
                if gen.req.logprobs is not None
                else None
            )
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        choices.append(choice)
    return {**_head(gen, chunk=False), "choices": choices, "usage": gen.usage}


def chat_message(output: AssistantOutput) -> dict[str, Any]:
    """A whole answer as `choices[].message`: reasoning apart, tool calls parsed."""
    message: dict[str, Any] = {"role": "assistant", "content": output.content}
    if output.reasoning_text:
        message["reasoning_content"] = output.reasoning
    if output.calls:
        message["content"] = output.content or None
        message["tool_calls"] = [_tool_call(c) for c in output.calls]
    return message


def chat_delta(pieces: Pieces) -> dict[str, Any]:
    """One streamed delta: reasoning, content and whole tool calls, as they came."""
    delta: dict[str, Any] = {}
    if pieces.reasoning:
        delta["reasoning_content"] = pieces.reasoning
    if pieces.content or not pieces:
        delta["content"] = pieces.content
    if pieces.calls:
        delta["tool_calls"] = [{"index": c.index, **_tool_call(c)} for c in pieces.calls]
    return delta


def _tool_call(call: ToolCallOut) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def opening_chunks(gen: Generation) -> list[dict[str, Any]]:
    """Chat: the role chunk of each choice. Completions: the echoed prompt, if asked."""
    if gen.is_chat:
        return [
            {
                **_head(gen, chunk=True),
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(gen.req.n)
        ]
    echo = gen.echo_text
    if not echo:
        return []
    return [
        {
            **_head(gen, chunk=True),
            "choices": [
                {"index": i, "text": echo, "logprobs": None, "finish_reason": None}
                for i in range(gen.req.n)
            ],
        }
    ]


def delta_chunks(gen: Generation, i: int, out: RequestOutput) -> list[dict[str, Any]]:
    """The chunks for one engine delta of choice `i`: its text (with logprobs), then, when it
    finished, a chunk with finish_reason; the last choice to finish carries the usage."""
    tok = gen.served.tokenizer
    chunks = []
    lps = out.logprobs or []
    if gen.is_chat:
        pieces = gen.choices[i].last
        if pieces or lps:
            body: dict[str, Any] = {
                "index": i,
                "delta": chat_delta(pieces),
                "logprobs": chat_logprobs(tok, lps) if gen.req.logprobs else None,
            }
            chunks.append({**_head(gen, chunk=True), "choices": [{**body, "finish_reason": None}]})
    elif out.text or lps:
        # where this delta's text starts in the choice's text (after the echo)
        base = len(gen.echo_text) + gen.choices[i].num_chars - len(out.text)
        body = {
            "index": i,
            "text": out.text,
            "logprobs": completion_logprobs(tok, lps, base) if lps else None,
        }
        chunks.append({**_head(gen, chunk=True), "choices": [{**body, "finish_reason": None}]})
    if out.finished:
        done: dict[str, Any] = {"index": i}
        if gen.is_chat:
            done["delta"] = {}
        else:
            done["text"] = ""
        done |= {
            "logprobs": None,
            "finish_reason": gen.choices[i].finish_reason,
            "stop_reason": out.stop_reason,
        }
        chunk = {**_head(gen, chunk=True), "choices": [done]}
        if all(c.finish_reason for c in gen.choices):
            chunk["usage"] = gen.usage
        chunks.append(chunk)
    return chunks


def usage_chunk(gen: Generation) -> dict[str, Any]:
    """`stream_options.include_usage`: a last chunk with no choices and the usage."""
    return {**_head(gen, chunk=True), "choices": [], "usage": gen.usage}


def model_card(served: ServedModel) -> dict[str, Any]:
    """One `/v1/models` entry, with the context limits clients size their prompts by."""
    limit = served.limit
    return {
        "id": served.id,
        "object": "model",
        "created": int(served.loaded_at),
        "owned_by": "helexa",
        "root": served.id,
        "max_model_len": limit["context"],
        "limit": limit,
        "capabilities": served.capabilities,
    }
