"""The floors: the same logical work with no agent runtime, on bare trio and on bare asyncio.

W1: per step, iterate an async generator of the chunks with one checkpoint each, append every
chunk to a list and await a trivial tool coroutine. W2: that loop, ``W2_STEPS`` steps long, in
each of ``CONCURRENT`` tasks of one nursery (trio) or one ``asyncio.gather`` (asyncio). W3: a
task parked on one of two memory channels (trio) or on one of two queues (asyncio), holding a
2-message list. W4: the W1 loop after appending the history to the list (nothing in it reads
the history, so it is flat).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import _common as c
import trio
import trio.testing


def w1_turn(sizes: c.Sizes, checkpoint: Callable[[], Awaitable[None]],
            history: int = 0, steps: int | None = None) -> c.Turn:
    steps = sizes.steps if steps is None else steps
    seeded = [c.history_text(i) for i in range(history)]

    async def tool() -> str:
        return "ok"

    async def chunks() -> AsyncIterator[str]:
        for piece in c.PIECES:
            await checkpoint()
            yield piece

    async def turn() -> None:
        log: list[Any] = list(seeded)
        for step in range(steps):
            async for chunk in chunks():
                log.append(chunk)  # noqa: PERF401 - one append per chunk, as a runtime does
            if step < steps - 1:
                log.append(await tool())

    return turn


async def asyncio_checkpoint() -> None:
    await asyncio.sleep(0)


async def trio_w2(sizes: c.Sizes) -> dict[str, Any]:
    turn = w1_turn(sizes, trio.lowlevel.checkpoint, steps=sizes.w2_steps)

    async def batch(n: int) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(turn)

    return await c.time_concurrent(batch, sizes)


async def asyncio_w2(sizes: c.Sizes) -> dict[str, Any]:
    turn = w1_turn(sizes, asyncio_checkpoint, steps=sizes.w2_steps)

    async def batch(n: int) -> None:
        await asyncio.gather(*(turn() for _ in range(n)))

    return await c.time_concurrent(batch, sizes)


async def trio_w3(sizes: c.Sizes) -> float:
    async def parked(rx: trio.MemoryReceiveChannel[object], convo: list[str]) -> None:
        await rx.receive()

    async with trio.open_nursery() as nursery:

        async def build() -> object:
            keep = []
            for _ in range(sizes.idle):
                turn_tx, turn_rx = trio.open_memory_channel[object](math.inf)
                step_tx, step_rx = trio.open_memory_channel[object](math.inf)
                convo = ["hello there", "hi, how can I help?"]
                keep.append((turn_tx, step_tx, step_rx))
                nursery.start_soon(parked, turn_rx, convo)
            return keep

        figure, _kept = await c.atraced_bytes_per(
            sizes.idle, build, trio.testing.wait_all_tasks_blocked
        )
        nursery.cancel_scope.cancel()
    return figure


async def asyncio_w3(sizes: c.Sizes) -> float:
    async def parked(q: asyncio.Queue[object], convo: list[str]) -> None:
        await q.get()

    tasks: list[asyncio.Task[None]] = []

    async def build() -> object:
        keep = []
        for _ in range(sizes.idle):
            turns: asyncio.Queue[object] = asyncio.Queue()
            steps: asyncio.Queue[object] = asyncio.Queue()
            convo = ["hello there", "hi, how can I help?"]
            keep.append((turns, steps))
            tasks.append(asyncio.create_task(parked(turns, convo)))
        return keep

    async def settle() -> None:
        for _ in range(3):
            await asyncio.sleep(0)

    figure, _kept = await c.atraced_bytes_per(sizes.idle, build, settle)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return figure


def main() -> None:
    entry, workload, sizes = c.parse_args(["trio", "asyncio"])
    if entry == "trio":
        run: Callable[..., Any] = trio.run
        checkpoint: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint
        w2: Callable[[c.Sizes], Awaitable[dict[str, Any]]] = trio_w2
        w3: Callable[[c.Sizes], Awaitable[float]] = trio_w3
    else:
        run, checkpoint, w2, w3 = asyncio.run, asyncio_checkpoint, asyncio_w2, asyncio_w3

    async def go() -> None:
        if workload == "w1":
            c.report(us_per_step=await c.time_turns(w1_turn(sizes, checkpoint), sizes))
        elif workload == "w2":
            c.report(**await w2(sizes))
        elif workload == "w3":
            c.report(bytes_per_agent=await w3(sizes))
        else:
            c.report(**await c.time_histories(
                lambda n: w1_turn(sizes, checkpoint, n), sizes))

    if entry == "trio":
        run(go)
    else:
        run(go())
    c.report(versions=c.versions("trio") if entry == "trio" else c.versions())


if __name__ == "__main__":
    main()
