"""Admin password hashes: `scrypt$N$r$p$salt$hash` (salt and hash in unpadded urlsafe
base64), made by `helexa admin hash-password`, checked in constant time. Config validates
the format at load; the gateway's console checks passwords against it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1  # ~16 MiB and ~50 ms per check
SALT_BYTES, HASH_BYTES = 16, 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(
        password.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * n * r + 2**20, dklen=HASH_BYTES
    )


def hash_password(password: str) -> str:
    """A `scrypt$N$r$p$salt$hash` string for `[admin] password_hash`."""
    if not password:
        raise ValueError("the admin password must not be empty")
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${_b64(salt)}${_b64(digest)}"


def parse_hash(encoded: str) -> tuple[int, int, int, bytes, bytes]:
    """(N, r, p, salt, hash) of an encoded hash; ValueError naming what is wrong."""
    parts = encoded.split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        raise ValueError(
            "expected scrypt$N$r$p$salt$hash (run `helexa admin hash-password`), "
            f"got {len(parts)} '$'-separated fields starting {parts[0][:10]!r}"
        )
    try:
        n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
        salt, digest = _unb64(parts[4]), _unb64(parts[5])
    except ValueError as e:
        raise ValueError(f"malformed scrypt hash: {e}") from None
    if n < 2 or n & (n - 1) or r < 1 or p < 1 or not salt or not digest:
        raise ValueError(f"malformed scrypt hash: N={n} must be a power of two, r={r}, p={p} ≥ 1")
    return n, r, p, salt, digest


def verify_password(password: str, encoded: str) -> bool:
    """Whether `password` matches `encoded` (compared in constant time)."""
    n, r, p, salt, digest = parse_hash(encoded)
    candidate = _scrypt(password, salt, n, r, p) if len(digest) == HASH_BYTES else b""
    return hmac.compare_digest(candidate, digest)
