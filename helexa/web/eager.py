"""`eager_task(loop, coro)`: a task whose first step runs at once, in the caller's turn of
the loop, instead of in the loop's next turn. This is what Python 3.12's eager tasks do
(`asyncio.Task(..., eager_start=True)`), and it is their code path there. On 3.11 the same
is done here: the task is made first (so that `asyncio.current_task()` is the task during
the step, as timeouts need), the coroutine's first step runs in the task's own context,
and the task then takes the coroutine over from where it waits (`_Rest`).

The gateway's lane starts each request this way: its first step (auth, body, routing, the
node's request written) runs in the same callback that read the request's last byte, so
the node is asked without waiting for another turn of the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def eager_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task for `coro` whose first step has already run (up to its first wait, or to its
    end). Call it from a callback of the loop, not from inside a task."""
    if sys.version_info >= (3, 12):  # pragma: no cover - the CI's Python is 3.11
        return asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
    rest = _Rest(coro)
    context = contextvars.copy_context()
    task: asyncio.Task[T] = loop.create_task(rest, context=context)  # type: ignore[arg-type]
    asyncio.tasks._enter_task(loop, task)
    try:
        rest.first = context.run(coro.send, None)
    except StopIteration as stop:
        rest.outcome = (stop.value, None)
    except BaseException as exc:  # the task raises it, as if the step had run there
        rest.outcome = (None, exc)
    finally:
        asyncio.tasks._leave_task(loop, task)
    return task


class _Rest(Coroutine[Any, Any, Any]):
    """A coroutine whose first step has run, as its task sees it: the task's first `send`
    gets back what the coroutine waits on (or its end), and every later `send` or `throw`
    (a cancellation included, even before that first send) goes to the coroutine."""

    __slots__ = ("coro", "first", "outcome", "started")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.first: Any = None  # what the first step yielded: a future, or None (a bare yield)
        self.outcome: tuple[Any, BaseException | None] | None = None  # the step ended it
        self.started = False

    def send(self, value: Any) -> Any:
        if self.started:
            return self.coro.send(value)
        self.started = True
        if self.outcome is not None:
            result, error = self.outcome
            self.outcome = None
            if error is not None:
                raise error
            raise StopIteration(result)
        return self.first

    def throw(self, exc: Any, *rest: Any) -> Any:
        self.started = True
        if self.outcome is not None:  # already over: nothing left to interrupt
            self.outcome = None
            raise exc
        return self.coro.throw(exc, *rest)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        raise TypeError("an eager task's coroutine is driven by its task alone")
