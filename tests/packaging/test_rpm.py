"""The RPM: its files, config files, scriptlets, provides and release, and units that
`systemd-analyze verify` accepts as they lie in the package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

import helexa
from tests.conftest import REPO_ROOT
from tests.packaging.conftest import need, rpm_query, unpack

WHEEL = f"/usr/share/helexa/wheels/helexa-{helexa.__version__}-py3-none-any.whl"
UNITS = ("helexa-node.service", "helexa-gateway.service")
FILES = {
    "/usr/lib/systemd/system/helexa-node.service",
    "/usr/lib/systemd/system/helexa-gateway.service",
    "/usr/lib/sysusers.d/helexa.conf",
    "/usr/lib/firewalld/services/helexa-node.xml",
    "/usr/lib/firewalld/services/helexa-gateway.xml",
    "/etc/helexa/helexa.toml",
    "/etc/helexa/setup-venv.env",
    "/usr/bin/helexa",
    "/usr/libexec/helexa/setup-venv",
    WHEEL,
}


def _files(rpm: Path) -> dict[str, tuple[str, str, str, str]]:
    """path → (permissions, owner, group, flags: c config, n noreplace, d doc …)."""
    fmt = "[%{FILENAMES}\t%{FILEMODES:perms}\t%{FILEUSERNAME}\t%{FILEGROUPNAME}\t%{FILEFLAGS:fflags}\n]"
    rows = (line.split("\t") for line in rpm_query(rpm, "--qf", fmt).splitlines())
    return {path: (perms, user, group, flags) for path, perms, user, group, flags in rows}


def _scriptlets(rpm: Path) -> dict[str, str]:
    """`rpm -qp --scripts` split by scriptlet: preinstall, postinstall, preuninstall …"""
    parts = re.split(
        r"^(\w+) scriptlet \(using /bin/sh\):\n", rpm_query(rpm, "--scripts"), flags=re.M
    )
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_package_holds_the_units_sysusers_firewalld_services_config_wrapper_and_wheel(
    rpm_path,
):
    listed = set(rpm_query(rpm_path, "-l").split())

    assert listed >= FILES


def test_the_config_is_kept_on_upgrade_and_readable_only_by_root_and_the_service_group(
    rpm_path,
):
    files = _files(rpm_path)

    assert "/etc/helexa/helexa.toml" in rpm_query(rpm_path, "--configfiles").split()
    assert files["/etc/helexa/helexa.toml"] == ("-rw-r-----", "root", "helexa", "cn")
    assert files["/etc/helexa"][:3] == ("drwxr-x---", "root", "helexa")
    assert files["/etc/helexa/setup-venv.env"][3] == "cn"
    assert files["/usr/bin/helexa"][0] == "-rwxr-xr-x"
    assert files["/usr/libexec/helexa/setup-venv"][0] == "-rwxr-xr-x"


def test_the_package_provides_its_user_and_group_and_needs_python_311_and_systemd(rpm_path):
    provides = rpm_query(rpm_path, "--provides").splitlines()
    requires = rpm_query(rpm_path, "--requires").splitlines()

    assert {"user(helexa)", "group(helexa)"} <= set(provides)
    assert "systemd" in requires
    assert "(python3 >= 3.11 or python3.13 or python3.12 or python3.11)" in requires
    assert rpm_query(rpm_path, "--qf", "%{ARCH}") == "noarch"


def test_the_release_sorts_by_build_time_before_the_commit(rpm_path):
    release = rpm_query(rpm_path, "--qf", "%{RELEASE}")

    if (REPO_ROOT / ".git").exists():
        assert re.fullmatch(r"1\.\d{14}\.git[0-9a-f]{9}", release), release
    else:
        assert re.fullmatch(r"1\.\d{14}", release), release


def test_the_wheel_carries_build_info_for_version(rpm_root):
    with zipfile.ZipFile(rpm_root / WHEEL.lstrip("/")) as wheel:
        info = json.loads(wheel.read("helexa/_build_info.json"))
        record = wheel.read(f"helexa-{helexa.__version__}.dist-info/RECORD").decode()

    assert set(info) == {"git_sha", "git_dirty", "build_time"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", info["build_time"])
    if (REPO_ROOT / ".git").exists():
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
        assert info["git_sha"] == head
        assert isinstance(info["git_dirty"], bool)
    assert "helexa/_build_info.json,sha256=" in record


def test_the_scriptlets_create_the_user_first_and_act_as_systemds_macros_would(rpm_path):
    scripts = _scriptlets(rpm_path)

    pre = scripts["preinstall"]
    assert "systemd-sysusers --replace=/usr/lib/sysusers.d/helexa.conf -" in pre
    assert 'u helexa - "helexa LLM serving" /var/lib/helexa /usr/sbin/nologin' in pre
    assert "m helexa video" in pre and "m helexa render" in pre
    assert "/usr/libexec/helexa/setup-venv" in scripts["postinstall"]
    assert "rm -rf /usr/lib/helexa/venv" in scripts["preuninstall"]
    for body in scripts.values():
        subprocess.run(["sh", "-n"], input=body, text=True, check=True)


@pytest.mark.parametrize(
    "scriptlet,arg,calls",
    [
        ("postinstall", 1, ["--no-reload preset helexa-node.service helexa-gateway.service"]),
        ("postinstall", 2, []),
        (
            "preuninstall",
            0,
            ["--no-reload disable --now helexa-node.service helexa-gateway.service"],
        ),
        ("preuninstall", 1, []),
        ("postuninstall", 0, ["daemon-reload"]),
        (
            "postuninstall",
            1,
            ["daemon-reload", "try-restart --no-block helexa-node.service helexa-gateway.service"],
        ),
    ],
    ids=["install", "upgrade-post", "erase", "upgrade-preun", "erased", "upgraded"],
)
def test_scriptlets_call_systemctl_by_install_erase_or_upgrade(
    rpm_path, tmp_path, scriptlet, arg, calls
):
    """Run with a systemctl that records its calls; the venv's paths point into tmp."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "setup-venv").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    body = _scriptlets(rpm_path)[scriptlet]
    body = body.replace("/usr/libexec/helexa/setup-venv", str(bin_dir / "setup-venv"))
    body = body.replace("/usr/lib/helexa/venv", str(tmp_path / "venv"))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}

    subprocess.run(["sh", "-c", body, scriptlet, str(arg)], env=env, check=True)

    assert (log.read_text().splitlines() if log.exists() else []) == calls


