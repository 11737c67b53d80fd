"""The tools a model can call through `helexa acp`, with their JSON schemas, run against
a `Workspace`: where files are read and written (the editor's `fs/*` methods when it
offers them, so unsaved buffers are seen; else the disk: `LocalFiles`) and how commands
run. A tool never raises at the model: a bad argument, a missing file or a failed command
comes back as an error result the model can read and act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from helexa.acp.paths import expand

READ_MAX_LINES = 2000  # a read without a limit returns at most this many lines
LIST_MAX_ENTRIES = 1000
BASH_TIMEOUT_S = 120.0
BASH_TIMEOUT_MAX_S = 1800.0
OUTPUT_CAP_BYTES = 30_000  # a command's output kept for the model: its head and its tail


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON Schema of the arguments
    kind: str  # ACP's tool kind: read, edit, execute, search

    def openai(self) -> dict[str, Any]:
        """As an OpenAI chat `tools` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _schema(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "absolute, ~/…, or relative to the project"}
TOOLS = (
    ToolSpec(
        "read_file",
        "Read a text file, optionally from a 1-based line for a number of lines. Lines come "
        "back as they are, without numbers.",
        _schema(
            ["path"],
            path=_PATH,
            line={"type": "integer", "minimum": 1, "description": "first line, 1-based"},
            limit={"type": "integer", "minimum": 1, "description": "how many lines"},
        ),
        "read",
    ),
    ToolSpec(
        "write_file",
        "Write a whole text file, creating it (and its directories) or replacing it.",
        _schema(["path", "content"], path=_PATH, content={"type": "string"}),
        "edit",
    ),
    ToolSpec(
        "edit_file",
        "Replace an exact piece of a text file. `old_text` must appear exactly once (copy "
        "it with enough surrounding lines to be unique), unless `replace_all` is true.",
        _schema(
            ["path", "old_text", "new_text"],
            path=_PATH,
            old_text={"type": "string"},
            new_text={"type": "string"},
            replace_all={"type": "boolean"},
        ),
        "edit",
    ),
    ToolSpec(
        "list_dir",
        "List a directory: one entry a line, directories ending in '/'.",
        _schema(["path"], path=_PATH),
        "search",
    ),
    ToolSpec(
        "bash",
        "Run a bash command and return its exit status and output (stdout and stderr "
        "together, long output cut in the middle).",
        _schema(
            ["command"],
            command={"type": "string"},
            cwd={**_PATH, "description": "the directory to run in (default: the project)"},
            timeout_s={"type": "number", "minimum": 1, "maximum": BASH_TIMEOUT_MAX_S},
        ),
        "execute",
    ),
)
BY_NAME = {t.name: t for t in TOOLS}


@dataclass(frozen=True, slots=True)
class ToolResult:
    text: str
    error: bool = False


class ToolError(Exception):
    """What the model gets told instead of a result."""


class Files(Protocol):
    async def read(self, path: Path) -> str: ...

    async def write(self, path: Path, text: str) -> None: ...


class LocalFiles:
    """Files on the local disk (UTF-8; undecodable bytes shown as U+FFFD)."""

    async def read(self, path: Path) -> str:
        return await asyncio.to_thread(_read_local, path)

    async def write(self, path: Path, text: str) -> None:
        await asyncio.to_thread(_write_local, path, text)


def _read_local(path: Path) -> str:
    if path.is_dir():
        raise ToolError(f"{path} is a directory: list it with list_dir")
    return path.read_bytes().decode("utf-8", "replace")


