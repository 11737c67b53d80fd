"""A throwaway PostgreSQL cluster for tests: Debian's `postgresql` binaries (initdb, pg_ctl),
a cluster in a fresh temporary directory with fsync off, reachable on a Unix socket in that
directory and on a free TCP port on 127.0.0.1, trust authentication, superuser `postgres`.

initdb refuses to run as root, so under root the server runs as the `postgres` OS user
(`runuser -u postgres --`) and its directory is handed to that user.

    cluster = PostgresCluster.start()
    url = cluster.create_database("test_abc")   # postgresql+psycopg://postgres@/test_abc?host=...
    ...
    cluster.drop_database("test_abc")           # connections to it are terminated first
    cluster.stop()                              # immediate shutdown; the directory is removed

The fixtures over this (`postgres_cluster`, `postgres_url`, `db_url`) are in tests/conftest.py.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUPERUSER = "postgres"
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",  # a crash loses a throwaway cluster anyway
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",  # gateways under test keep pools of their own
    "shared_buffers": "32MB",
    "logging_collector": "off",
}


# Started beside the server: when the process that started the cluster is gone without
# stopping it (killed, or its atexit never ran) this stops the server and removes its files.
WATCHDOG = """
import os, shutil, subprocess, sys, time
parent, pg_ctl, data, root, *as_user = sys.argv[1:]
while os.getppid() == int(parent):
    time.sleep(0.5)
subprocess.run([*as_user, pg_ctl, "stop", "-m", "immediate", "-w", "-D", data], cwd=root,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
shutil.rmtree(root, ignore_errors=True)
"""


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries (or no psycopg) on this machine."""


def find_bindir() -> Path:
    """The directory holding initdb, pg_ctl and postgres: `pg_config --bindir`, else the
    newest /usr/lib/postgresql/*/bin (Debian's layout), else wherever PATH finds initdb."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))

    def version(path: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", path))

    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version)][
        ::-1
    ]
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).parent)
    for bindir in candidates:
        if all((bindir / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return bindir
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres): `apt-get install postgresql`"
        " (scripts/setup-env does it)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresCluster:
    bindir: Path
    root: Path  # the temporary directory: data/, the socket, the server's log
    port: int
    as_user: list[str] = field(default_factory=list)  # ["runuser", "-u", "postgres", "--"]
    _stopped: bool = False
    _watchdog: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @classmethod
    def start(cls, parent: Path | str | None = None, *, timeout_s: float = 60) -> PostgresCluster:
        """initdb and start a cluster in a new directory under `parent` (default: the
        system's temporary directory; under root it must be one the postgres user can reach,
        which pytest's per-user 0700 tmp_path is not). Raises PostgresUnavailable when the
        binaries or psycopg are missing, RuntimeError (with the server's log) when it fails."""
        try:
            import psycopg  # noqa: F401  (the tests' driver; fail here, not at the first test)
        except ImportError as e:
            raise PostgresUnavailable(
                "psycopg is not installed: pip install -e '.[test]' (or '.[postgres]')"
            ) from e
        bindir = find_bindir()
        as_user: list[str] = []
        root = Path(tempfile.mkdtemp(prefix="helexa-pg-", dir=parent))
        if os.geteuid() == 0:
            try:
                pg = pwd.getpwnam(SUPERUSER)
            except KeyError as e:
                shutil.rmtree(root, ignore_errors=True)
                raise PostgresUnavailable(
                    "running as root and there is no `postgres` user to run the server as"
                ) from e
            os.chown(root, pg.pw_uid, pg.pw_gid)
            as_user = ["runuser", "-u", SUPERUSER, "--"]
        cluster = cls(bindir=bindir, root=root, port=0, as_user=as_user)
        watch = [str(os.getpid()), str(bindir / "pg_ctl"), str(cluster.data), str(root)]
        cluster._watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, *watch, *as_user],
            start_new_session=True,  # outlives a kill of this process's group
            stdin=subprocess.DEVNULL,
        )
        try:
            cluster._initdb()
            last: Exception | None = None
            for _ in range(3):  # the free port can be taken between choosing and binding it
                cluster.port = _free_port()
                try:
                    cluster._pg_ctl_start(timeout_s)
                    break
                except RuntimeError as e:
                    last = e
            else:
                assert last is not None
                raise last
        except BaseException:
            cluster.stop()  # a server that started but missed pg_ctl's deadline goes too
            raise
        atexit.register(cluster.stop)  # should the session's teardown never run
        return cluster

    def _run(self, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        # cwd: a directory the postgres user may enter (root's cwd may not be one)
        return subprocess.run(
            [*self.as_user, *argv],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env={**os.environ, "LC_ALL": "C", "LANG": "C"},
        )

    def _initdb(self) -> None:
        out = self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
            "--no-instructions",
        )
        if out.returncode != 0:
            raise RuntimeError(f"initdb failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")

    def _pg_ctl_start(self, timeout_s: float) -> None:
        options = {
            **SETTINGS,
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
        }
        # pg_ctl hands -o to the server through a shell: no value here has a space or quote
        server_options = " ".join(f"-c {k}={v}" for k, v in options.items())
        out = self._run(
            str(self.bindir / "pg_ctl"),
            "start",
            "-w",
            "-t",
            str(int(timeout_s)),
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            server_options,
            timeout_s=timeout_s + 10,
        )
        if out.returncode != 0:
            log = self.log.read_text(errors="replace") if self.log.exists() else ""
            raise RuntimeError(
                f"pg_ctl start failed ({out.returncode}):\n{out.stdout}\n{out.stderr}\n{log}"
            )

    def url(self, database: str = "postgres", *, tcp: bool = False) -> str:
        """A SQLAlchemy URL (psycopg 3) for `database`: over the Unix socket, or TCP."""
        if tcp:
            return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"
        return (
            f"postgresql+psycopg://{SUPERUSER}@/{database}?host={self.socket_dir}&port={self.port}"
        )

    def _admin(self):  # type: ignore[no-untyped-def]
        import psycopg

        return psycopg.connect(
            host=str(self.socket_dir),
            port=self.port,
            user=SUPERUSER,
            dbname="postgres",
            autocommit=True,
            connect_timeout=10,
        )

    def create_database(self, name: str, *, tcp: bool = False) -> str:
        """CREATE DATABASE `name`; its URL (see `url`)."""
        _check_name(name)
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name, tcp=tcp)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE `name`, terminating whatever is still connected to it."""
        _check_name(name)
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Stop the server at once (it holds nothing worth a clean shutdown) and remove its
        directory. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(
                    str(self.bindir / "pg_ctl"),
                    "stop",
                    "-m",
                    "immediate",
                    "-w",
                    "-D",
                    str(self.data),
                    timeout_s=30,
                )
        finally:
            self._remove()

    def _remove(self) -> None:
        self._stopped = True
        deadline = time.monotonic() + 5
        while True:
            shutil.rmtree(self.root, ignore_errors=True)
            if not self.root.exists() or time.monotonic() > deadline:
                return
            time.sleep(0.1)


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name):
        raise ValueError(f"not a plain database name: {name!r}")
