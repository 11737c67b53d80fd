"""Files through the editor (`fs/*`): what the editor answers wins (its unsaved buffers);
a read it refuses (a path outside its workspace) falls back to the disk; an editor that
offers no fs is never asked."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from helexa.acp.agent import ClientFiles


class Editor:
    """The editor's side of fs/*: a buffer for the project's file, a refusal elsewhere."""

    def __init__(self, project) -> None:
        self.project = project
        self.writes: list[tuple[str, str]] = []
        self.reads = 0

    async def read_text_file(self, session_id: str, path: str, **_):
        self.reads += 1
        if not path.startswith(str(self.project)):
            raise RuntimeError("outside the workspace")
        return SimpleNamespace(content="unsaved buffer\n")

    async def write_text_file(self, session_id: str, path: str, content: str, **_):
        self.writes.append((path, content))


def test_the_editor_is_read_first_and_the_disk_when_it_refuses(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "notes.md"
    project.mkdir()
    (project / "a.py").write_text("saved on disk\n")
    elsewhere.write_text("outside\n")
    editor = Editor(project)
    files = ClientFiles(editor, "s1", read=True, write=True)

    assert asyncio.run(files.read(project / "a.py")) == "unsaved buffer\n"
    assert asyncio.run(files.read(elsewhere)) == "outside\n"  # refused there: the disk
    with pytest.raises(OSError, match="the editor said: outside the workspace"):
        asyncio.run(files.read(tmp_path / "missing.md"))
    asyncio.run(files.write(project / "b.py", "x\n"))
    assert editor.writes == [(str(project / "b.py"), "x\n")] and not (project / "b.py").exists()


def test_an_editor_without_fs_is_never_asked(tmp_path):
    (tmp_path / "a.py").write_text("disk\n")
    editor = Editor(tmp_path)
    files = ClientFiles(editor, "s1", read=False, write=False)
    assert asyncio.run(files.read(tmp_path / "a.py")) == "disk\n"
    asyncio.run(files.write(tmp_path / "b.py", "y\n"))
    assert (tmp_path / "b.py").read_text() == "y\n" and editor.reads == 0 and not editor.writes
