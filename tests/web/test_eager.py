"""`helexa.web.eager.eager_task`: a task whose first step runs in the caller's turn, with
a task's semantics (its current task, its own context, its result or error, cancellation
at any point), on the loops the servers run (uvloop) and on asyncio's own."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
import uvloop

from helexa.web.eager import eager_task

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def run(main):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(asyncio.wait_for(main(), 10))

    return run


def _from_a_callback(make):
    """`make()` run from a callback of the loop (where the lane calls `eager_task`), not
    from inside a task; its value once that callback has run."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_soon(lambda: done.set_result(make()))
    return done


def test_the_first_step_runs_before_it_returns_and_the_rest_in_the_task(run):
    async def main():
        loop = asyncio.get_running_loop()
        seen = []
        gate = loop.create_future()

        async def work():
            seen.append(("first", asyncio.current_task()))
            async with asyncio.timeout(5):  # needs a current task
                value = await gate
            seen.append(("rest", asyncio.current_task()))
            return value * 2

        def start():
            task = eager_task(loop, work())
            assert [s for s, _ in seen] == ["first"]  # ran before eager_task returned
            return task

        task = await _from_a_callback(start)
        assert seen[0][1] is task  # the task was current during the first step
        assert not task.done()
        gate.set_result(21)
        assert await task == 42
        assert seen[1] == ("rest", task)

    run(main)


def test_a_coroutine_that_ends_in_its_first_step_gives_its_result_or_error(run):
    async def main():
        loop = asyncio.get_running_loop()

        async def value():
            return "done"

        async def fails():
            raise ValueError("in the first step")

        task = await _from_a_callback(lambda: eager_task(loop, value()))
        assert await task == "done"
        task = await _from_a_callback(lambda: eager_task(loop, fails()))
        with pytest.raises(ValueError, match="first step"):
            await task

    run(main)


@pytest.mark.parametrize("when", ["before the task's first turn", "while it waits"])
def test_a_cancel_reaches_the_coroutine_where_it_waits(run, when):
    async def main():
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        cleaned = []

        async def work():
            try:
                await gate
            finally:
                cleaned.append(True)

        def start():
            task = eager_task(loop, work())
            if when == "before the task's first turn":
                task.cancel()  # in the same turn: the task has not stepped yet
            return task

        task = await _from_a_callback(start)
        if when == "while it waits":
            await asyncio.sleep(0)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled() and cleaned == [True]

    run(main)


def test_the_first_step_runs_in_the_tasks_own_context(run):
    async def main():
        loop = asyncio.get_running_loop()
        gate = loop.create_future()

        async def work():
            VAR.set("task's")
            await gate
            return VAR.get()

        task = await _from_a_callback(lambda: eager_task(loop, work()))
        assert VAR.get() == "unset"  # nothing leaked into the caller's context
        gate.set_result(None)
        assert await task == "task's"

    run(main)


def test_a_bare_yield_in_the_first_step_is_a_turn_of_the_loop(run):
    async def main():
        loop = asyncio.get_running_loop()
        order = []

        async def work():
            order.append("first")
            await asyncio.sleep(0)
            order.append("rest")

        task = await _from_a_callback(lambda: eager_task(loop, work()))
        assert order == ["first"]
        await task
        assert order == ["first", "rest"]

    run(main)
