"""The sd_notify protocol, for a `Type=notify` unit: tell systemd that the service is ready,
what it is doing, and that it is stopping. Newline-separated `KEY=value` lines in one
datagram to the AF_UNIX socket named by $NOTIFY_SOCKET (a leading '@' names the abstract
namespace); without that variable (not run by systemd) nothing is sent."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*assignments: str) -> bool:
    """Send `READY=1`, `STATUS=…`, `STOPPING=1` … in one message; True when it was sent.

    Never raises: a service must not fail because its manager stopped listening."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target or not assignments:
        return False
    if target.startswith("@"):
        address = "\0" + target[1:]
    elif target.startswith("/"):
        address = target
    else:  # vsock: and the like are for virtual machines, not a service
        log.debug("sd_notify: unsupported NOTIFY_SOCKET %r", target)
        return False
    # one assignment per line: a newline inside a value would start a bogus one
    message = "\n".join(a.replace("\n", " ") for a in assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError as e:
        log.debug("sd_notify to %s failed: %s", target, e)
        return False
    return True
