"""The admin console's password hashes, sessions (in a real SQLite file), CSRF tokens and login
brake, without HTTP."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from sqlalchemy import func, select

from helexa.config import ConfigError, load_config
from helexa.db.models import AdminSessionRow
from helexa.gateway import admin_auth
from helexa.gateway.admin_auth import LoginThrottle, PasswordCheck, SessionStore, csrf_ok
from helexa.passwords import hash_password, parse_hash, verify_password


def test_a_hash_verifies_its_own_password_and_no_other():
    encoded = hash_password("correct horse")
    assert encoded.startswith("scrypt$16384$8$1$")
    assert verify_password("correct horse", encoded)
    assert not verify_password("correct horse ", encoded)
    assert not verify_password("", encoded)


def test_the_same_password_hashes_differently_each_time():
    assert hash_password("pw") != hash_password("pw")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "pw",
        "bcrypt$1$2$3$a$b",
        "scrypt$16384$8$1$salt",
        "scrypt$1000$8$1$c2FsdA$aGFzaA",
        "scrypt$x$8$1$a$b",
    ],
)
def test_a_malformed_hash_is_refused_with_the_expected_shape(bad):
    with pytest.raises(ValueError, match="scrypt"):
        parse_hash(bad)


def test_an_empty_password_cannot_be_hashed():
    with pytest.raises(ValueError, match="empty"):
        hash_password("")


def test_no_password_configured_turns_the_console_off():
    assert not PasswordCheck(None, None).enabled
    assert not PasswordCheck(None, None).check("")


def test_the_environment_password_or_the_hash_lets_in():
    check = PasswordCheck(hash_password("from-file"), "from-env")
    assert check.enabled
    assert check.check("from-env") and check.check("from-file")
    assert not check.check("guess")


def test_config_refuses_a_broken_hash_and_reads_the_env_password(tmp_path):
    path = tmp_path / "helexa.toml"
    path.write_text('[admin]\npassword_hash = "md5$abc"\n')
    with pytest.raises(ConfigError, match=r"\[admin\] password_hash: expected scrypt\$N\$r\$p"):
        load_config(path, env={})
    good = hash_password("pw")
    path.write_text(f'[admin]\npassword_hash = "{good}"\nsession_ttl_s = 60\n')
    cfg = load_config(path, env={"HELEXA_ADMIN_PASSWORD": "env-pw"})
    assert cfg.admin.password_hash == good and cfg.admin.session_ttl_s == 60
    assert cfg.admin.password == "env-pw"


def test_sessions_expire_and_logging_out_ends_them(sessions):
    store = SessionStore(ttl_s=10)
    s = store.create(sessions, now=1000)
    assert store.get(sessions, s.token, now=1009) == s
    assert store.get(sessions, s.token, now=1010) is None  # expired, and forgotten
    assert store.get(sessions, s.token, now=1000) is None
    t = store.create(sessions, now=2000)
    store.drop(sessions, t.token)
    assert store.get(sessions, t.token, now=2001) is None
    assert store.get(sessions, None) is None and store.get(sessions, "") is None


def test_the_database_holds_a_hash_of_the_token_never_the_token(sessions):
    s = SessionStore(ttl_s=60).create(sessions)
    with sessions() as db:
        [row] = db.scalars(select(AdminSessionRow)).all()
    assert row.token_hash == hashlib.sha256(s.token.encode()).hexdigest() != s.token
    assert row.csrf == s.csrf


def test_a_session_made_by_one_store_is_served_by_another_on_the_same_database(sessions):
    s = SessionStore(ttl_s=60).create(sessions)
    assert SessionStore(ttl_s=60).get(sessions, s.token) == s


def test_logging_in_sweeps_expired_sessions_and_keeps_the_newest_under_the_cap(
    sessions, monkeypatch
):
    monkeypatch.setattr(admin_auth, "MAX_SESSIONS", 3)
    store = SessionStore(ttl_s=10)
    stale = store.create(sessions, now=0)
    made = [store.create(sessions, now=100 + i) for i in range(4)]
    with sessions() as db:
        left = db.scalar(select(func.count()).select_from(AdminSessionRow))
    assert left == 3
    assert store.get(sessions, stale.token, now=103) is None
    assert store.get(sessions, made[0].token, now=103) is None  # the oldest made room
    assert all(store.get(sessions, m.token, now=103) == m for m in made[1:])


def test_each_session_has_its_own_csrf_token(sessions):
    store = SessionStore(ttl_s=60)
    a, b = store.create(sessions), store.create(sessions)
    assert a.csrf != b.csrf and a.token != b.token
    assert csrf_ok(a, a.csrf)
    assert not csrf_ok(a, b.csrf) and not csrf_ok(a, "") and not csrf_ok(a, None)


def test_five_wrong_passwords_in_a_minute_make_a_client_wait():
    throttle = LoginThrottle()
    for i in range(5):
        assert throttle.wait_s("10.0.0.1", now=100 + i) == 0
        throttle.failed("10.0.0.1", now=100 + i)
    assert throttle.wait_s("10.0.0.1", now=105) == pytest.approx(55)
    assert throttle.wait_s("10.0.0.2", now=105) == 0  # others are not held up
    assert throttle.wait_s("10.0.0.1", now=161) == 0  # the oldest failure left the window
    throttle.failed("10.0.0.3", now=1)
    throttle.succeeded("10.0.0.3")
    assert throttle.wait_s("10.0.0.3", now=2) == 0


def test_the_cli_prints_a_hash_that_verifies():
    out = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "admin", "hash-password", "--stdin"],
        input="s3cret\n",
        capture_output=True,
        text=True,
        check=True,
    )
    encoded = out.stdout.strip()
    assert verify_password("s3cret", encoded)
    assert "password_hash" in out.stderr
