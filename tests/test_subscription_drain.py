"""A subscription's reader takes what is already buffered at one wake.

trio's ``receive`` passes a schedule point for every item, so a reader keeping up with an
emitter cost the run loop a pass per event. A subscription hands out up to
``DRAIN_PER_WAKE`` buffered items with only the cancel check; order, losslessness, the end
of the channel and cancellation stay trio's. Each test shows where the reader lets another
task run, with a task started beside it.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import trio
import trio.testing

from agentloop import events as ev
from agentloop._bus import DRAIN_PER_WAKE, EventBus


def emitted(bus: EventBus, count: int) -> list[str]:
    ids = [f"a{i}" for i in range(count)]
    for agent_id in ids:
        bus.emit_nowait(ev.AgentCreated(agent_id))
    return ids


async def read_beside_another_task(rx: trio.MemoryReceiveChannel[object], count: int) -> list[str]:
    """Receive ``count`` items while another task waits to run; where it ran is ``"other"``."""
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        for _ in range(count):
            item = await rx.receive()
            assert isinstance(item, ev.AgentCreated)
            order.append(item.agent_id)
    return order


async def test_what_is_buffered_is_taken_without_a_schedule_point_per_item() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    ids = emitted(bus, 20)
    assert await read_beside_another_task(rx, 20) == [*ids, "other"]
    detach()


async def test_a_long_backlog_still_lets_other_tasks_run() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    ids = emitted(bus, 3 * DRAIN_PER_WAKE)
    order = await read_beside_another_task(rx, len(ids))
    # The reader passes a schedule point after each DRAIN_PER_WAKE items; trio runs the
    # tasks of one pass in either order, so the other task runs at one of those points.
    assert order.index("other") % (DRAIN_PER_WAKE + 1) == DRAIN_PER_WAKE
    assert order.index("other") < len(ids)
    assert [x for x in order if x != "other"] == ids
    detach()


async def test_async_for_wakes_once_for_a_burst_and_parks_when_empty() -> None:
    bus = EventBus()
    got: list[str] = []
    wakes: list[int] = []

    async def reader(rx: trio.MemoryReceiveChannel[object]) -> None:
        async for item in rx:
            assert isinstance(item, ev.AgentCreated)
            got.append(item.agent_id)

    async def witness() -> None:
        # Runs whenever the run loop makes a pass with the reader runnable too.
        while True:
            wakes.append(len(got))
            await trio.lowlevel.checkpoint()
            if len(got) == 10:
                return

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            rx, detach = bus.open_subscription(ev.AgentCreated)
            nursery.start_soon(reader, rx)
            await trio.testing.wait_all_tasks_blocked()
            ids = emitted(bus, 10)
            nursery.start_soon(witness)
            await trio.testing.wait_all_tasks_blocked()
            assert got == ids
            # The reader took the burst in one pass: the witness never saw it half read.
            assert all(n in (0, 10) for n in wakes), wakes
            detach()


async def test_a_cancelled_reader_raises_and_keeps_the_items() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    ids = emitted(bus, 3)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await rx.receive()
    got = [await rx.receive() for _ in ids]
    assert [e.agent_id for e in got if isinstance(e, ev.AgentCreated)] == ids
    detach()
    with pytest.raises(trio.EndOfChannel):
        await rx.receive()


async def test_a_clone_reads_the_same_buffer_in_order() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    ids = emitted(bus, 4)
    clone = rx.clone()
    first = await rx.receive()
    rest = [await clone.receive() for _ in range(3)]
    assert [e.agent_id for e in (first, *rest) if isinstance(e, ev.AgentCreated)] == ids
    detach()


async def test_a_dropped_subscription_is_freed_without_the_cycle_collector() -> None:
    bus = EventBus()
    rx, detach = bus.open_subscription(ev.AgentCreated)
    emitted(bus, 3)
    assert isinstance(await rx.receive(), ev.AgentCreated)
    detach()
    channel = weakref.ref(rx)
    gc.disable()
    try:
        del rx
        assert channel() is None  # freed by its reference count: its buffer goes with it
    finally:
        gc.enable()
