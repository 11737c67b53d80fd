"""How the gateway's handlers get what they work with: the gateway itself (one typed
provider over `app.state`, injected as the `gateway` parameter, and read by hooks that get
no injection), and the request's log line that the outer layer (gateway_asgi) began."""

from __future__ import annotations

from litestar import Request
from litestar.di import Provide

from helexa.gateway.request_log import RECORD_STATE, RequestRecord
from helexa.gateway.service import Gateway

STATE_KEY = "gateway"


def gateway_of(request: Request) -> Gateway:
    return request.app.state[STATE_KEY]


def dependencies() -> dict[str, Provide]:
    """An app's `dependencies`: its handlers declare `gateway: Gateway`."""
    return {"gateway": Provide(gateway_of, sync_to_thread=False)}


def record_of(request: Request) -> RequestRecord | None:
    """The request's log line in the making (None outside /v1/)."""
    return request.state.get(RECORD_STATE)
