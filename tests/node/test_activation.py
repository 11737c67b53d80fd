"""The default models' load at start: what it tells as it goes (the STATUS lines systemd
shows) and when the node counts as ready (READY=1), failures included."""

from __future__ import annotations

import asyncio

from helexa.config import Config
from helexa.errors import model_not_found
from helexa.node.service import Node


class _Registry:
    """Loads succeed, except for the ids in `missing`."""

    def __init__(self, missing: set[str]) -> None:
        self.missing = missing

    async def load(self, options) -> None:
        if options.model_id in self.missing:
            raise model_not_found(options.model_id)


def _node(models: list[str], missing: set[str] = frozenset()) -> Node:
    cfg = Config()
    cfg.node.default_models = models
    return Node(cfg, _Registry(set(missing)), metrics=None)  # type: ignore[arg-type]


def test_each_default_model_is_announced_as_it_starts_loading():
    node = _node(["org/a", "org/b"])
    lines: list[str] = []
    node.on_progress = lines.append

    asyncio.run(node.load_defaults())

    assert lines == ["loading org/a (1 of 2)", "loading org/b (2 of 2)"]


def test_ready_waits_for_the_load_and_says_what_failed():
    node = _node(["org/a", "org/gone"], missing={"org/gone"})

    async def scenario() -> tuple[bool, str]:
        waiting = asyncio.create_task(node.ready())
        await asyncio.sleep(0)
        early = waiting.done()
        await node.load_defaults()
        return early, await waiting

    early, summary = asyncio.run(scenario())

    assert early is False
    assert summary == "1 of 2 default models loaded; failed: org/gone"
    assert node.activation.state == "ready"
