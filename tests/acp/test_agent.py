"""`helexa acp` as the editor sees it: the agent a real subprocess, driven through the
SDK's client side, against a real gateway and node serving scripted models. A session
lists the endpoint's models and the modes; a prompt streams thoughts and text; a write is
asked permission for and done through the editor's fs (or refused when the user says no);
plan mode runs no command; the transcript survives the agent's restart and is replayed on
load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from acp import PROTOCOL_VERSION, spawn_agent_process, text_block
from acp.schema import (
    AllowedOutcome,
    ClientCapabilities,
    CreateTerminalResponse,
    FileSystemCapabilities,
    KillTerminalResponse,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    RequestPermissionResponse,
    TerminalOutputResponse,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)

from tests.gateway.gateway_proc import start_gateway
from tests.model_fixtures import AGENT_SCRIPTS, QWEN3, need_shared
from tests.web.node_proc import scripted_model, start_node


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SCRIPTS = {
    "think": AGENT_SCRIPTS["think"],
    "writes": "I will write it.\n"
    + _call("write_file", {"path": "notes/out.txt", "content": "written\n"}),
    "runs": _call("bash", {"command": "echo ran > ran.txt"}),
    "long": "word " * 3000,  # streams for a while: long enough to be cancelled
    "all_tools": "\n".join(
        [
            _call("list_dir", {"path": "."}),
            _call("read_file", {"path": "README.md"}),
            _call("edit_file", {"path": "README.md", "old_text": "hello", "new_text": "hi there"}),
            _call("write_file", {"path": "new.txt", "content": "new\n"}),
            _call("bash", {"command": "cat README.md new.txt"}),
        ]
    ),
}


class Editor:
    """The client's side, as an editor plays it: records every update, answers permission
    requests with `allow`, and serves fs/* from the disk (counting them)."""

    def __init__(self, allow: bool = True) -> None:
        self.allow = allow
        self.updates: list[Any] = []
        self.permissions: list[Any] = []
        self.fs_writes: list[str] = []

    async def request_permission(self, options, session_id, tool_call, **_: Any):
        self.permissions.append(tool_call)
        choice = "allow" if self.allow else "reject"
        return RequestPermissionResponse(
            outcome=AllowedOutcome(outcome="selected", option_id=choice)
        )

    async def session_update(self, session_id, update, **_: Any) -> None:
        self.updates.append(update)

    async def read_text_file(self, path, session_id, limit=None, line=None, **_: Any):
        return ReadTextFileResponse(content=Path(path).read_text())

    async def write_text_file(self, content, path, session_id, **_: Any):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
        self.fs_writes.append(path)
        return WriteTextFileResponse()

    def kinds(self) -> list[str]:
        return [u.session_update for u in self.updates]

    def text(self, kind: str) -> str:
        return "".join(u.content.text for u in self.updates if u.session_update == kind)


class TerminalEditor(Editor):
    """An editor that also runs the agent's commands in its own terminals."""

    def __init__(self) -> None:
        super().__init__()
        self.terminals: dict[str, Any] = {}
        self.commands: list[list[str]] = []
        self.released: list[str] = []

    async def create_terminal(
        self, command, session_id, args=None, cwd=None, env=None, output_byte_limit=None, **_: Any
    ):
        self.commands.append([command, *(args or [])])
        proc = await asyncio.create_subprocess_exec(
            command, *(args or []), cwd=cwd, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        tid = f"t{len(self.terminals)}"
        self.terminals[tid] = proc
        return CreateTerminalResponse(terminal_id=tid)

    async def wait_for_terminal_exit(self, session_id, terminal_id, **_: Any):
        return WaitForTerminalExitResponse(exit_code=await self.terminals[terminal_id].wait())

    async def terminal_output(self, session_id, terminal_id, **_: Any):
        out = await self.terminals[terminal_id].stdout.read()
        return TerminalOutputResponse(output=out.decode(), truncated=False)

    async def release_terminal(self, session_id, terminal_id, **_: Any):
        self.released.append(terminal_id)
        return ReleaseTerminalResponse()

    async def kill_terminal(self, session_id, terminal_id, **_: Any):
        self.terminals[terminal_id].kill()
        return KillTerminalResponse()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    need_shared()
    root = tmp_path_factory.mktemp("acp-agent-models")
    models = {
        name: str(scripted_model(root, script, name, tokenizer_from=QWEN3))
        for name, script in SCRIPTS.items()
    }
    # a model with a 4096-token context that reads a file longer than that
    reader = scripted_model(
        root, _call("read_file", {"path": "big.txt"}), "reader", tokenizer_from=QWEN3
    )
    config = json.loads((reader / "config.json").read_text())
    (reader / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    models["reader"] = str(reader)
    node = start_node(tmp_path_factory.mktemp("acp-agent-node"), list(models.values()))
    gateway = start_gateway(tmp_path_factory.mktemp("acp-agent-gw"), {"n": node})
    yield gateway, models
    gateway.stop()
    node.stop(signal.SIGTERM)


def _env(gateway, tmp_path: Path, model: str) -> dict[str, str]:
    return {
        **os.environ,
        "HELEXA_ACP_BASE_URL": gateway.v1,
        "HELEXA_ACP_MODEL": model,
        "HELEXA_ACP_MAX_ROUNDS": "2",
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "HELEXA_CONFIG": str(tmp_path / "none.toml"),  # helexa acp never reads it
    }


async def _session(editor: Editor, env: dict, project: Path, work) -> Any:
    async with spawn_agent_process(
        lambda _agent: editor, sys.executable, "-m", "helexa.cli", "acp", env=env, cwd=project
    ) as (conn, _proc):
        caps = ClientCapabilities(
            fs=FileSystemCapabilities(read_text_file=True, write_text_file=True),
            terminal=isinstance(editor, TerminalEditor),
        )
        init = await conn.initialize(protocol_version=PROTOCOL_VERSION, client_capabilities=caps)
        assert init.agent_capabilities.load_session
        return await asyncio.wait_for(work(conn), 240)


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    return project


@pytest.mark.parametrize("wire", ["openai-chat", "openai-responses", "anthropic-messages"])
def test_a_prompt_streams_thoughts_and_text_and_the_session_lists_models_and_modes(
    served, tmp_path, wire
):
    gateway, models = served
    editor, project = Editor(), _project(tmp_path)
    env = {**_env(gateway, tmp_path, models["think"]), "HELEXA_ACP_WIRE_API": wire}

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        answer = await conn.prompt(session_id=session.session_id, prompt=[text_block("2 + 2?")])
        return session, answer

    session, answer = asyncio.run(_session(editor, env, project, work))
    assert answer.stop_reason == "end_turn"
    assert "Let me count" in editor.text("agent_thought_chunk")
    assert editor.text("agent_message_chunk").strip() == "The answer is 4."
    [model_option, mode_option] = session.config_options
    assert model_option.current_value == models["think"]
    assert set(models.values()) <= {o.value for o in model_option.options}
    assert {m.id for m in session.modes.available_modes} == {"default", "bypass", "plan"}
    assert session.modes.current_mode_id == mode_option.current_value == "default"


@pytest.mark.parametrize("allow", [True, False])
def test_a_write_asks_permission_and_goes_through_the_editor(served, tmp_path, allow):
    gateway, models = served
    editor, project = Editor(allow=allow), _project(tmp_path)

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        return await conn.prompt(session_id=session.session_id, prompt=[text_block("write it")])

    answer = asyncio.run(_session(editor, _env(gateway, tmp_path, models["writes"]), project, work))
    assert answer.stop_reason == "max_turn_requests"  # the script calls again each round
    assert len(editor.permissions) == 2 and editor.permissions[0].title.startswith("write_file")
    out = project / "notes" / "out.txt"
    statuses = [u.status for u in editor.updates if u.session_update == "tool_call_update"]
    if allow:
        assert out.read_text() == "written\n" and editor.fs_writes == [str(out)] * 2
        assert statuses.count("completed") == 2
    else:
        assert not out.exists() and editor.fs_writes == []
        assert statuses.count("failed") == 2


def test_plan_mode_runs_no_command_and_bypass_runs_without_asking(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    env = _env(gateway, tmp_path, models["runs"])

    async def run_in(mode: str, editor: Editor):
        async def work(conn):
            session = await conn.new_session(cwd=str(project), mcp_servers=[])
            await conn.set_session_mode(session_id=session.session_id, mode_id=mode)
            return await conn.prompt(session_id=session.session_id, prompt=[text_block("run")])

        return await _session(editor, env, project, work)

    planner = Editor()
    asyncio.run(run_in("plan", planner))
    assert not (project / "ran.txt").exists() and not planner.permissions
    failed = [u for u in planner.updates if getattr(u, "status", None) == "failed"]
    assert failed and "plan mode runs no commands" in failed[0].content[0].content.text
    bypasser = Editor()
    asyncio.run(run_in("bypass", bypasser))
    assert (project / "ran.txt").read_text() == "ran\n" and not bypasser.permissions


def test_a_session_survives_the_agents_restart_and_is_replayed_on_load(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    env = _env(gateway, tmp_path, models["think"])

    async def first(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=[text_block("2 + 2, please?")])
        return session.session_id

    session_id = asyncio.run(_session(Editor(), env, project, first))
    editor = Editor()

    async def second(conn):
        listed = await conn.list_sessions(cwd=str(project))
        await conn.load_session(cwd=str(project), session_id=session_id, mcp_servers=[])
        return listed

    listed = asyncio.run(_session(editor, env, project, second))
    assert [s.session_id for s in listed.sessions] == [session_id]
    assert listed.sessions[0].title == "2 + 2, please?"
    assert editor.kinds()[:2] == ["user_message_chunk", "agent_message_chunk"]
    assert editor.text("agent_message_chunk").strip() == "The answer is 4."


def test_cancel_stops_a_running_prompt_and_the_next_prompt_is_served(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    editor = Editor()
    env = _env(gateway, tmp_path, models["long"])

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        sid = session.session_id
        running = asyncio.create_task(conn.prompt(session_id=sid, prompt=[text_block("talk")]))
        while "agent_message_chunk" not in editor.kinds():
            await asyncio.sleep(0.05)
        await conn.cancel(session_id=sid)
        cancelled = await running
        chunks = len(editor.updates)
        await conn.set_config_option(config_id="model", session_id=sid, value=models["think"])
        after = await conn.prompt(session_id=sid, prompt=[text_block("2 + 2?")])
        return cancelled, after, chunks

    cancelled, after, chunks = asyncio.run(_session(editor, env, project, work))
    assert cancelled.stop_reason == "cancelled"
    assert chunks < 3000  # stopped long before the script's end
    assert after.stop_reason == "end_turn"
    assert editor.text("agent_message_chunk").endswith("The answer is 4.")


def test_commands_run_in_the_editors_terminal_when_it_offers_one(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    editor = TerminalEditor()

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        await conn.set_session_mode(session_id=session.session_id, mode_id="bypass")
        return await conn.prompt(session_id=session.session_id, prompt=[text_block("run")])

    asyncio.run(_session(editor, _env(gateway, tmp_path, models["runs"]), project, work))
    assert editor.commands[0] == ["bash", "-c", "echo ran > ran.txt"]
    assert (project / "ran.txt").read_text() == "ran\n"
    assert editor.released == list(editor.terminals)  # every terminal given back
    shown = [
        c.terminal_id
        for u in editor.updates
        if u.session_update == "tool_call_update"
        for c in (u.content or [])
        if getattr(c, "type", None) == "terminal"
    ]
    assert shown == list(editor.terminals)  # each shown live in its tool call's card
    results = [u for u in editor.updates if getattr(u, "status", None) == "completed"]
    assert results and results[0].content[0].content.text.startswith("exit status 0")


def test_a_model_calls_every_tool_in_one_answer(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    (project / "README.md").write_text("hello\n")
    editor = Editor()
    env = {**_env(gateway, tmp_path, models["all_tools"]), "HELEXA_ACP_MAX_ROUNDS": "1"}

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        await conn.set_session_mode(session_id=session.session_id, mode_id="bypass")
        return await conn.prompt(session_id=session.session_id, prompt=[text_block("go")])

    asyncio.run(_session(editor, env, project, work))
    started = [u for u in editor.updates if u.session_update == "tool_call"]
    assert [u.title.split()[0] for u in started] == [
        "list_dir", "read_file", "edit_file", "write_file", "bash",
    ]  # fmt: skip
    assert [u.kind for u in started] == ["search", "read", "edit", "edit", "execute"]
    done = [u for u in editor.updates if getattr(u, "status", None) == "completed"]
    results = [u.content[0].content.text for u in done]
    assert len(results) == 5 and "README.md" in results[0] and results[1] == "hello\n"
    assert results[4].splitlines() == ["exit status 0", "hi there", "new"]
    assert (project / "README.md").read_text() == "hi there\n"
    assert (project / "new.txt").read_text() == "new\n"


@pytest.mark.parametrize("window", [None, 4096])
def test_history_is_compacted_into_a_small_context_window(served, tmp_path, window):
    """A tool result longer than the model's 4096-token context: the next round fails at
    the endpoint unless `context_window` is set, and then is served."""
    gateway, models = served
    project = _project(tmp_path)
    (project / "big.txt").write_text("word " * 5000)
    editor = Editor()
    env = {**_env(gateway, tmp_path, models["reader"]), "HELEXA_ACP_MAX_TOKENS": "256"}
    if window:
        env["HELEXA_ACP_CONTEXT_WINDOW"] = str(window)

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        await conn.set_session_mode(session_id=session.session_id, mode_id="bypass")
        return await conn.prompt(session_id=session.session_id, prompt=[text_block("read it")])

    answer = asyncio.run(_session(editor, env, project, work))
    reads = [u for u in editor.updates if getattr(u, "status", None) == "completed"]
    if window is None:
        assert answer.stop_reason == "end_turn" and len(reads) == 1
        assert "the model endpoint failed" in editor.text("agent_message_chunk")
    else:  # round 2 was served, the long result elided from what was sent
        assert answer.stop_reason == "max_turn_requests", editor.text("agent_message_chunk")
        assert len(reads) == 2
        assert "the model endpoint failed" not in editor.text("agent_message_chunk")


def test_plan_mode_writes_only_into_the_plan_directory(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    editor = Editor()

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        await conn.set_session_mode(session_id=session.session_id, mode_id="plan")
        return await conn.prompt(session_id=session.session_id, prompt=[text_block("write")])

    asyncio.run(_session(editor, _env(gateway, tmp_path, models["writes"]), project, work))
    assert not (project / "notes").exists() and not editor.permissions
    failed = [u for u in editor.updates if getattr(u, "status", None) == "failed"]
    text = failed[0].content[0].content.text
    plans = tmp_path / "data" / "helexa" / "acp" / "plans"
    assert text.startswith("plan mode writes only under") and str(plans) in text


def test_an_endpoint_that_cannot_list_its_models_is_skipped(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    endpoints = tmp_path / "acp.toml"
    endpoints.write_text(
        f'[[endpoints]]\nname = "down"\nbase_url = "http://127.0.0.1:9/v1"\n'
        f'[[endpoints]]\nname = "gw"\nbase_url = "{gateway.v1}"\n'
        f'default_model = "{models["think"]}"\n'
    )
    env = {**_env(gateway, tmp_path, models["think"]), "HELEXA_ACP_CONFIG": str(endpoints)}
    editor = Editor()

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        answer = await conn.prompt(session_id=session.session_id, prompt=[text_block("2 + 2?")])
        return session, answer

    session, answer = asyncio.run(_session(editor, env, project, work))
    picker = [o.value for o in session.config_options[0].options]
    assert picker and all(v.startswith("gw:") for v in picker)  # prefixed: two endpoints
    assert session.config_options[0].current_value == f"gw:{models['think']}"
    assert answer.stop_reason == "end_turn"
    assert editor.text("agent_message_chunk").strip() == "The answer is 4."


def test_a_new_prompt_ends_one_still_running(served, tmp_path):
    gateway, models = served
    project = _project(tmp_path)
    editor = Editor()
    env = _env(gateway, tmp_path, models["long"])

    async def work(conn):
        session = await conn.new_session(cwd=str(project), mcp_servers=[])
        sid = session.session_id
        first = asyncio.create_task(conn.prompt(session_id=sid, prompt=[text_block("talk")]))
        while "agent_message_chunk" not in editor.kinds():
            await asyncio.sleep(0.05)
        await conn.set_config_option(config_id="model", session_id=sid, value=models["think"])
        second = await conn.prompt(session_id=sid, prompt=[text_block("2 + 2?")])  # no cancel
        return await first, second

    first, second = asyncio.run(_session(editor, env, project, work))
    assert first.stop_reason == "cancelled" and second.stop_reason == "end_turn"
    assert editor.text("agent_message_chunk").endswith("The answer is 4.")
