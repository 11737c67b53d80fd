"""The ACP agent: sessions, the prompt loop, modes and permissions, over the SDK's
agent side (`agent-client-protocol`). A prompt streams the model's answer to the editor as
message and thought chunks; each tool call is shown as a tool call, asked permission for
when the mode says so, run on the session's `Workspace` (the editor's `fs/*` when it
offers them), and its result fed back, round after round until the model answers without
a call, the round limit, or a cancel.

Modes: `default` asks the editor before every write and command; `bypass` never asks;
`plan` runs no commands and writes only into the project's plan directory
(paths.plan_dir). A mode change takes effect on the next round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from acp import (
    PROTOCOL_VERSION,
    InitializeResponse,
    LoadSessionResponse,
    NewSessionResponse,
    PromptResponse,
    RequestError,
    SetSessionModeResponse,
    start_tool_call,
    text_block,
    tool_content,
    tool_terminal_ref,
    update_agent_message_text,
    update_agent_thought_text,
    update_tool_call,
    update_user_message_text,
)
from acp.schema import (
    AgentCapabilities,
    AllowedOutcome,
    Implementation,
    ListSessionsResponse,
    PermissionOption,
    PromptCapabilities,
    SessionCapabilities,
    SessionConfigOptionSelect,
    SessionConfigSelectOption,
    SessionInfo,
    SessionListCapabilities,
    SessionMode,
    SessionModeState,
    SetSessionConfigOptionResponse,
    ToolCallUpdate,
)

from helexa import __version__
from helexa.acp.compaction import compact, tools_tokens
from helexa.acp.config import AcpConfig, model_selector, parse_selector
from helexa.acp.paths import data_dir, inside, plan_dir
from helexa.acp.store import Saved, Store
from helexa.acp.tools import (
    BY_NAME,
    OUTPUT_CAP_BYTES,
    TOOLS,
    Files,
    LocalFiles,
    ToolError,
    ToolResult,
    Workspace,
    call_tool,
    parse_arguments,
)
from helexa.acp.wire import Message, ToolCall, Wire, WireError

log = logging.getLogger(__name__)

MAX_ROUNDS = 50  # model answers per prompt before it stops with max_turn_requests
MODES = {
    "default": ("Default", "Asks before every file write and command"),
    "bypass": ("Bypass permissions", "Writes and runs commands without asking"),
    "plan": ("Plan", "Reads and plans: no commands, writes only into the plan directory"),
}
TOOLS_TOKENS = tools_tokens([t.openai() for t in TOOLS])
ASKS = frozenset({"edit", "execute"})  # the tool kinds default mode asks permission for
SYSTEM_PROMPT = """You are a coding agent working in the user's project at {cwd}.
Use the tools to read, search, edit and run what you need; prefer small exact edits
(edit_file) to rewriting files. Paths are absolute, ~/…, or relative to the project.
When the task is done, say briefly what you changed."""
PLAN_PROMPT = """
You are in plan mode: investigate with read_file and list_dir, then write the plan as a
Markdown file under {plans} (the only place you may write; commands are disabled). When the
plan is written, stop and ask the user how to proceed: 1) carry it out, 2) revise it,
3) stop here."""


@dataclass(slots=True)
class Live:
    """A session in this process: what is saved, plus the running prompt."""

    saved: Saved
    task: asyncio.Task[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ClientFiles:
    """Files through the editor (`fs/read_text_file`, `fs/write_text_file`), so unsaved
    buffers are seen; a read the editor refuses (outside its workspace) falls back to the
    disk."""

    def __init__(self, conn: Any, session_id: str, *, read: bool, write: bool) -> None:
        self.conn, self.session_id = conn, session_id
        self.can_read, self.can_write = read, write
        self.local = LocalFiles()

    async def read(self, path: Path) -> str:
        if not self.can_read:
            return await self.local.read(path)
        try:
            return (
                await self.conn.read_text_file(session_id=self.session_id, path=str(path))
            ).content
        except Exception as e:  # the editor's refusal: the disk may still have it
            try:
                return await self.local.read(path)
            except OSError as local:
                raise OSError(
                    local.errno, f"{local.strerror} (the editor said: {e})", str(path)
                ) from None

    async def write(self, path: Path, text: str) -> None:
        if not self.can_write:
            await self.local.write(path, text)
            return
        await self.conn.write_text_file(session_id=self.session_id, path=str(path), content=text)


class EditorTerminal:
    """A command run in the editor's terminal (`terminal/*`), shown live in the tool call's
    card; killed past its timeout."""

    def __init__(self, conn: Any, session_id: str, call_id: str) -> None:
        self.conn, self.session_id, self.call_id = conn, session_id, call_id

    async def __call__(self, command: str, cwd: Path, timeout_s: float) -> tuple[int | None, str]:
        sid = self.session_id
        term = await self.conn.create_terminal(
            session_id=sid, command="bash", args=["-c", command], cwd=str(cwd),
            output_byte_limit=4 * OUTPUT_CAP_BYTES,
        )  # fmt: skip
        tid = term.terminal_id
        try:
            update = update_tool_call(self.call_id, content=[tool_terminal_ref(tid)])
            await self.conn.session_update(session_id=sid, update=update)
            try:
                done = await asyncio.wait_for(
                    self.conn.wait_for_terminal_exit(session_id=sid, terminal_id=tid), timeout_s
                )
                status = done.exit_code
            except TimeoutError:
                await self.conn.kill_terminal(session_id=sid, terminal_id=tid)
                status = None
            output = await self.conn.terminal_output(session_id=sid, terminal_id=tid)
            return status, output.output
        finally:
            await self.conn.release_terminal(session_id=sid, terminal_id=tid)


class HelexaAgent:
    def __init__(
        self, config: AcpConfig, store: Store | None = None, *, max_rounds: int = MAX_ROUNDS
    ) -> None:
        self.config = config
        self.max_rounds = max_rounds
        self.wires = {e.name: Wire(e) for e in config.endpoints}
        self.store = store or Store(data_dir() / "sessions")
        self.sessions: dict[str, Live] = {}
        self.conn: Any = None
        self.models: list[str] | None = None  # the picker's ids, listed once
        self.fs_read = self.fs_write = False
        self.terminals = False  # the editor runs commands (terminal/*)

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    # -- the protocol's requests ---------------------------------------------------------
    async def initialize(
        self,
        protocol_version: int,
        client_capabilities: Any = None,
        client_info: Any = None,
        **_: Any,
    ) -> InitializeResponse:
        fs = getattr(client_capabilities, "fs", None)
        self.fs_read = bool(getattr(fs, "read_text_file", False))
        self.fs_write = bool(getattr(fs, "write_text_file", False))
        self.terminals = bool(getattr(client_capabilities, "terminal", False))
        return InitializeResponse(
            protocol_version=min(protocol_version, PROTOCOL_VERSION),
            agent_capabilities=AgentCapabilities(
                load_session=True,
                prompt_capabilities=PromptCapabilities(image=True),
                session_capabilities=SessionCapabilities(list=SessionListCapabilities()),
            ),
            agent_info=Implementation(name="helexa", title="helexa acp", version=__version__),
        )

    async def new_session(self, cwd: str, mcp_servers: Any = None, **_: Any) -> NewSessionResponse:
        models = await self._models()
        if not models:
            raise RequestError.internal_error(
                {"message": "no endpoint listed a model: see the agent's log"}
            )
        saved = Saved("s" + uuid.uuid4().hex[:16], cwd, self._default_model(models), "default")
        self.sessions[saved.id] = Live(saved)
        self.store.save(saved)
        return NewSessionResponse(
            session_id=saved.id,
            modes=self._modes(saved),
            config_options=self._options(saved, models),
        )

    async def load_session(
        self, cwd: str, session_id: str, mcp_servers: Any = None, **_: Any
    ) -> LoadSessionResponse:
        try:
            saved = self.store.load(session_id)
        except (FileNotFoundError, ValueError) as e:
            raise RequestError.resource_not_found(f"session {session_id}: {e}") from None
        saved.cwd = cwd or saved.cwd
        self.sessions[saved.id] = Live(saved)
        await self._replay(saved)
        models = await self._models()
        return LoadSessionResponse(
            modes=self._modes(saved), config_options=self._options(saved, models)
        )

    async def list_sessions(
        self, cwd: str | None = None, cursor: str | None = None, **_: Any
    ) -> ListSessionsResponse:
        return ListSessionsResponse(
            sessions=[
                SessionInfo(session_id=s.id, cwd=s.cwd, title=s.title, updated_at=_iso(s.updated))
                for s in self.store.list(cwd)
            ]
        )

    async def set_session_mode(
        self, mode_id: str, session_id: str, **_: Any
    ) -> SetSessionModeResponse:
        live = self._live(session_id)
        if mode_id not in MODES:
            raise RequestError.invalid_params(
                {"message": f"no mode {mode_id!r}; modes: {', '.join(MODES)}"}
            )
        live.saved.mode = mode_id
        self.store.save(live.saved)
        return SetSessionModeResponse()

    async def set_config_option(
        self, config_id: str, session_id: str, value: str | bool, **_: Any
    ) -> SetSessionConfigOptionResponse:
        live = self._live(session_id)
        models = await self._models()
        if config_id == "model":
            if value not in models:
                raise RequestError.invalid_params({"message": f"no model {value!r}"})
            live.saved.model = str(value)
        elif config_id == "mode":
            if value not in MODES:
                raise RequestError.invalid_params({"message": f"no mode {value!r}"})
            live.saved.mode = str(value)
        else:
            raise RequestError.invalid_params({"message": f"no option {config_id!r}"})
        self.store.save(live.saved)
        return SetSessionConfigOptionResponse(config_options=self._options(live.saved, models))

    async def prompt(self, session_id: str, prompt: list[Any], **_: Any) -> PromptResponse:
        live = self._live(session_id)
        if live.task is not None and not live.task.done():
            live.task.cancel()  # a new prompt ends a wedged earlier one
            await asyncio.gather(live.task, return_exceptions=True)
        live.saved.history.append(_user_message(prompt))
        self.store.save(live.saved)
        live.task = asyncio.create_task(self._run(live))
        try:
            return PromptResponse(stop_reason=await live.task)
        except asyncio.CancelledError:
            if live.task.cancelled():
                return PromptResponse(stop_reason="cancelled")
            raise
        finally:
            self.store.save(live.saved)

    async def cancel(self, session_id: str, **_: Any) -> None:
        live = self.sessions.get(session_id)
        if live is not None and live.task is not None and not live.task.done():
            live.task.cancel()

    async def authenticate(self, method_id: str, **_: Any) -> None:
        return None

    # -- the loop --------------------------------------------------------------------------
    async def _run(self, live: Live) -> str:
        saved = live.saved
        for _round in range(self.max_rounds):
            endpoint, model = parse_selector(self.config.endpoints, saved.model)
            wire = self.wires[endpoint.name]
            system = Message("system", self._system_prompt(saved))
            text, calls, stop = "", {}, "stop"
            try:
                sent = compact(
                    system,
                    saved.history,
                    endpoint.context_window,
                    endpoint.max_tokens,
                    TOOLS_TOKENS,
                )
                async for e in wire.stream(model, sent, TOOLS):
                    if e.kind == "text":
                        text += e.text
                        await self._update(saved.id, update_agent_message_text(e.text))
                    elif e.kind == "thought":
                        await self._update(saved.id, update_agent_thought_text(e.text))
                    elif e.kind == "call":
                        calls[e.index] = ToolCall(
                            e.call_id or f"call_{uuid.uuid4().hex[:8]}", e.name, ""
                        )
                    elif e.kind == "args" and e.index in calls:
                        calls[e.index].arguments += e.text
                    elif e.kind == "stop":
                        stop = e.reason
            except WireError as e:
                await self._update(
                    saved.id, update_agent_message_text(f"\n\n[the model endpoint failed: {e}]")
                )
                return "end_turn"
            ordered = [calls[i] for i in sorted(calls)]
            saved.history.append(Message("assistant", text, ordered))
            self.store.save(saved)  # every round: a later one that stalls loses nothing
            if not ordered:
                return "max_tokens" if stop == "length" else "end_turn"
            for call in ordered:
                result = await self._call(live, call)
                saved.history.append(Message("tool", result.text, tool_call_id=call.id))
            self.store.save(saved)
        return "max_turn_requests"

    async def _call(self, live: Live, call: ToolCall) -> ToolResult:
        saved = live.saved
        spec = BY_NAME.get(call.name)
        kind = spec.kind if spec else "other"
        await self._update(
            saved.id,
            start_tool_call(
                call.id, _title(call), kind=kind, status="pending", raw_input=_raw(call.arguments)
            ),
        )
        ws = self._workspace(saved, call.id)
        refusal = self._refused_by_mode(saved, call, ws)
        asks = refusal is None and saved.mode == "default" and kind in ASKS
        if asks and not await self._allowed(saved.id, call, kind):
            refusal = "the user did not allow this call; ask them or try another way"
        if refusal is not None:
            result = ToolResult(refusal, error=True)
        else:
            await self._update(saved.id, update_tool_call(call.id, status="in_progress"))
            result = await call_tool(ws, call.name, call.arguments)
        await self._update(
            saved.id,
            update_tool_call(
                call.id,
                status="failed" if result.error else "completed",
                content=[tool_content(text_block(result.text))],
            ),
        )
        return result

    def _refused_by_mode(self, saved: Saved, call: ToolCall, ws: Workspace) -> str | None:
        if saved.mode != "plan":
            return None
        if call.name == "bash":
            return "plan mode runs no commands: read files and write the plan"
        if call.name in ("write_file", "edit_file"):
            try:  # read as the tool will read them, slips repaired alike
                raw = parse_arguments(call.arguments)
            except ToolError:
                return None  # the tool itself reports the bad arguments
            if not isinstance(raw.get("path"), str):
                return None
            plans = plan_dir(Path(saved.cwd))
            if not inside(ws.path(raw["path"]), plans):
                return f"plan mode writes only under {plans}: write the plan there"
        return None

    async def _allowed(self, session_id: str, call: ToolCall, kind: str) -> bool:
        options = [
            PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
            PermissionOption(option_id="reject", name="Reject", kind="reject_once"),
        ]
        update = ToolCallUpdate(
            tool_call_id=call.id, title=_title(call), kind=kind, raw_input=_raw(call.arguments)
        )
        answer = await self.conn.request_permission(
            session_id=session_id, tool_call=update, options=options
        )
        outcome = answer.outcome
        return isinstance(outcome, AllowedOutcome) and outcome.option_id == "allow"

    # -- helpers -----------------------------------------------------------------------------
    def _workspace(self, saved: Saved, call_id: str) -> Workspace:
        files: Files = ClientFiles(self.conn, saved.id, read=self.fs_read, write=self.fs_write)
        run = EditorTerminal(self.conn, saved.id, call_id) if self.terminals else None
        return Workspace(Path(saved.cwd), files, run=run)

    def _system_prompt(self, saved: Saved) -> str:
        text = SYSTEM_PROMPT.format(cwd=saved.cwd)
        if saved.mode == "plan":
            text += PLAN_PROMPT.format(plans=plan_dir(Path(saved.cwd)))
        return text

    async def _models(self) -> list[str]:
        """Every model of every endpoint (prefixed when there are several); an endpoint
        that fails to list is skipped with a warning."""
        if self.models:
            return self.models
        endpoints = self.config.endpoints
        out: list[str] = []
        for endpoint in endpoints:
            try:
                ids = await self.wires[endpoint.name].models()
            except (WireError, Exception) as e:
                log.warning("endpoint %s listed no models (skipped): %s", endpoint.name, e)
                continue
            out += [model_selector(endpoints, endpoint.name, m) for m in ids]
        self.models = out
        return out

    def _default_model(self, models: list[str]) -> str:
        for endpoint in self.config.endpoints:
            if endpoint.default_model:
                chosen = model_selector(
                    self.config.endpoints, endpoint.name, endpoint.default_model
                )
                if chosen in models:
                    return chosen
        return models[0]

    def _modes(self, saved: Saved) -> SessionModeState:
        return SessionModeState(
            current_mode_id=saved.mode,
            available_modes=[
                SessionMode(id=k, name=n, description=d) for k, (n, d) in MODES.items()
            ],
        )

    def _options(self, saved: Saved, models: list[str]) -> list[SessionConfigOptionSelect]:
        return [
            SessionConfigOptionSelect(
                id="model", name="Model", category="model", type="select", current_value=saved.model,
                options=[SessionConfigSelectOption(value=m, name=m) for m in models],
            ),
            SessionConfigOptionSelect(
                id="mode", name="Mode", category="mode", type="select", current_value=saved.mode,
                options=[SessionConfigSelectOption(value=k, name=n) for k, (n, _) in MODES.items()],
            ),
        ]  # fmt: skip

    def _live(self, session_id: str) -> Live:
        live = self.sessions.get(session_id)
        if live is None:
            raise RequestError.resource_not_found(f"no session {session_id}: create or load it")
        return live

    async def _update(self, session_id: str, update: Any) -> None:
        await self.conn.session_update(session_id=session_id, update=update)

    async def _replay(self, saved: Saved) -> None:
        """A loaded session's conversation sent back to the editor, which keeps none."""
        for m in saved.history:
            if m.role == "user":
                await self._update(saved.id, update_user_message_text(m.content))
            elif m.role == "assistant":
                if m.content:
                    await self._update(saved.id, update_agent_message_text(m.content))
                for call in m.tool_calls:
                    spec = BY_NAME.get(call.name)
                    await self._update(
                        saved.id,
                        start_tool_call(
                            call.id,
                            _title(call),
                            kind=spec.kind if spec else "other",
                            status="completed",
                            raw_input=_raw(call.arguments),
                        ),
                    )
            elif m.role == "tool" and m.tool_call_id:
                await self._update(
                    saved.id,
                    update_tool_call(
                        m.tool_call_id,
                        status="completed",
                        content=[tool_content(text_block(m.content))],
                    ),
                )


def _user_message(blocks: list[Any]) -> Message:
    texts, images = [], []
    for b in blocks:
        kind = getattr(b, "type", None)
        if kind == "text":
            texts.append(b.text)
        elif kind == "image":
            images.append((b.mime_type, b.data))
        elif kind == "resource_link":
            texts.append(f"[{b.name}]({b.uri})")
        elif kind == "resource":
            resource = b.resource
            body = getattr(resource, "text", None)
            texts.append(f"{resource.uri}:\n{body}" if body is not None else str(resource.uri))
    return Message("user", "\n\n".join(texts), images=images)


def _title(call: ToolCall) -> str:
    raw = _raw(call.arguments)
    detail = raw.get("path") or raw.get("command") if isinstance(raw, dict) else None
    return f"{call.name} {detail}" if detail else call.name


def _raw(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        return {"unparsed": arguments}


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")
