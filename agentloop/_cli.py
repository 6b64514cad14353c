"""The ``agentloop`` command line: ``run`` one prompt, ``chat``, and read stored ``sessions``.

Model text streams to stdout as it arrives; reasoning, tool activity, notes and errors go to
stderr, so ``agentloop run "..." > answer.txt`` captures only the answer. Every expected failure
is one line on stderr and a non-zero exit status; no tracebacks unless ``--verbose``.

The provider is chosen by ``--provider``/``--model``, else by the config file (its first agent,
else its first provider), else by an API key in the environment (``OPENAI_API_KEY``,
``DEEPSEEK_API_KEY``, ``ANTHROPIC_API_KEY``), else the packaged local model (the ``local`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, TextIO

import attrs
import trio

# The command line is the top layer: it uses only what any program embedding agentloop can.
from agentloop import (
    Agent,
    AgentLoopError,
    AgentOptions,
    Config,
    ConfigError,
    Context,
    InvalidContent,
    PersistenceError,
    SessionEvent,
    SessionNotFound,
    content_text,
    load_config,
    open_runtime,
)
from agentloop.events import PluginFailed, SessionEventAppended

__all__ = ["main", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED"]

PROG: Final = "agentloop"
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130

_LOCAL_HINT: Final = "pip install -e '.[local]'"


class CliError(Exception):
    """An expected failure: reported as one line, exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# --- providers ------------------------------------------------------------------------------


@attrs.frozen
class EnvProvider:
    """A provider that needs only an API key in the environment.

    ``<NAME>_BASE_URL`` (``OPENAI_BASE_URL``, ...) overrides the endpoint, for proxies and
    compatible servers.
    """

    name: str
    key_var: str
    kind: Literal["openai", "anthropic"]
    base_url: str
    model: str

    def endpoint(self, environ: Mapping[str, str]) -> str:
        """The base URL to call: the override variable's value, else the public API."""
        return environ.get(f"{self.name.upper()}_BASE_URL") or self.base_url


ENV_PROVIDERS: Final = (
    EnvProvider("openai", "OPENAI_API_KEY", "openai", "https://api.openai.com/v1", "gpt-4o-mini"),
    EnvProvider(
        "deepseek", "DEEPSEEK_API_KEY", "openai", "https://api.deepseek.com/v1", "deepseek-chat"
    ),
    EnvProvider(
        "anthropic", "ANTHROPIC_API_KEY", "anthropic", "https://api.anthropic.com/v1",
        "claude-3-5-haiku-latest",
    ),
)


@attrs.frozen(kw_only=True)
class Route:
    """Where model calls go: a provider name, a model, and what makes the provider exist."""

    provider: str
    model: str
    source: Literal["config", "env", "local"]
    env: EnvProvider | None = None
    max_tokens: int | None = None
    reasoning_effort: str | None = None


def _local_module() -> Any:
    try:
        import agentloop_local
    except ImportError:
        return None
    return agentloop_local


def _local_route(model: str | None) -> Route:
    local = _local_module()
    missing = ["agentloop_local"] if local is None else local.missing_requirements()
    if missing:
        raise CliError(
            f"the local model is not installed (missing {', '.join(missing)}); install it with "
            f"{_LOCAL_HINT}, or set OPENAI_API_KEY, DEEPSEEK_API_KEY or ANTHROPIC_API_KEY",
            EXIT_USAGE,
        )
    return Route(provider=local.PROVIDER, model=model or local.MODEL_NAME, source="local")


def _named_route(
    name: str, model: str | None, config: Config, environ: Mapping[str, str]
) -> Route:
    """The route for a provider named by a flag or by a configured agent."""
    if name in config.providers:
        chosen = model or config.providers[name].model
        if not chosen:
            raise CliError(f"provider {name!r} has no model in the config; pass --model")
        return Route(provider=name, model=chosen, source="config")
    if name == "local":
        return _local_route(model)
    for env in ENV_PROVIDERS:
        if env.name == name:
            if not environ.get(env.key_var):
                raise CliError(f"provider {name!r} needs {env.key_var} in the environment")
            return Route(provider=name, model=model or env.model, source="env", env=env)
    known = sorted({*config.providers, "local", *(e.name for e in ENV_PROVIDERS)})
    raise CliError(f"unknown provider {name!r} (known: {', '.join(known)})", EXIT_USAGE)


