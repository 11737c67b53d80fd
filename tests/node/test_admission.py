"""Admission on a real event loop: slots, the queue and its fair shares, its limits, and the
per-key cap.

Each test runs its own loop with `asyncio.run`. Assertions are on the counters
(`num_running`, `queue_depth`, `held_by`), never on how long something took; a wait is
made to elapse (max_wait_s=0.05) only where that is the behaviour under test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from helexa.errors import HelexaError
from helexa.node.admission import Admission, AdmissionLimits, Permit

LONG_WAIT_S = 30.0  # a wait no test sits through: reaching it would hang the test


def admission(
    max_running: int = 1,
    max_waiting: int = 8,
    max_wait_s: float = LONG_WAIT_S,
    per_principal_max: int = 0,
) -> Admission:
    return Admission(AdmissionLimits(max_running, max_waiting, max_wait_s, per_principal_max))


def without_waiting(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` one step: it must finish (return or raise) without ever suspending."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the coroutine suspended: it waited instead of answering at once")


async def settle() -> None:
    """Let every ready callback and task run (handovers go through a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


def queued(adm: Admission, principal: str | None = None) -> asyncio.Task[Permit]:
    return asyncio.create_task(adm.acquire(principal))


def assert_rate_limited(err: HelexaError, status: int) -> None:
    assert err.status == status, err
    assert err.code == "rate_limit_exceeded", err
    assert err.type == "rate_limit_error", err
    retry_after = err.headers()["Retry-After"]
    assert retry_after.isdigit() and int(retry_after) >= 1, retry_after
    assert err.to_envelope()["error"]["message"]


# -- running and queueing ---------------------------------------------------------------------


def test_requests_up_to_max_running_are_admitted_at_once():
    async def scenario() -> None:
        adm = admission(max_running=3)
        permits = [without_waiting(adm.acquire()) for _ in range(3)]
        assert all(isinstance(p, Permit) for p in permits)
        assert (adm.num_running, adm.queue_depth) == (3, 0)
        for p in permits:
            p.release()
        assert (adm.num_running, adm.queue_depth) == (0, 0)

    asyncio.run(scenario())


def test_requests_beyond_max_running_queue_and_are_admitted_in_arrival_order():
    async def scenario() -> None:
        adm = admission(max_running=1)
        first = await adm.acquire()
        admitted: list[str] = []
        permits: dict[str, Permit] = {}

        async def request(name: str) -> None:
            permits[name] = await adm.acquire()
            admitted.append(name)

        tasks = []
        for name in "abc":
            tasks.append(asyncio.create_task(request(name)))
            await settle()  # arrival order is a, b, c
        assert (adm.num_running, adm.queue_depth) == (1, 3)
        assert admitted == []

        first.release()
        await settle()
        assert admitted == ["a"]
        assert (adm.num_running, adm.queue_depth) == (1, 2)
        permits["a"].release()
        await settle()
        assert admitted == ["a", "b"]
        permits["b"].release()
        await settle()
        assert admitted == ["a", "b", "c"]
        assert (adm.num_running, adm.queue_depth) == (1, 0)
        permits["c"].release()
        await asyncio.gather(*tasks)
        assert (adm.num_running, adm.queue_depth) == (0, 0)

    asyncio.run(scenario())


def test_a_newcomer_cannot_overtake_a_waiter_that_was_handed_a_slot():
    async def scenario() -> None:
        adm = admission(max_running=1)
        first = await adm.acquire()
        waiter = queued(adm)
        await settle()
        first.release()  # handed to `waiter`, which has not run yet
        late = queued(adm)
        await settle()
        assert waiter.done() and not late.done()
        assert (adm.num_running, adm.queue_depth) == (1, 1)
        waiter.result().release()
        (await late).release()
        assert (adm.num_running, adm.queue_depth) == (0, 0)

    asyncio.run(scenario())


def test_leaving_the_async_with_block_releases_the_permit():
    async def scenario() -> None:
        adm = admission(max_running=1)
        async with await adm.acquire():
            assert adm.num_running == 1
        assert adm.num_running == 0

    asyncio.run(scenario())


# -- a full queue and an elapsed wait ---------------------------------------------------------


def test_a_full_queue_answers_503_rate_limit_exceeded_with_retry_after_at_once():
    async def scenario() -> None:
        adm = admission(max_running=1, max_waiting=2)
        held = await adm.acquire()
        waiters = [queued(adm), queued(adm)]
        await settle()
        assert (adm.num_running, adm.queue_depth) == (1, 2)

        with pytest.raises(HelexaError) as checked:
            adm.check()
        assert_rate_limited(checked.value, 503)
        with pytest.raises(HelexaError) as acquired:
            without_waiting(adm.acquire())  # raises on its first step: no wait for a slot
        assert_rate_limited(acquired.value, 503)
        assert (adm.num_running, adm.queue_depth) == (1, 2)  # the refusal left no trace

        held.release()
        for w in waiters:
            (await w).release()
        assert (adm.num_running, adm.queue_depth) == (0, 0)

    asyncio.run(scenario())


def test_max_waiting_zero_means_no_queue_and_503_once_running_is_full():
    async def scenario() -> None:
        adm = admission(max_running=2, max_waiting=0)
        held = [without_waiting(adm.acquire()) for _ in range(2)]
        with pytest.raises(HelexaError) as checked:
            adm.check()
        assert_rate_limited(checked.value, 503)
        with pytest.raises(HelexaError) as acquired:
            without_waiting(adm.acquire())
        assert_rate_limited(acquired.value, 503)
        assert (adm.num_running, adm.queue_depth) == (2, 0)
        held[0].release()
        without_waiting(adm.acquire()).release()  # a free slot is taken without queueing
        held[1].release()
        assert adm.num_running == 0

    asyncio.run(scenario())


def test_a_queued_request_whose_wait_elapses_gets_503_and_leaves_the_queue():
    async def scenario() -> None:
        adm = admission(max_running=1, max_wait_s=0.05)
        held = await adm.acquire()
        with pytest.raises(HelexaError) as timed_out:
            await adm.acquire("alice")
        assert_rate_limited(timed_out.value, 503)
        assert "0.05s" in timed_out.value.message
        assert (adm.num_running, adm.queue_depth) == (1, 0)
        assert adm.held_by("alice") == 0
        held.release()
        assert adm.num_running == 0

    asyncio.run(scenario())


# -- clients that go away, and races with the handover ----------------------------------------


def test_a_cancelled_waiter_leaves_the_queue_without_taking_a_slot():
    async def scenario() -> None:
        adm = admission(max_running=1)
        held = await adm.acquire()
        gone = queued(adm, "alice")
        behind = queued(adm, "bob")
        await settle()
        assert adm.queue_depth == 2

        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert (adm.num_running, adm.queue_depth) == (1, 1)
        assert adm.held_by("alice") == 0

        held.release()  # goes to bob, not to the cancelled waiter
        permit = await behind
        assert (adm.num_running, adm.queue_depth) == (1, 0)
        permit.release()
        assert adm.num_running == 0
        without_waiting(adm.acquire()).release()  # the slot is really free
        assert adm.num_running == 0

    asyncio.run(scenario())


def test_a_slot_handed_to_a_waiter_cancelled_in_the_same_instant_is_passed_on():
    async def scenario() -> None:
        adm = admission(max_running=1)
        held = await adm.acquire()
        gone = queued(adm, "alice")
        behind = queued(adm, "bob")
        await settle()

        gone.cancel()
        held.release()  # the slot reaches alice's waiter before she sees her cancellation
        outcome = (await asyncio.gather(gone, return_exceptions=True))[0]
        if isinstance(outcome, Permit):  # she kept it: then it is hers to release
            assert (adm.num_running, adm.queue_depth) == (1, 1)
            outcome.release()
        else:
            assert isinstance(outcome, asyncio.CancelledError), outcome
        assert adm.held_by("alice") == 0
        # Either way the slot ends with bob (the timeout only guards against a hang).
        permit = await asyncio.wait_for(behind, 5)
        assert (adm.num_running, adm.queue_depth, adm.held_by("bob")) == (1, 0, 1)
        permit.release()
        assert (adm.num_running, adm.queue_depth, adm.held_by("bob")) == (0, 0, 0)

    asyncio.run(scenario())


def test_a_slot_released_as_a_waiter_times_out_is_passed_on_never_lost():
    async def scenario() -> None:
        adm = admission(max_running=1, max_wait_s=0.05)
        held = await adm.acquire()
        timing_out = queued(adm, "alice")
        await settle()  # alice waits at most 0.05s; bob, queued next, waits long
        adm.limits = dataclasses.replace(adm.limits, max_wait_s=LONG_WAIT_S)
        behind = queued(adm, "bob")
        await settle()
        asyncio.get_running_loop().call_later(0.06, held.release)
        time.sleep(0.2)  # block the loop: alice's timeout and the release fire in one turn
        outcome = (await asyncio.gather(timing_out, return_exceptions=True))[0]
        if isinstance(outcome, Permit):  # the handover won: alice runs, bob still waits
            assert (adm.num_running, adm.queue_depth) == (1, 1)
            outcome.release()
        else:
            assert isinstance(outcome, HelexaError), outcome
            assert_rate_limited(outcome, 503)
        assert adm.held_by("alice") == 0
        # The slot alice was handed went on to bob instead of vanishing.
        permit = await asyncio.wait_for(behind, 5)
        assert (adm.num_running, adm.queue_depth) == (1, 0)
        permit.release()
        assert (adm.num_running, adm.queue_depth) == (0, 0)
        without_waiting(adm.acquire()).release()

    asyncio.run(scenario())


# -- per-principal caps -----------------------------------------------------------------------


def test_a_principal_over_its_cap_gets_429_while_another_is_still_admitted():
    async def scenario() -> None:
        adm = admission(max_running=8, per_principal_max=2)
        alices = [without_waiting(adm.acquire("alice")) for _ in range(2)]
        assert adm.held_by("alice") == 2
        with pytest.raises(HelexaError) as capped:
            without_waiting(adm.acquire("alice"))
        assert_rate_limited(capped.value, 429)
        with pytest.raises(HelexaError):
            adm.check("alice")
        bob = without_waiting(adm.acquire("bob"))
        assert (adm.held_by("alice"), adm.held_by("bob"), adm.num_running) == (2, 1, 3)
        alices[0].release()
        without_waiting(adm.acquire("alice")).release()  # back under the cap
        for p in (alices[1], bob):
            p.release()
        assert (adm.num_running, adm.held_by("alice"), adm.held_by("bob")) == (0, 0, 0)

    asyncio.run(scenario())


def test_queued_requests_count_toward_the_principal_cap():
    async def scenario() -> None:
        adm = admission(max_running=1, per_principal_max=2)
        running = await adm.acquire("alice")
        waiting = queued(adm, "alice")
        await settle()
        assert (adm.held_by("alice"), adm.queue_depth) == (2, 1)
        with pytest.raises(HelexaError) as capped:
            without_waiting(adm.acquire("alice"))
        assert_rate_limited(capped.value, 429)
        running.release()
        (await waiting).release()
        assert (adm.num_running, adm.held_by("alice")) == (0, 0)

    asyncio.run(scenario())


def test_direct_callers_named_by_their_address_are_never_capped():
    async def scenario() -> None:
        adm = admission(max_running=5, per_principal_max=1)
        permits = [without_waiting(adm.acquire("client:10.0.0.9")) for _ in range(5)]
        assert (adm.num_running, adm.held_by("client:10.0.0.9")) == (5, 5)
        for p in permits:
            p.release()
        assert adm.num_running == 0

    asyncio.run(scenario())


def test_anonymous_requests_are_never_capped():
    async def scenario() -> None:
        adm = admission(max_running=5, per_principal_max=1)
        permits = [without_waiting(adm.acquire(None)) for _ in range(5)]
        assert adm.num_running == 5
        adm.check(None)
        for p in permits:
            p.release()
        assert adm.num_running == 0

    asyncio.run(scenario())


def test_per_principal_max_zero_disables_the_cap():
    async def scenario() -> None:
        adm = admission(max_running=5, per_principal_max=0)
        permits = [without_waiting(adm.acquire("alice")) for _ in range(5)]
        assert (adm.num_running, adm.held_by("alice")) == (5, 5)
        for p in permits:
            p.release()
        assert (adm.num_running, adm.held_by("alice")) == (0, 0)

    asyncio.run(scenario())


# -- releasing --------------------------------------------------------------------------------


def test_releasing_a_permit_twice_frees_one_slot_only():
    async def scenario() -> None:
        adm = admission(max_running=1, per_principal_max=3)
        held = await adm.acquire("alice")
        first, second = queued(adm, "alice"), queued(adm, "alice")
        await settle()
        held.release()
        held.release()
        await settle()
        assert first.done() and not second.done()
        assert (adm.num_running, adm.queue_depth, adm.held_by("alice")) == (1, 1, 2)
        first.result().release()
        permit = await second
        permit.release()
        permit.release()
        assert (adm.num_running, adm.queue_depth, adm.held_by("alice")) == (0, 0, 0)

    asyncio.run(scenario())


# -- fair shares ------------------------------------------------------------------------------


def test_a_freed_slot_goes_to_the_waiting_lane_with_the_fewest_running():
    async def scenario() -> None:
        adm = admission(max_running=2, max_waiting=64)
        alice_running = [await adm.acquire("alice") for _ in range(2)]
        alice_queued = [queued(adm, "alice") for _ in range(8)]
        await settle()
        bob = queued(adm, "bob")  # behind eight of alice's
        await settle()
        assert (adm.queue_depth, adm.held_by("alice"), adm.held_by("bob")) == (9, 10, 1)

        alice_running[0].release()  # alice runs 1, bob 0: bob's turn, not alice's next
        await settle()
        assert bob.done() and not any(t.done() for t in alice_queued)
        alice_running[1].release()  # alice 0 running, bob 1: alice's oldest
        await settle()
        assert alice_queued[0].done() and not any(t.done() for t in alice_queued[1:])
        (await bob).release()  # bob has nothing waiting: alice's next, in arrival order
        await settle()
        assert alice_queued[1].done() and not any(t.done() for t in alice_queued[2:])
        for t in alice_queued:
            (await t).release()
        assert (adm.num_running, adm.queue_depth, adm.held_by("alice")) == (0, 0, 0)

    asyncio.run(scenario())


def test_lanes_that_run_equally_many_are_served_oldest_waiter_first():
    async def scenario() -> None:
        adm = admission(max_running=1, max_waiting=8)
        held = await adm.acquire(None)
        order: list[str] = []

        async def request(principal: str) -> None:
            permit = await adm.acquire(principal)
            order.append(principal)
            await settle()
            permit.release()

        tasks = []
        for p in ("carol", "alice", "bob"):
            tasks.append(asyncio.create_task(request(p)))
            await settle()
        held.release()
        await asyncio.gather(*tasks)
        assert order == ["carol", "alice", "bob"]

    asyncio.run(scenario())


def test_a_full_queue_makes_room_for_a_lighter_lane_by_refusing_the_heaviests_newest():
    async def scenario() -> None:
        adm = admission(max_running=1, max_waiting=3)
        running = await adm.acquire("alice")
        alices = [queued(adm, "alice") for _ in range(3)]
        await settle()
        assert adm.queue_depth == 3

        bob = queued(adm, "bob")  # the queue is full, but alice holds 4 against bob's 0
        await settle()
        with pytest.raises(HelexaError) as pushed:
            await alices[2]  # alice's newest waiter makes room
        assert_rate_limited(pushed.value, 503)
        assert not bob.done() and not alices[0].done() and not alices[1].done()
        assert (adm.queue_depth, adm.held_by("alice"), adm.held_by("bob")) == (3, 3, 1)

        carol = queued(adm, "carol")  # alice 3 against carol's 0: alice's newest again
        await settle()
        with pytest.raises(HelexaError):
            await alices[1]
        dave = queued(adm, "dave")  # alice 2 against dave's 0: her last waiter goes too
        await settle()
        with pytest.raises(HelexaError):
            await alices[0]
        # alice 1 (running), bob, carol and dave 1 each (queued): a fifth lane gains nothing
        # by pushing out another, so it is the one refused
        with pytest.raises(HelexaError) as full:
            without_waiting(adm.acquire("erin"))
        assert_rate_limited(full.value, 503)
        with pytest.raises(HelexaError):
            adm.check("erin")
        assert (adm.queue_depth, adm.held_by("erin"), adm.held_by("alice")) == (3, 0, 1)

        running.release()  # bob, carol and dave run 0 each: the oldest waiter, bob's
        await settle()
        assert bob.done() and not carol.done() and not dave.done()
        for t in (bob, carol, dave):
            (await t).release()
        assert (adm.num_running, adm.queue_depth) == (0, 0)
        assert [adm.held_by(p) for p in ("alice", "bob", "carol", "dave")] == [0, 0, 0, 0]

    asyncio.run(scenario())


def test_a_lane_never_pushes_out_its_own_waiters_or_a_lane_as_light_as_itself():
    async def scenario() -> None:
        adm = admission(max_running=1, max_waiting=2)
        running = await adm.acquire("alice")
        waiting = [queued(adm, "bob"), queued(adm, "carol")]
        await settle()
        for principal in ("bob", "dave"):  # bob would push out its own; dave would tie
            with pytest.raises(HelexaError):
                without_waiting(adm.acquire(principal))
        assert not any(t.done() for t in waiting)
        running.release()
        for t in waiting:
            (await t).release()
        assert (adm.num_running, adm.queue_depth) == (0, 0)

    asyncio.run(scenario())