def test_a_failed_venv_build_leaves_the_install_standing_and_says_what_to_run(rpm_path, tmp_path):
    failing = tmp_path / "setup-venv"
    failing.write_text("#!/bin/sh\necho 'pip: no network' >&2\nexit 1\n")
    failing.chmod(0o755)
    body = _scriptlets(rpm_path)["postinstall"].replace(
        "/usr/libexec/helexa/setup-venv", str(failing), 1
    )

    done = subprocess.run(["sh", "-c", body, "postinstall", "1"], capture_output=True, text=True)

    assert done.returncode == 0
    assert "run: sudo /usr/libexec/helexa/setup-venv" in done.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify_accepts_the_unit_as_packaged(rpm_path, tmp_path, unit):
    """Under --root=<the unpacked RPM> (ExecStart's /usr/bin/helexa is there), with the
    host's own units beside it (the targets the unit's dependencies name)."""
    need("systemd-analyze")
    root = unpack(rpm_path, tmp_path / "root")
    units = root / "usr/lib/systemd/system"
    host_units = next(
        p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()
    )
    shutil.copytree(
        host_units, units, symlinks=True, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*UNITS)
    )

    done = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", unit], capture_output=True, text=True
    )

    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # not even an unknown key


def test_the_command_without_its_venv_names_setup_venv_and_fails(rpm_root):
    done = subprocess.run(
        [str(rpm_root / "usr/bin/helexa"), "--version"], capture_output=True, text=True
    )

    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1
    assert "/usr/libexec/helexa/setup-venv" in done.stderr


def test_build_rpm_without_rpmbuild_says_what_to_install(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    bash = shutil.which("bash")
    assert bash is not None

    done = subprocess.run(
        [bash, str(REPO_ROOT / "packaging/build-rpm"), str(tmp_path / "out")],
        env={"PATH": str(empty)},
        capture_output=True,
        text=True,
    )

    assert done.returncode == 1
    assert "rpmbuild not found" in done.stderr and "setup-env --packaging" in done.stderr
    assert not (tmp_path / "out").exists()