def choose_route(
    provider: str | None, model: str | None, config: Config, environ: Mapping[str, str]
) -> Route:
    """Flags, else the config's first agent or provider, else an env API key, else local."""
    if provider:
        return _named_route(provider, model, config, environ)
    for agent in config.agents:
        if agent.provider:
            route = _named_route(agent.provider, model or agent.model, config, environ)
            return attrs.evolve(
                route, max_tokens=agent.max_tokens, reasoning_effort=agent.reasoning_effort
            )
    if config.providers:
        return _named_route(next(iter(config.providers)), model, config, environ)
    for env in ENV_PROVIDERS:
        if environ.get(env.key_var):
            return Route(provider=env.name, model=model or env.model, source="env", env=env)
    return _local_route(model)


def _register_env_provider(rt: Context, env: EnvProvider, environ: Mapping[str, str]) -> None:
    from agentloop.llm import AnthropicAdapter, OpenAIChatAdapter

    key = environ[env.key_var]
    cls = OpenAIChatAdapter if env.kind == "openai" else AnthropicAdapter
    rt.llm.register(env.name, cls(env.endpoint(environ), api_key=key))


# --- the plan of one run/chat ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Plan:
    """Everything decided before the runtime opens."""

    config: Config
    route: Route
    db: str | None
    session: str | None
    resume: str | None
    options: AgentOptions
    load_local: bool


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _default_db() -> str:
    from agentloop_sqlite import default_path

    return default_path()


def make_plan(args: argparse.Namespace, environ: Mapping[str, str]) -> Plan:
    """Read the config and choose provider, persistence and session (no I/O beyond the config)."""
    config = load_config(args.config) if args.config else Config()
    route = choose_route(args.provider, args.model, config, environ)
    db: str | None = None
    if not args.no_persist:
        if args.db:
            db = os.path.expanduser(args.db)
        elif config.persistence is not None:
            db = os.path.expanduser(config.persistence.path)
        else:
            db = _default_db()
    local_names = ("local", "agentloop_local")
    configured_local = any(p in local_names for p in config.plugins)
    plugins = tuple(p for p in config.plugins if p not in ("sqlite", "agentloop_sqlite"))
    # The command line owns the agent and the store; configured agents would start sessions
    # of their own, so they only lend their provider and options.
    config = attrs.evolve(config, agents=(), persistence=None, plugins=plugins)
    options = AgentOptions(
        provider=route.provider,
        model=route.model,
        max_tokens=args.max_tokens or route.max_tokens,
        reasoning_effort=route.reasoning_effort,
    )
    return Plan(
        config=config,
        route=route,
        db=db,
        session=args.session,
        resume=args.resume,
        options=options,
        load_local=route.source == "local" and not configured_local,
    )


# --- output ---------------------------------------------------------------------------------


