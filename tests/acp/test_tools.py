"""The tools `helexa acp` gives a model, on a real project directory and a real bash: each
does what its schema says, and every misuse comes back as an error the model can read,
never an exception."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from helexa.acp.paths import expand, inside, plan_dir
from helexa.acp.tools import TOOLS, Workspace, call_tool, cap_output


@pytest.fixture
def ws(tmp_path) -> Workspace:
    project = tmp_path / "project"
    project.mkdir()
    (project / "src").mkdir()
    (project / "src" / "app.py").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    (project / "README.md").write_text("hello\n")
    return Workspace(project, env={"HOME": str(tmp_path / "home")})


def _call(ws: Workspace, name: str, args) -> tuple[str, bool]:
    result = asyncio.run(call_tool(ws, name, args if isinstance(args, str) else json.dumps(args)))
    return result.text, result.error


def test_every_tool_has_a_schema_an_openai_client_accepts():
    for spec in TOOLS:
        entry = spec.openai()
        assert entry["type"] == "function" and entry["function"]["name"] == spec.name
        params = entry["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        assert spec.kind in ("read", "edit", "execute", "search")


def test_read_file_whole_and_by_lines(ws):
    text, error = _call(ws, "read_file", {"path": "src/app.py"})
    assert not error and text.startswith("line 1\n") and text.endswith("line 10\n")
    text, error = _call(ws, "read_file", {"path": "src/app.py", "line": 3, "limit": 2})
    assert (text, error) == ("line 3\nline 4\n", False)
    text, error = _call(ws, "read_file", {"path": "src/app.py", "line": 40})
    assert error and "has 10 lines" in text
    text, error = _call(ws, "read_file", {"path": "missing.py"})
    assert error and "No such file" in text
    text, error = _call(ws, "read_file", {"path": "src"})
    assert error and "is a directory" in text


def test_write_file_creates_directories_and_replaces(ws):
    text, error = _call(ws, "write_file", {"path": "new/dir/x.txt", "content": "é\n"})
    assert not error and "wrote" in text
    assert (ws.cwd / "new" / "dir" / "x.txt").read_text() == "é\n"
    _call(ws, "write_file", {"path": "new/dir/x.txt", "content": "two\n"})
    assert (ws.cwd / "new" / "dir" / "x.txt").read_text() == "two\n"


def test_edit_file_needs_one_exact_match(ws):
    text, error = _call(
        ws, "edit_file", {"path": "src/app.py", "old_text": "line 3\n", "new_text": "LINE 3\n"}
    )
    assert not error and "replaced 1 occurrence" in text
    assert "LINE 3\nline 4" in (ws.cwd / "src" / "app.py").read_text()
    text, error = _call(ws, "edit_file", {"path": "src/app.py", "old_text": "nope", "new_text": ""})
    assert error and "was not found" in text
    text, error = _call(
        ws, "edit_file", {"path": "src/app.py", "old_text": "line", "new_text": "x"}
    )
    assert error and "appears 9 times" in text  # unchanged, and told how to fix it
    assert (ws.cwd / "src" / "app.py").read_text().count("line") == 9
    text, error = _call(
        ws,
        "edit_file",
        {"path": "src/app.py", "old_text": "line", "new_text": "row", "replace_all": True},
    )
    assert not error and "replaced 9 occurrences" in text


def test_list_dir(ws):
    text, error = _call(ws, "list_dir", {"path": "."})
    assert (text, error) == ("src/\nREADME.md", False)
    text, error = _call(ws, "list_dir", {"path": "README.md"})
    assert error and "not a directory" in text


def test_home_and_tilde_expand(ws, tmp_path):
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "a.md").write_text("from home\n")
    for path in ("~/notes/a.md", "$HOME/notes/a.md", "${HOME}/notes/a.md"):
        assert _call(ws, "read_file", {"path": path}) == ("from home\n", False)
    assert expand("../x", ws.cwd) == ws.cwd.parent / "x"
    assert expand("~", ws.cwd, {"HOME": "/h"}) == Path("/h")


def test_bash_runs_in_the_project_with_status_and_output(ws):
    text, error = _call(ws, "bash", {"command": "pwd; echo oops >&2; exit 3"})
    assert not error
    assert text.splitlines() == ["exit status 3", str(ws.cwd), "oops"]
    text, _ = _call(ws, "bash", {"command": "pwd", "cwd": "src"})
    assert text.splitlines()[1] == str(ws.cwd / "src")


def test_bash_kills_a_command_past_its_timeout_with_what_it_started(ws):
    t0 = time.monotonic()
    text, error = _call(
        ws, "bash", {"command": "echo started; sleep 30 & sleep 30", "timeout_s": 1}
    )
    assert not error and text.startswith("killed after 1 s") and "started" in text
    assert time.monotonic() - t0 < 10


def test_long_output_is_cut_in_the_middle(ws):
    text, _ = _call(ws, "bash", {"command": "seq 1 200000"})
    assert text.startswith("exit status 0\n1\n2\n") and text.rstrip().endswith("200000")
    assert "bytes of output cut" in text and len(text) < 40_000
    assert cap_output("short") == "short"


@pytest.mark.parametrize(
    ("name", "args", "says"),
    [
        ("nope", {}, "there is no tool 'nope'"),
        ("read_file", "{not json", "not JSON"),
        ("read_file", "[1, 2]", "must be a JSON object"),
        ("read_file", {}, "read_file needs path"),
        ("read_file", {"path": 3}, "path must be a string"),
        ("read_file", {"path": "x", "line": 0}, "line must be at least 1"),
        ("read_file", {"path": "x", "line": True}, "line must be an integer"),
        ("write_file", {"path": "x", "content": "y", "mode": "w"}, "takes no mode"),
        ("edit_file", {"path": "README.md", "old_text": "", "new_text": "x"}, "old_text is empty"),
        ("bash", {"command": "true", "cwd": "missing"}, "is not a directory"),
    ],
)
def test_a_bad_call_is_an_error_the_model_can_read(ws, name, args, says):
    text, error = _call(ws, name, args)
    assert error and says in text, text


def test_plan_directories_are_per_project_and_stable(tmp_path):
    env = {"XDG_DATA_HOME": str(tmp_path / "data"), "HOME": str(tmp_path)}
    a, b = tmp_path / "one" / "app", tmp_path / "two" / "app"
    assert plan_dir(a, env) == plan_dir(a, env) != plan_dir(b, env)
    assert plan_dir(a, env).parent == tmp_path / "data" / "helexa" / "acp" / "plans"
    assert plan_dir(a, env).name.startswith("app-")
    assert inside(plan_dir(a, env) / "plan.md", plan_dir(a, env))
    assert not inside(plan_dir(a, env).parent / "x.md", plan_dir(a, env))


@pytest.mark.parametrize(
    "raw",
    [
        '{"path": "README.md"}}}',  # a brace too many
        '```json\n{"path": "README.md"}\n```',  # fenced
        '"{\\"path\\": \\"README.md\\"}"',  # the object as a JSON string
    ],
)
def test_a_weak_models_slips_in_its_arguments_are_repaired(ws, raw):
    assert _call(ws, "read_file", raw) == ("hello\n", False)
