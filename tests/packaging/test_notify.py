"""helexa.systemd.notify: the sd_notify datagram, to a path socket or an abstract one."""

from __future__ import annotations

import socket
import uuid

import pytest

from helexa.systemd import notify


@pytest.fixture
def listener():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(5)
    yield sock
    sock.close()


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)

    assert notify("READY=1") is False


def test_assignments_arrive_as_lines_of_one_datagram_on_a_path_socket(
    monkeypatch, tmp_path, listener
):
    path = tmp_path / "notify.sock"
    listener.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))

    assert notify("READY=1", "STATUS=loading a (1 of 2)") is True

    assert listener.recv(4096) == b"READY=1\nSTATUS=loading a (1 of 2)"


def test_a_leading_at_sign_names_the_abstract_namespace(monkeypatch, listener):
    name = f"helexa-test-{uuid.uuid4().hex}"
    listener.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)

    assert notify("STOPPING=1") is True

    assert listener.recv(4096) == b"STOPPING=1"


def test_a_newline_inside_a_value_cannot_start_another_assignment(monkeypatch, tmp_path, listener):
    path = tmp_path / "notify.sock"
    listener.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))

    notify("STATUS=failed: bad\nREADY=1")

    assert listener.recv(4096) == b"STATUS=failed: bad READY=1"


def test_a_socket_nobody_listens_on_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))

    assert notify("READY=1") is False