def _one_line(text: object, limit: int = 400) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _json_text(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def describe_error(error: object) -> str:
    """One line from a ``turn/end`` error object."""
    if not isinstance(error, Mapping):
        return "the turn failed"
    message = error.get("message") or error.get("type") or "the turn failed"
    details = []
    if error.get("status") is not None:
        details.append(f"HTTP {error['status']}")
    if error.get("code"):
        details.append(str(error["code"]))
    suffix = f" ({', '.join(details)})" if details else ""
    return _one_line(f"{message}{suffix}")


class Printer:
    """Writes one session's events as they are appended (a synchronous, non-raising observer)."""

    def __init__(self, session_id: str, out: TextIO, err: TextIO) -> None:
        self.session_id = session_id
        self.out = out
        self.err = err
        self.color = _isatty(err) and not os.environ.get("NO_COLOR")
        self.turn_end: SessionEvent | None = None
        self.broken = False
        self._text_open = False
        self._reasoning_open = False

    def __call__(self, event: SessionEventAppended) -> None:
        if event.session_id != self.session_id:
            return
        try:
            self._show(event.event)
        except OSError:
            # A closed stdout (``| head``) must not fail the agent's turn.
            self.broken = True
        except Exception:
            logging.getLogger("agentloop").exception("the output printer failed")

    def _show(self, e: SessionEvent) -> None:
        data = e.data
        if e.type == "assistant/chunk":
            if data["kind"] == "text":
                self._end_reasoning()
                self._write(self.out, data["delta"])
                self._text_open = not data["delta"].endswith("\n")
            elif data["kind"] == "reasoning":
                self._reasoning_open = True
                self._write(self.err, self._dim(data["delta"]))
        elif e.type == "tool/call":
            args = data["arguments"]
            shown = args if isinstance(args, str) else _json_text(args)
            self.note(f"[tool] {data['name']} {_one_line(shown, 200)}")
        elif e.type == "tool/result":
            if data.get("is_error"):
                outcome = f"error: {_one_line(content_text(data['content']), 200)}"
            else:
                outcome = "ok"
            self.note(f"[tool] {data['name']} -> {outcome}")
        elif e.type == "turn/end":
            self.turn_end = e
            self._end_reasoning()
            if self._text_open:
                self._write(self.out, "\n")
                self._text_open = False
            if data["reason"] == "max-tokens":
                self.note("[stopped at the max-tokens limit]")

    def _dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.color else text

    def _end_reasoning(self) -> None:
        if self._reasoning_open:
            self._reasoning_open = False
            self._write(self.err, "\n")

    def _write(self, stream: TextIO, text: str) -> None:
        if self.broken and stream is self.out:
            return
        stream.write(text)
        stream.flush()

    def note(self, line: str) -> None:
        """A status line on stderr, starting on a fresh line of the terminal."""
        self._end_reasoning()
        if self._text_open and _isatty(self.out) and not self.broken:
            self._write(self.out, "\n")
            self._text_open = False
        self._write(self.err, self._dim(line) + "\n")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _fail(err: TextIO, message: str) -> None:
    err.write(f"{PROG}: error: {_one_line(message, 1000)}\n")
    err.flush()


# --- Ctrl-C ---------------------------------------------------------------------------------


@attrs.define
class _Interrupts:
    """The first Ctrl-C cancels the running turn; one with no turn running ends the command."""

    scope: trio.CancelScope
    agent: Agent | None = None
    seen: bool = False

    def interrupt(self) -> None:
        self.seen = True
        agent = self.agent
        if agent is not None and agent.status == "running" and agent.cancel("user"):
            return
        self.scope.cancel()

    async def watch(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                self.interrupt()


@contextlib.asynccontextmanager
async def _interrupts() -> AsyncIterator[_Interrupts]:
    async with trio.open_nursery() as nursery:
        state = _Interrupts(nursery.cancel_scope)
        if threading.current_thread() is threading.main_thread():
            nursery.start_soon(state.watch)
        try:
            yield state
        finally:
            nursery.cancel_scope.cancel()


# --- run and chat ---------------------------------------------------------------------------


def _fresh_id(command: str) -> str:
    return f"{command}-{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def _live_agent(
    plan: Plan, command: str, environ: Mapping[str, str]
) -> AsyncIterator[tuple[Context, Agent]]:
    """Open the runtime, check that what the plan needs loaded, and yield it with the agent."""
    failures: list[PluginFailed] = []
    started = False

    def on_failure(event: PluginFailed) -> None:
        failures.append(event)
        if started:
            # The provider it served is gone; the next model call will fail on that.
            sys.stderr.write(f"{PROG}: warning: plugin {event.plugin} stopped: "
                             f"{_one_line(_error_text(event.error))}\n")

    async def watch_plugins(ctx: Context) -> None:
        ctx.events.on(PluginFailed, on_failure)
        await trio.lowlevel.checkpoint()

    plugins: list[Any] = [watch_plugins]
    if plan.db is not None:
        from agentloop_sqlite import sqlite

        plugins.append(sqlite(plan.db))
    if plan.load_local:
        plugins.append("local")
    async with open_runtime(plan.config, plugins=plugins) as rt:
        if failures:
            failure = failures[0]
            raise CliError(f"plugin {failure.plugin} failed: {_error_text(failure.error)}")
        started = True
        if plan.route.env is not None:
            _register_env_provider(rt, plan.route.env, environ)
        session_id = plan.resume or plan.session or _fresh_id(command)
        meta = {"cwd": os.getcwd(), "label": f"{PROG} {command}"}
        backend = rt.session_persistence
        if plan.resume is not None:
            handle = await rt.agents.resume(
                resume_session_id=plan.resume, agent_options=plan.options
            )
        elif backend is not None and await backend.exists(session_id):
            handle = await rt.agents.resume(
                resume_session_id=session_id, agent_options=plan.options
            )
        else:
            handle = await rt.agents.create(
                session_id=session_id, meta=meta, agent_options=plan.options
            )
        async with handle:
            yield rt, handle.agent


def _error_text(error: BaseException) -> str:
    if isinstance(error, (AgentLoopError, OSError)):
        return str(error) or type(error).__name__
    return repr(error)


def _turn_exit(printer: Printer, interrupts: _Interrupts) -> int:
    end = printer.turn_end
    reason = end.data["reason"] if end is not None else None
    if reason in ("completed", "max-tokens"):
        return EXIT_OK
    if reason == "aborted" and interrupts.seen:
        return EXIT_INTERRUPTED
    if reason == "error" and end is not None:
        _fail(printer.err, describe_error(end.data.get("error")))
    elif reason == "rejected":
        _fail(printer.err, "the turn was rejected by a hook")
    elif reason is not None:
        _fail(printer.err, f"the turn ended: {reason}")
    elif interrupts.seen:
        return EXIT_INTERRUPTED
    return EXIT_FAILED


async def _run(args: argparse.Namespace, plan: Plan, out: TextIO, err: TextIO) -> int:
    prompt = args.prompt
    if prompt == "-":
        prompt = await trio.to_thread.run_sync(sys.stdin.read)
    if not prompt.strip():
        raise CliError("the prompt is empty", EXIT_USAGE)
    session_id: str | None = None
    code = EXIT_INTERRUPTED
    async with _interrupts() as interrupts, _live_agent(plan, "run", os.environ) as (rt, agent):
        session_id = agent.id
        printer = Printer(agent.id, out, err)
        rt.events.on(SessionEventAppended, printer)
        interrupts.agent = agent
        agent.followup(prompt)
        await agent.wait_idle()
        interrupts.agent = None
        code = _turn_exit(printer, interrupts)
    if session_id is not None and plan.db is not None:
        err.write(f"session: {session_id}\n")
    return code


async def _chat(args: argparse.Namespace, plan: Plan, out: TextIO, err: TextIO) -> int:
    tty = _isatty(sys.stdin)
    session_id: str | None = None
    code = EXIT_INTERRUPTED
    async with _interrupts() as interrupts, _live_agent(plan, "chat", os.environ) as (rt, agent):
        session_id = agent.id
        printer = Printer(agent.id, out, err)
        rt.events.on(SessionEventAppended, printer)
        if tty:
            err.write(f"session {agent.id} with {plan.route.provider}/{plan.route.model};"
                      " Ctrl-D to quit\n")
        while True:
            if tty:
                err.write("> ")
                err.flush()
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                if tty:
                    err.write("\n")
                break
            if not line.strip():
                continue
            interrupts.agent = agent
            interrupts.seen = False
            printer.turn_end = None
            agent.followup(line.rstrip("\n"))
            await agent.wait_idle()
            interrupts.agent = None
            if _turn_exit(printer, interrupts) == EXIT_INTERRUPTED:
                printer.note("[interrupted]")
        code = EXIT_OK
    if session_id is not None and plan.db is not None:
        err.write(f"session: {session_id}\n")
    return code


# --- sessions -------------------------------------------------------------------------------


def _store_path(db: str | None) -> str:
    return os.path.expanduser(db) if db else _default_db()


@contextlib.asynccontextmanager
async def _open_store(path: str, *, must_exist: str | None = None) -> AsyncIterator[Any]:
    """The store at ``path`` opened read-only, or None when there is no file.

    Reading never creates, initialises or migrates a store, so it works where the store is
    read-only (a mounted backup, another user's directory) and leaves the file as it was.
    """
    from agentloop_sqlite import SqliteSessionStore

    if path.startswith(("postgresql://", "postgres://")):
        try:
            from agentloop_postgres import PostgresSessionStore
        except ImportError:
            raise CliError("a PostgreSQL store needs the 'postgres' extra (psycopg)") from None
        async with PostgresSessionStore.open_read_only(path) as pg_store:
            yield pg_store
        return
    if not await trio.Path(path).exists():
        if must_exist is not None:
            raise CliError(f"no session {must_exist!r}: {path} does not exist")
        yield None
        await trio.lowlevel.checkpoint()
    else:
        async with SqliteSessionStore.open_read_only(path) as store:
            yield store


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


def session_tree(infos: Sequence[Any], parents: Mapping[str, str]) -> list[tuple[int, Any]]:
    """``(depth, info)`` in listing order with each sub-agent session right under its parent.

    A child whose parent is not listed (deleted, or in another store) is shown at the top.
    """
    listed = {i.id for i in infos}
    children: dict[str | None, list[Any]] = {}
    for info in infos:
        parent = parents.get(info.id)
        children.setdefault(parent if parent in listed else None, []).append(info)
    out: list[tuple[int, Any]] = []
    seen: set[str] = set()
    # Iterative: a pathological chain of sub-agents must not exhaust the stack.
    stack: list[tuple[int, Any]] = [(0, i) for i in reversed(children.get(None, []))]
    while stack:
        depth, info = stack.pop()
        if info.id in seen:
            continue
        seen.add(info.id)
        out.append((depth, info))
        stack.extend((depth + 1, c) for c in reversed(children.get(info.id, [])))
    out.extend((0, i) for i in infos if i.id not in seen)  # a cycle in corrupt metadata
    return out


async def _sessions_list(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    parents: dict[str, str] = {}
    async with _open_store(_store_path(args.db)) as store:
        infos = await store.list() if store is not None else []
        for info in infos:
            # The listing carries no metadata: the lineage is read from each session's own.
            parent = (await store.load(info.id)).meta.get("parent_session_id")
            if isinstance(parent, str):
                parents[info.id] = parent
    if not infos:
        err.write("no stored sessions\n")
        return EXIT_OK
    rows = [("ID", "TURNS", "LAST ACTIVITY", "CWD")]
    rows += [
        ("  " * depth + i.id, str(i.turns), _when(i.updated_at), i.cwd or "")
        for depth, i in session_tree(infos, parents)
    ]
    w_id, w_turns, w_when = (max(len(row[c]) for row in rows) for c in range(3))
    for sid, turns, when, cwd in rows:
        line = f"{sid:<{w_id}}  {turns:>{w_turns}}  {when:<{w_when}}  {cwd}"
        out.write(line.rstrip() + "\n")
    return EXIT_OK


def transcript(events: Sequence[SessionEvent]) -> Iterator[str]:
    """A readable rendering of a session log, one line (or paragraph) per entry."""
    route = ""
    for e in events:
        data = e.data
        if e.type == "turn/start":
            yield f"--- turn {e.turn} ---"
        elif e.type == "user/message":
            yield f"user: {content_text(data['content'])}"
        elif e.type == "steering/message":
            yield f"user (steering): {content_text(data['content'])}"
        elif e.type == "request/header":
            route = f"{data.get('provider')}/{data.get('model')}"
        elif e.type == "assistant/message":
            label = f"assistant ({route})" if route else "assistant"
            if data.get("reasoning"):
                yield f"{label} reasoning: {data['reasoning']}"
            text = data.get("content") or ""
            if text or not data.get("tool_calls"):
                marker = " [interrupted]" if data.get("interrupted") else ""
                yield f"{label}: {text}{marker}"
            for call in data.get("tool_calls") or ():
                args = call["arguments"]
                shown = args if isinstance(args, str) else _json_text(args)
                yield f"{label} calls {call['name']} {_one_line(shown, 300)}"
        elif e.type == "tool/result":
            if data.get("is_error"):
                code = f" {data['error_code']}" if data.get("error_code") else ""
                status = f"error{code}"
            else:
                status = "ok"
            yield f"tool {data['name']} -> {status}: {_one_line(content_text(data['content']))}"
        elif e.type == "turn/end":
            detail = ""
            if data.get("reason") == "error":
                detail = f": {describe_error(data.get('error'))}"
            elif data.get("cause"):
                detail = f" ({data['cause']})"
            yield f"--- turn {e.turn} ended: {data.get('reason')}{detail} ---"


async def _sessions_show(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    async with _open_store(_store_path(args.db), must_exist=args.id) as store:
        try:
            stored = await store.load(args.id)
        except SessionNotFound:
            raise CliError(f"no session {args.id!r} in {store.path}") from None
    if args.json:
        for e in stored.events:
            out.write(_json_text({"seq": e.seq, "type": e.type, "turn": e.turn, "data": e.data}))
            out.write("\n")
        return EXIT_OK
    cwd = stored.meta.get("cwd")
    out.write(f"session {stored.id}" + (f" (cwd {cwd})" if cwd else "") + "\n")
    for line in transcript(stored.events):
        out.write(line + "\n")
    return EXIT_OK


# --- argument parsing and main --------------------------------------------------------------


def _add_agent_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a TOML config file")
    parser.add_argument("--provider", metavar="P", help="provider route (config, env or local)")
    parser.add_argument("--model", metavar="M", help="model name for the provider")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--session", metavar="ID", help="use this session id (resumed if stored)")
    which.add_argument("--resume", metavar="ID", help="continue a stored session")
    parser.add_argument("--max-tokens", type=_positive_int, metavar="N",
                        help="completion limit per model call")
    parser.add_argument("--db", metavar="PATH", help="the SQLite session store")
    parser.add_argument("--no-persist", action="store_true", help="do not store the session")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")


def build_parser() -> argparse.ArgumentParser:
    """The ``agentloop`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run LLM agents on the agentloop runtime."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run one prompt and stream the answer")
    _add_agent_options(run)
    run.add_argument("prompt", metavar="PROMPT", help="the prompt ('-' reads it from stdin)")
    chat = commands.add_parser("chat", help="chat: each stdin line is a prompt")
    _add_agent_options(chat)
    sessions = commands.add_parser("sessions", help="read stored sessions")
    which = sessions.add_subparsers(dest="sessions_command", required=True, metavar="ACTION")
    listing = which.add_parser("list", help="list stored sessions")
    listing.add_argument("--db", metavar="PATH", help="the SQLite session store")
    show = which.add_parser("show", help="print a session's transcript")
    show.add_argument("id", metavar="ID")
    show.add_argument("--json", action="store_true", help="the raw log, one JSON object a line")
    show.add_argument("--db", metavar="PATH", help="the SQLite session store")
    return parser


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


_EXPECTED = (CliError, AgentLoopError, OSError)


def _expected(exc: BaseException) -> BaseException | None:
    """The error to report for ``exc`` (a group's first expected leaf), or None for a bug."""
    leaves = list(_leaves(exc))
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
        return KeyboardInterrupt()
    for leaf in leaves:
        if isinstance(leaf, _EXPECTED):
            return leaf
    return None


def _message(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, CliError):
        return str(exc), exc.code
    if isinstance(exc, ConfigError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, InvalidContent):
        return f"the prompt cannot be sent: {exc}", EXIT_USAGE
    if isinstance(exc, PersistenceError):
        return f"session store: {exc}", EXIT_FAILED
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}", EXIT_FAILED
    return str(exc) or type(exc).__name__, EXIT_FAILED


def _configure_logging(verbose: bool, err: TextIO) -> Callable[[], None]:
    logger = logging.getLogger("agentloop")
    handler: logging.Handler
    if verbose:
        handler = logging.StreamHandler(err)
        handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
        level = logging.INFO
    else:
        # Failures the user must see are reported from events and exit statuses.
        handler = logging.NullHandler()
        level = logging.CRITICAL
    previous = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]

    return restore


def _dispatch(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.command == "sessions":
        if args.sessions_command == "list":
            return trio.run(_sessions_list, args, out, err)
        return trio.run(_sessions_show, args, out, err)
    plan = make_plan(args, os.environ)
    command = _run if args.command == "run" else _chat
    return trio.run(command, args, plan, out, err)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``agentloop`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "no_persist", False):
        if args.resume:
            parser.error("--resume needs the session store; drop --no-persist")
        if args.db:
            parser.error("--db and --no-persist contradict each other")
    out, err = sys.stdout, sys.stderr
    restore = _configure_logging(getattr(args, "verbose", False), err)
    try:
        return _dispatch(args, out, err)
    except (Exception, KeyboardInterrupt, BaseExceptionGroup) as exc:
        if getattr(args, "verbose", False) and not isinstance(exc, KeyboardInterrupt):
            raise
        reported = _expected(exc)
        if isinstance(reported, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        if reported is None:
            raise
        message, code = _message(reported)
        _fail(err, message)
        return code
    finally:
        restore()
        _flush_or_silence(out)


def _flush_or_silence(out: TextIO) -> None:
    try:
        out.flush()
    except BrokenPipeError:
        # The reader went away (``| head``); keep interpreter shutdown from complaining too.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out.fileno())
    except (OSError, ValueError):
        pass
