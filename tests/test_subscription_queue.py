"""A subscription's items wait in its own queue; its trio channel object reads them.

The channel a subscriber holds is a ``trio.MemoryReceiveChannel`` whose reading methods
(``receive``, ``receive_nowait``, ``statistics``, ``clone``, ``close``) are the
subscription's: an item put is appended to the queue, and a reader parked in ``receive`` is
rescheduled. What trio's own channel promises still holds: order, no loss, no duplicate,
cancellation of a parked reader, the end after what was queued, the errors of a closed
channel, clones reading one queue. The property at the end drives a reader through random
interleavings of puts, reads, cancelled parks and clones against that list.
"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop import events as ev
from agentloop._bus import Disposer, EventBus


def emit(bus: EventBus, *ids: str) -> None:
    for agent_id in ids:
        bus.emit_nowait(ev.AgentCreated(agent_id))


def ids_of(items: list[object]) -> list[str]:
    return [e.agent_id for e in items if isinstance(e, ev.AgentCreated)]


def with_a_clone() -> tuple[
    EventBus, trio.MemoryReceiveChannel[object], trio.MemoryReceiveChannel[object], Disposer
]:
    """A bus, a subscription's channel and a clone of it, and the subscription's disposer."""
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    return bus, rx, rx.clone(), detach


async def test_a_reader_closing_its_channel_ends_the_subscription_at_once() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    assert bus.has_listeners(ev.AgentCreated)
    rx.close()
    # Not at the next emission: a closed reader's queue would otherwise keep what comes.
    assert not bus.has_listeners(ev.AgentCreated)
    with pytest.raises(trio.ClosedResourceError):
        rx.receive_nowait()
    with pytest.raises(trio.ClosedResourceError):
        await rx.receive()
    rx.close()  # idempotent, as trio's
    await rx.aclose()
    detach()


async def test_a_method_kept_from_before_the_close_reads_nothing_after_it() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    twin = rx.clone()
    receive, receive_nowait = rx.receive, rx.receive_nowait
    emit(bus, "a", "b")
    rx.close()
    with pytest.raises(trio.ClosedResourceError):
        receive_nowait()
    with pytest.raises(trio.ClosedResourceError):
        await receive()
    assert ids_of([twin.receive_nowait(), await twin.receive()]) == ["a", "b"]
    detach()


async def test_statistics_count_the_queue_and_the_parked_reader() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    emit(bus, "a", "b", "c")
    assert rx.statistics().current_buffer_used == 3
    assert ids_of([await rx.receive()]) == ["a"]
    assert rx.statistics().current_buffer_used == 2
    ids_of([rx.receive_nowait(), rx.receive_nowait()])
    got: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _append(got, rx))
        await trio.testing.wait_all_tasks_blocked()
        stats = rx.statistics()
        assert (stats.current_buffer_used, stats.tasks_waiting_receive) == (0, 1)
        emit(bus, "d")
    assert ids_of(got) == ["d"]
    assert rx.statistics().tasks_waiting_receive == 0
    detach()


async def _append(got: list[object], rx: trio.MemoryReceiveChannel[object]) -> None:
    got.append(await rx.receive())


async def test_a_reader_parked_when_the_subscription_ends_gets_the_end() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    outcome: list[object] = []

    async def reader() -> None:
        try:
            while True:
                outcome.append(await rx.receive())
        except trio.EndOfChannel:
            outcome.append("end")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            emit(bus, "a")
            detach()
            emit(bus, "after the end")  # nobody's: the subscription has ended
    assert ids_of(outcome) == ["a"] and outcome[-1] == "end"
    with pytest.raises(trio.EndOfChannel):
        rx.receive_nowait()


async def test_a_reader_parked_in_a_closed_clone_gets_closed_resource_error() -> None:
    bus, rx, twin, detach = with_a_clone()
    seen: dict[str, object] = {}

    async def park(name: str, channel: trio.MemoryReceiveChannel[object]) -> None:
        try:
            seen[name] = await channel.receive()
        except trio.ClosedResourceError as exc:
            seen[name] = exc

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(park, "rx", rx)
            nursery.start_soon(park, "twin", twin)
            await trio.testing.wait_all_tasks_blocked()
            rx.close()
            await trio.testing.wait_all_tasks_blocked()
            assert isinstance(seen.get("rx"), trio.ClosedResourceError)
            assert "twin" not in seen  # the clone's reader still waits, and is still fed
            assert bus.has_listeners(ev.AgentCreated)
            emit(bus, "a")
    assert ids_of([seen["twin"]]) == ["a"]
    twin.close()
    assert not bus.has_listeners(ev.AgentCreated)  # the last reader's close ends it
    detach()


async def test_a_cancelled_park_loses_no_item_and_leaves_no_stray_wake() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            cancel_scope = trio.CancelScope()

            async def parked() -> None:
                with cancel_scope:
                    await rx.receive()
                    raise AssertionError("nothing was put")

            nursery.start_soon(parked)
            await trio.testing.wait_all_tasks_blocked()
            cancel_scope.cancel()
            emit(bus, "a")  # in the same pass as the cancel: nobody may take it but the next read
        assert ids_of([await rx.receive()]) == ["a"]
        got: list[object] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_append, got, rx)
            await trio.testing.wait_all_tasks_blocked()
            emit(bus, "b")
        assert ids_of(got) == ["b"]
    detach()


async def test_durable_events_queued_before_a_reader_closes_go_with_the_queue() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated, capacity=math.inf)
    emit(bus, *[f"a{i}" for i in range(5)])
    assert rx.statistics().current_buffer_used == 5
    rx.close()
    emit(bus, "later")  # not queued for anyone: the subscription ended with the close
    detach()


# --- the property ---------------------------------------------------------------------------

Op = tuple[str, int]
# Each operation with a small count: how many to put or read, or to put as a park is cancelled.
KINDS = ("put", "read", "read_nowait", "park_then_put", "cancel_park", "clone_read")
OPS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 5)), max_size=25)


@settings(max_examples=examples(4))
@given(ops=OPS)
async def test_any_interleaving_reads_every_item_once_in_order(ops: list[Op]) -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated, capacity=math.inf)
    put: list[str] = []
    got: list[object] = []

    def put_some(count: int) -> None:
        for _ in range(count):
            put.append(f"a{len(put)}")
            emit(bus, put[-1])

    def queued() -> int:
        return len(put) - len(ids_of(got))

    with trio.fail_after(10):
        for op, n in ops:
            if op == "put":
                put_some(n)
            elif op == "read":
                for _ in range(min(n, queued())):
                    got.append(await rx.receive())
            elif op == "read_nowait":
                for _ in range(n):
                    try:
                        got.append(rx.receive_nowait())
                    except trio.WouldBlock:
                        break
            elif op == "park_then_put":
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_append, got, rx)
                    await trio.testing.wait_all_tasks_blocked()
                    if queued() == 0:
                        put_some(max(n, 1))  # the parked reader takes one
            elif op == "cancel_park":
                async with trio.open_nursery() as nursery:
                    scope = trio.CancelScope()

                    async def park(scope: trio.CancelScope = scope) -> None:
                        with scope:
                            got.append(await rx.receive())

                    nursery.start_soon(park)
                    await trio.testing.wait_all_tasks_blocked()
                    scope.cancel()
                    put_some(n)  # races the cancel: taken by the park or left queued
            else:
                twin = rx.clone()
                for _ in range(min(n, queued())):
                    got.append(await twin.receive())
                await twin.aclose()
                assert bus.has_listeners(ev.AgentCreated)
        assert ids_of(got) == put[: len(got)]  # in order, none twice
        detach()
        rest: list[object] = []
        async for item in rx:
            rest.append(item)
    assert ids_of(got + rest) == put  # none lost, and then the end


# --- as trio's channel does it --------------------------------------------------------------


async def test_the_reader_parked_longest_gets_the_first_item() -> None:
    bus, rx, twin, detach = with_a_clone()
    got: dict[str, object] = {}

    async def park(name: str, channel: trio.MemoryReceiveChannel[object]) -> None:
        got[name] = await channel.receive()

    for _ in range(20):  # trio runs a batch in either order: the hand-over must not depend on it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(park, "first", rx)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(park, "second", twin)
            await trio.testing.wait_all_tasks_blocked()
            emit(bus, "a", "b")
        assert ids_of([got["first"], got["second"]]) == ["a", "b"]
    detach()


async def test_an_item_handed_to_a_parked_reader_is_its_own_whatever_comes_next() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    got: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_append, got, rx)
        await trio.testing.wait_all_tasks_blocked()
        emit(bus, "a")
        rx.close()  # before the reader runs: the item was already its
    assert ids_of(got) == ["a"]
    detach()


async def test_a_clone_made_after_the_end_still_reads_what_was_queued() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    emit(bus, "a", "b")
    detach()
    twin = rx.clone()
    assert ids_of([await twin.receive(), await rx.receive()]) == ["a", "b"]
    with pytest.raises(trio.EndOfChannel):
        await twin.receive()


async def test_statistics_say_the_channel_is_unbounded_and_its_peak_covers_the_queue() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    emit(bus, "a", "b", "c")
    stats = rx.statistics()
    assert stats.max_buffer_size == math.inf
    assert stats.current_buffer_used == 3
    assert getattr(stats, "peak_buffer_used", 3) >= 3
    detach()


def test_subscribing_to_the_base_event_class_still_gives_a_channel() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.Event)  # the base class: nothing is ever emitted as it
    assert rx.statistics().current_buffer_used == 0
    detach()
