"""PostgreSQL store against the SQLite store: appends per second and flush latency.

Also measures the obvious alternative driver shape, one ``trio.to_thread.run_sync`` call per
event (psycopg's async API needs asyncio, so a trio program reaches psycopg through threads
either way), to show what batching on one worker thread buys.

Usage: ``python benchmarks/bench_postgres.py [DSN]``. Without a DSN it starts a throwaway
cluster (fsync on, 127.0.0.1 only) with the server binaries on PATH or under
/usr/lib/postgresql/*/bin, as the ``postgres`` user when run as root.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import trio
from agentloop_postgres import PostgresSessionStore
from agentloop_sqlite import SqliteSessionStore

from agentloop import FrozenDict, SessionEvent

APPENDS = 20_000
FLUSHES = 300


def _binary(name: str) -> str:
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    found = shutil.which(name) or (candidates[-1] if candidates else "")
    if not found:
        raise SystemExit(f"no {name}: install PostgreSQL or pass a DSN")
    return found


@contextmanager
def cluster() -> Iterator[str]:
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", user.pw_name, "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = base / "data"
    subprocess.run([*prefix, _binary("initdb"), "-D", str(data), "-U", "bench",
                    "--auth=trust", "-E", "UTF8"], check=True, capture_output=True)
    subprocess.run([*prefix, _binary("pg_ctl"), "-D", str(data), "-l", str(base / "log"), "-w",
                    "-o", f"-c listen_addresses=127.0.0.1 -p {port} -k {base}", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql://bench@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, _binary("pg_ctl"), "-D", str(data), "-m", "fast", "stop"],
                       capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)


def chunk(seq: int) -> SessionEvent:
    return SessionEvent(seq, "assistant/chunk", 1,
                        FrozenDict(step=1, kind="text", delta=f"token {seq} "))


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000


async def measure(name: str, store: PostgresSessionStore | SqliteSessionStore) -> None:
    sid = f"bench{time.time_ns()}"
    await store.create(sid, FrozenDict())
    await store.acquire(sid, "bench")
    start = time.perf_counter()
    for seq in range(1, APPENDS + 1):
        store.append(sid, chunk(seq))
    await store.flush(sid, APPENDS)
    rate = APPENDS / (time.perf_counter() - start)
    latencies = []
    for seq in range(APPENDS + 1, APPENDS + FLUSHES + 1):
        store.append(sid, chunk(seq))
        t = time.perf_counter()
        await store.flush(sid, seq)
        latencies.append(time.perf_counter() - t)
    print(f"{name:<34} {rate:>10,.0f} appends/s   flush p50 {pct(latencies, 0.5):6.2f} ms"
          f"   p99 {pct(latencies, 0.99):6.2f} ms")


async def per_event_threads(dsn: str) -> None:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("CREATE TABLE IF NOT EXISTS bench_naive (seq bigint, data text)")
    n = 2000
    start = time.perf_counter()
    for seq in range(n):
        await trio.to_thread.run_sync(
            conn.execute, "INSERT INTO bench_naive VALUES (%s, %s)", (seq, f"token {seq}")
        )
    rate = n / (time.perf_counter() - start)
    conn.close()
    print(f"{'postgres, one to_thread per event':<34} {rate:>10,.0f} appends/s"
          "   (each append is its own commit)")


async def main(dsn: str) -> None:
    async with PostgresSessionStore(dsn) as pg:
        await measure("postgres (batched, one thread)", pg)
    await per_event_threads(dsn)
    with tempfile.TemporaryDirectory() as tmp:
        async with SqliteSessionStore(os.path.join(tmp, "s.db")) as lite:
            await measure("sqlite (batched, one thread)", lite)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        trio.run(main, sys.argv[1])
    else:
        with cluster() as started:
            trio.run(main, started)
