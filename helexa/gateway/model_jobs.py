"""Loads and unloads an operator asked for, run in the background so a page can show their
status while a model loads (a node answers `POST /models/load` only once it is loaded)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from helexa.gateway.fleet import NodeView
from helexa.gateway.router import Router
from helexa.logs import event

log = logging.getLogger(__name__)

KEEP_FINISHED_S = 600.0  # finished jobs stay listed this long
MAX_FINISHED = 20


@dataclass(slots=True)
class Job:
    action: Literal["load", "unload"]
    node: str
    model_id: str  # as the node knows it
    state: Literal["running", "done", "failed"] = "running"
    message: str = ""
    started_at: float = 0.0
    finished_at: float | None = None

    @property
    def seconds(self) -> float:
        return (self.finished_at or time.time()) - self.started_at


class ModelJobs:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._jobs: list[Job] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def load(self, node_name: str, model: str) -> Job:
        """Start loading catalogue model (or node model id) `model` on `node_name`."""
        node = self._node(node_name)
        body = self.router.load_body(self.router.concrete(model))
        running = self._running("load", node.name, body["model_id"])
        if running is not None:
            return running
        job = Job("load", node.name, body["model_id"], started_at=time.time())

        async def run() -> None:
            status, answer = await self.router.nodes.load(node, body)
            if status == 200:
                self._finish(job, "done", "loaded")
            else:
                error = answer.get("error") or {}
                self._finish(job, "failed", error.get("message") or f"HTTP {status}")
            await self.router.nodes.refresh(node)

        return self._start(job, run())

    def unload(self, node_name: str, model_id: str) -> Job:
        node = self._node(node_name)
        running = self._running("unload", node.name, model_id)
        if running is not None:
            return running
        job = Job("unload", node.name, model_id, started_at=time.time())

        async def run() -> None:
            status = await self.router.nodes.unload(node, model_id)
            if status == 200:
                self._finish(job, "done", "unloaded")
            else:
                reason = "it is not loaded there" if status == 404 else f"HTTP {status}"
                self._finish(job, "failed", reason)
            await self.router.nodes.refresh(node)

        return self._start(job, run())

    def recent(self) -> list[Job]:
        """Running jobs and the last few finished ones, newest first."""
        cutoff = time.time() - KEEP_FINISHED_S
        self._jobs = [j for j in self._jobs if j.finished_at is None or j.finished_at > cutoff]
        return sorted(self._jobs, key=lambda j: -j.started_at)

    @property
    def any_running(self) -> bool:
        return any(j.state == "running" for j in self._jobs)

    def _node(self, name: str) -> NodeView:
        node = self.router.fleet.nodes.get(name)
        if node is None:
            raise ValueError(f"node: {name!r} is not a configured node")
        if not node.up:
            raise ValueError(f"node: {name} is down (the fleet page and the log say why)")
        return node

    def _running(self, action: str, node: str, model_id: str) -> Job | None:
        return next(
            (
                j
                for j in self._jobs
                if j.state == "running"
                and (j.action, j.node, j.model_id) == (action, node, model_id)
            ),
            None,
        )

    def _start(self, job: Job, work: Coroutine[Any, Any, None]) -> Job:
        async def guarded() -> None:
            try:
                await work
            except Exception:  # the job shows that it failed, the log why; we carry on
                log.exception("admin %s on %s failed", job.action, job.node)
                self._finish(job, "failed", "failed unexpectedly; the gateway's log says why")

        self._jobs.append(job)
        finished = [j for j in self._jobs if j.finished_at is not None]
        for old in sorted(finished, key=lambda j: j.started_at)[:-MAX_FINISHED]:
            self._jobs.remove(old)
        task = asyncio.create_task(guarded(), name=f"admin-{job.action}-{job.node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def _finish(self, job: Job, state: Literal["done", "failed"], message: str) -> None:
        if job.finished_at is not None:
            return
        job.state, job.message, job.finished_at = state, message, time.time()
        event(
            log,
            logging.INFO if state == "done" else logging.WARNING,
            f"admin {job.action} {state}",
            node=job.node,
            model=job.model_id,
            seconds=round(job.seconds, 1),
            **({"error": message} if state == "failed" else {}),
        )