def _write_local(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.helexa-tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@dataclass(slots=True)
class Workspace:
    """What tools act on: the session's directory, its files, how commands run."""

    cwd: Path
    files: Files = field(default_factory=LocalFiles)
    env: Mapping[str, str] | None = None  # for ~ and $HOME (default: os.environ)
    # runs a command: (command, cwd, timeout_s) -> (exit status, output); default: locally
    run: Callable[[str, Path, float], Awaitable[tuple[int | None, str]]] | None = None

    def path(self, text: str) -> Path:
        return expand(text, self.cwd, self.env)


def parse_arguments(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """A call's arguments as a model sent them (a JSON object, or its text), with the slips
    weak models make repaired: a code fence around them, text after the object (`}}}`), the
    object sent as a JSON string. ToolError (for the model to read) when no object is left."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return raw
    text = raw.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        value, _end = json.JSONDecoder().raw_decode(text)  # what follows the object: ignored
        if isinstance(value, str):  # the object sent as a string
            value, _end = json.JSONDecoder().raw_decode(value.strip())
    except (TypeError, ValueError) as e:
        raise ToolError(f"the arguments are not JSON ({e}); send a JSON object") from None
    if not isinstance(value, dict):
        raise ToolError("the arguments must be a JSON object")
    return value


async def call_tool(
    ws: Workspace, name: str, raw_arguments: str | dict[str, Any] | None
) -> ToolResult:
    """Run one call; every failure comes back as an error result, never an exception."""
    spec = BY_NAME.get(name)
    if spec is None:
        known = ", ".join(BY_NAME)
        return ToolResult(f"there is no tool {name!r}; the tools are: {known}", error=True)
    try:
        args = parse_arguments(raw_arguments)
        _check(spec, args)
        return ToolResult(await _RUN[name](ws, args))
    except ToolError as e:
        return ToolResult(str(e), error=True)
    except OSError as e:
        return ToolResult(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "), error=True)


def _check(spec: ToolSpec, args: dict[str, Any]) -> None:
    props = spec.parameters["properties"]
    missing = [k for k in spec.parameters["required"] if k not in args]
    if missing:
        raise ToolError(f"{spec.name} needs {', '.join(missing)}")
    unknown = sorted(set(args) - set(props))
    if unknown:
        raise ToolError(f"{spec.name} takes no {', '.join(unknown)} (it takes {', '.join(props)})")
    types = {"string": str, "boolean": bool, "integer": int, "number": (int, float)}
    for key, value in args.items():
        want = props[key]["type"]
        ok = isinstance(value, types[want]) and not (want != "boolean" and isinstance(value, bool))
        if not ok:
            article = "an" if want == "integer" else "a"
            raise ToolError(f"{spec.name}: {key} must be {article} {want}, got {json.dumps(value)}")
        if want in ("integer", "number") and value < props[key].get("minimum", value):
            raise ToolError(f"{spec.name}: {key} must be at least {props[key]['minimum']}")


async def _read_file(ws: Workspace, args: dict[str, Any]) -> str:
    path = ws.path(args["path"])
    text = await ws.files.read(path)
    lines = text.splitlines(keepends=True)
    first = args.get("line", 1)
    limit = args.get("limit")
    if first > max(1, len(lines)):
        raise ToolError(f"{path} has {len(lines)} lines; line {first} is past its end")
    end = len(lines) if limit is None else first - 1 + limit
    if limit is None and end - (first - 1) > READ_MAX_LINES:
        end = first - 1 + READ_MAX_LINES
        chosen = "".join(lines[first - 1 : end])
        return chosen + f"\n[lines {first}-{end} of {len(lines)}; read on with line={end + 1}]"
    return "".join(lines[first - 1 : end])


async def _write_file(ws: Workspace, args: dict[str, Any]) -> str:
    path = ws.path(args["path"])
    await ws.files.write(path, args["content"])
    return f"wrote {path} ({len(args['content'].encode())} bytes)"


async def _edit_file(ws: Workspace, args: dict[str, Any]) -> str:
    path = ws.path(args["path"])
    old, new = args["old_text"], args["new_text"]
    if not old:
        raise ToolError("old_text is empty: to write a whole file use write_file")
    text = await ws.files.read(path)
    count = text.count(old)
    if count == 0:
        raise ToolError(
            f"old_text was not found in {path}: read the file again and copy the text exactly "
            "(whitespace and indentation included)"
        )
    if count > 1 and not args.get("replace_all"):
        raise ToolError(
            f"old_text appears {count} times in {path}: include more of the surrounding lines "
            "so it appears once, or set replace_all"
        )
    await ws.files.write(path, text.replace(old, new))
    return f"replaced {count} occurrence{'s' if count > 1 else ''} in {path}"


async def _list_dir(ws: Workspace, args: dict[str, Any]) -> str:
    path = ws.path(args["path"])
    return await asyncio.to_thread(_list_local, path)


def _list_local(path: Path) -> str:
    if not path.is_dir():
        raise ToolError(f"{path} is not a directory")
    entries = sorted(path.iterdir(), key=lambda p: (not p.is_dir(), p.name))
    lines = [p.name + ("/" if p.is_dir() else "") for p in entries[:LIST_MAX_ENTRIES]]
    if len(entries) > LIST_MAX_ENTRIES:
        lines.append(f"[{len(entries) - LIST_MAX_ENTRIES} more entries not shown]")
    return "\n".join(lines) if lines else "(empty)"


async def _bash(ws: Workspace, args: dict[str, Any]) -> str:
    cwd = ws.path(args["cwd"]) if args.get("cwd") else ws.cwd
    if not cwd.is_dir():
        raise ToolError(f"cwd {cwd} is not a directory")
    timeout = min(float(args.get("timeout_s", BASH_TIMEOUT_S)), BASH_TIMEOUT_MAX_S)
    run = ws.run or run_local
    status, output = await run(args["command"], cwd, timeout)
    head = f"exit status {status}" if status is not None else f"killed after {timeout:g} s"
    return f"{head}\n{cap_output(output)}" if output else head


async def run_local(command: str, cwd: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run `command` with bash in its own process group; (exit status, output), the status
    None when it ran past `timeout_s` and was killed (with everything it started)."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", command, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    chunks: list[bytes] = []
    size = 0

    async def drain() -> None:
        nonlocal size
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > 4 * OUTPUT_CAP_BYTES:  # keep the head and a moving tail
                joined = b"".join(chunks)
                chunks[:] = [joined[:OUTPUT_CAP_BYTES], b"\n", joined[-OUTPUT_CAP_BYTES:]]
                size = sum(len(c) for c in chunks)

    try:
        await asyncio.wait_for(asyncio.gather(drain(), proc.wait()), timeout_s)
        status: int | None = proc.returncode
    except TimeoutError:
        status = None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return status, b"".join(chunks).decode("utf-8", "replace")


def cap_output(text: str, cap: int = OUTPUT_CAP_BYTES) -> str:
    """Long output cut in the middle: the model sees how it began and how it ended."""
    data = text.encode()
    if len(data) <= cap:
        return text
    half = cap // 2
    cut = len(data) - 2 * half
    head = data[:half].decode("utf-8", "ignore")
    tail = data[-half:].decode("utf-8", "ignore")
    return f"{head}\n[… {cut} bytes of output cut …]\n{tail}"


_RUN: dict[str, Callable[[Workspace, dict[str, Any]], Awaitable[str]]] = {
    "read_file": _read_file,
    "write_file": _write_file,
    "edit_file": _edit_file,
    "list_dir": _list_dir,
    "bash": _bash,
}
