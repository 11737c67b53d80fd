"""Who shares what on a node: every caller waits in a lane of its own (a gateway key by the
headers the gateway stamps, a direct caller by its address, the gateway's anonymous traffic
as one), freed slots go to the lane running the fewest, and only gateway keys can be
capped, when a cap is set. Real node processes; the loopback range gives each simulated
client its own address."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from tests.web.node_proc import start_node

LONG = {"max_tokens": 8000, "ignore_eos": True, "stream": True}
KEY = "node-key"


class Held:
    """A streaming chat from `address`, holding its admission slot until `close()`."""

    def __init__(self, node, model: str, address: str, headers: dict | None = None) -> None:
        self.client = httpx.Client(
            transport=httpx.HTTPTransport(local_address=address),
            headers={**node.auth, **(headers or {})},
            timeout=60,
        )
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], **LONG}
        self._cm = self.client.stream("POST", node.v1 + "/chat/completions", json=body)
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self.lines = self.response.iter_lines()  # kept: dropping it would close the stream
        next(self.lines)  # admitted and streaming

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        self.client.close()


def _post(node, model: str, address: str, headers: dict | None = None) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=address)
    with httpx.Client(transport=transport, headers={**node.auth, **(headers or {})}) as c:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        return c.post(node.v1 + "/chat/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def capped(tmp_path_factory, long_id):
    node = start_node(tmp_path_factory.mktemp("capped"), [long_id], node={"per_principal_max": 1})
    yield node
    node.stop()


def test_anonymous_direct_callers_are_never_capped(capped, long_id):
    held = Held(capped, long_id, "127.0.0.1")
    try:
        again = _post(capped, long_id, "127.0.0.1")  # the cap is for gateway keys only
        assert again.status_code == 200, again.text
        via = _post(capped, long_id, "127.0.0.1", {"x-helexa-via": "gateway"})
        assert via.status_code == 200, via.text
    finally:
        held.close()


def test_gateway_principals_count_by_key_not_by_address(capped, long_id):
    alice = {"x-helexa-account-id": "acct", "x-helexa-key-id": "alice"}
    held = Held(capped, long_id, "127.0.0.1", alice)
    try:
        assert _post(capped, long_id, "127.0.0.1", alice).status_code == 429
        bob = {"x-helexa-account-id": "acct", "x-helexa-key-id": "bob"}
        assert _post(capped, long_id, "127.0.0.1", bob).status_code == 200
    finally:
        held.close()


def test_on_a_keyed_node_gateway_headers_need_the_key(tmp_path_factory, long_id):
    node = start_node(
        tmp_path_factory.mktemp("keyed"),
        [long_id],
        node={"per_principal_max": 1, "api_key": KEY},
    )
    try:
        forged = {"x-helexa-account-id": "acct", "x-helexa-key-id": "k", "x-helexa-via": "gateway"}
        bare = httpx.post(
            node.v1 + "/chat/completions",
            json={"model": long_id, "messages": [{"role": "user", "content": "Hi"}]},
            headers=forged,
        )
        assert bare.status_code == 401  # nothing forged gets past the door
        # a budget header from the key holder binds: one output token fits, no more
        chat = {"model": long_id, "messages": [{"role": "user", "content": "Hi"}]}
        prompt = node.post("/tokenize", chat).json()["count"]
        tight = {**forged, "x-helexa-budget": f"tokens={prompt + 1}; cost=1.0; in=0; out=0"}
        r = _post(node, long_id, "127.0.0.1", tight)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
    finally:
        node.stop()


# -- fair shares --------------------------------------------------------------------------

ALICE = {"x-helexa-account-id": "acct", "x-helexa-key-id": "alice"}
BOB = {"x-helexa-account-id": "acct", "x-helexa-key-id": "bob"}
HANG_GUARD_S = 120.0  # only a hang: every wait below ends on an event


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


class Flood:
    """`n` streams opened at once from threads; `admitted` lists them as the node admits
    them (its answer's status line arrives only once a slot is theirs)."""

    def __init__(self, node, model: str, who: dict, n: int) -> None:
        self.admitted: list[Held] = []
        self.refused: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._open, args=(node, model, who), daemon=True)
            for _ in range(n)
        ]
        for t in self.threads:
            t.start()

    def _open(self, node, model: str, who: dict) -> None:
        try:
            held = Held(node, model, "127.0.0.1", who)
        except BaseException as e:  # a refusal: Held asserts a 200
            with self._lock:
                self.refused.append(e)
            return
        with self._lock:
            self.admitted.append(held)

    def count(self) -> int:
        with self._lock:
            return len(self.admitted)


def _load(node) -> tuple[int, int]:
    (m,) = node.get("/health").json()["models"]
    return m["in_flight"], m["queue_depth"]


@pytest.fixture(scope="module")
def saturated(tmp_path_factory, long_id):
    """A default node but for its running set, small enough for 32 streams to saturate."""
    node = start_node(tmp_path_factory.mktemp("fair"), [long_id], node={"max_running_requests": 4})
    yield node
    node.stop()


def test_one_keys_flood_neither_starves_another_key_nor_is_refused_while_the_queue_has_room(
    saturated, long_id
):
    flood = Flood(saturated, long_id, ALICE, 32)
    bob: Flood | None = None
    closed: list[Held] = []
    try:
        _until(lambda: _load(saturated) == (4, 28), "alice's 32 streams: 4 running, 28 queued")
        assert flood.count() == 4 and not flood.refused
        bob = Flood(saturated, long_id, BOB, 1)
        _until(lambda: _load(saturated) == (4, 29), "bob's request queued behind alice's 28")

        first = flood.admitted[0]
        first.close()  # one slot frees: bob runs 0 and alice 3, so it is bob's
        closed.append(first)
        _until(lambda: bob.count() == 1, "bob admitted at the first freed slot")
        assert flood.count() == 4, "one of alice's queued requests overtook bob"
        assert _load(saturated) == (4, 28)

        # alice's queued requests all run in turn as slots free; none is refused
        while flood.count() + len(flood.refused) < 32:
            with flood._lock:
                open_ones = [h for h in flood.admitted if h not in closed]
            for h in open_ones:
                h.close()
                closed.append(h)
            # each closed stream's slot goes to alice's next (the first went to bob)
            target = min(32, len(closed) + 3)
            _until(
                lambda target=target: flood.count() + len(flood.refused) >= target,
                "the next of alice's queued requests admitted",
            )
        assert not flood.refused, flood.refused
        assert not bob.refused, bob.refused
    finally:
        for h in [*flood.admitted, *(bob.admitted if bob else [])]:
            if h not in closed:
                h.close()


def test_a_default_node_serves_one_clients_eight_concurrent_streams(tmp_path_factory, long_id):
    """The official SDK's pattern: one process, one address, eight streams at once; a
    default node (no per-principal setting at all) serves every one."""
    node = start_node(tmp_path_factory.mktemp("sdk"), [long_id])

    async def chat(client: openai.AsyncOpenAI) -> str:
        stream = await client.chat.completions.create(
            model=long_id,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def eight() -> list[str]:
        client = openai.AsyncOpenAI(base_url=node.v1, api_key="none", max_retries=0)
        async with client:
            return await asyncio.gather(*(chat(client) for _ in range(8)))

    try:
        answers = asyncio.run(eight())  # a refusal raises openai.RateLimitError
        assert len(answers) == 8 and all(answers), answers
    finally:
        node.stop()
