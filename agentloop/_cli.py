"""The ``agentloop`` command line: ``run`` one prompt, ``chat``, and read stored ``sessions``;
``mcp-serve`` and ``acp`` (in their own modules) serve agents over MCP and ACP.

Model text streams to stdout as it arrives; reasoning, tool activity, notes and errors go to
stderr, so ``agentloop run "..." > answer.txt`` captures only the answer. Every expected failure
is one line on stderr and a non-zero exit status; no tracebacks unless ``--verbose``.

The provider is chosen by ``--provider``/``--model``, else by the config file (its first agent,
else its first provider), else by an API key in the environment (``OPENAI_API_KEY``,
``DEEPSEEK_API_KEY``, ``ANTHROPIC_API_KEY``), else by a ``<NAME>_BASE_URL`` without a key (a
local server, called keyless), else the packaged local model (the ``local`` extra). The choice
is printed as one line on stderr (``--quiet`` drops it). See ``docs/cli.md``.

``chat`` on a terminal with the ``tui`` extra is a terminal UI (prompt_toolkit on a thread of
its own for input and the status bar, rich for markdown); otherwise, or with ``--plain``, it
reads lines with readline, or from a pipe.

Exit statuses: 0 done, 1 the (last) turn failed, 2 usage or configuration (flags, config file,
missing key, a store that cannot be opened, an unknown session), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import sys
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, Protocol, TextIO

import attrs
import trio

# The command line is the top layer: it uses only what any program embedding agentloop can.
from agentloop import (
    Agent,
    AgentHandle,
    AgentLoopError,
    AgentOptions,
    Config,
    Context,
    ProviderConfig,
    Run,
    SessionEvent,
    SessionNotFound,
    StoredSession,
    TurnFailed,
    content_text,
    load_config,
    open_runtime,
)
from agentloop.events import McpServerFailed, PluginFailed, ToolProgress

from ._cli_render import context_window, last_context_use, status_line

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED", "Plan", "Printer"]

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

    @property
    def url_var(self) -> str:
        return f"{self.name.upper()}_BASE_URL"

    def endpoint(self, environ: Mapping[str, str]) -> str:
        """The base URL to call: the override variable's value, else the public API."""
        return environ.get(self.url_var) or self.base_url


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
    keyless: bool = False
    max_tokens: int | None = None
    reasoning_effort: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def origin(self) -> str:
        """Where the route came from, for the header line."""
        if self.source == "config":
            return "from the config"
        if self.source == "local":
            return "the packaged local model"
        assert self.env is not None
        if self.keyless:
            return f"{self.env.url_var}, no key"
        return f"from {self.env.key_var}"


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
    if name in config.providers and config.providers[name].has_adapter:
        chosen = model or config.providers[name].model
        if not chosen:
            raise CliError(
                f"provider {name!r} has no model in the config; pass --model", EXIT_USAGE
            )
        return Route(provider=name, model=chosen, source="config")
    if name == "local":
        return _local_route(model)
    for env in ENV_PROVIDERS:
        if env.name == name:
            if not environ.get(env.key_var) and not environ.get(env.url_var):
                raise CliError(
                    f"provider {name!r} needs {env.key_var} in the environment "
                    f"(or {env.url_var} for a server that takes no key)",
                    EXIT_USAGE,
                )
            return _env_route(env, model, environ)
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
    served = [name for name, p in config.providers.items() if p.has_adapter]
    if served:
        return _named_route(served[0], model, config, environ)
    for env in ENV_PROVIDERS:
        if environ.get(env.key_var):
            return _env_route(env, model, environ)
    for env in ENV_PROVIDERS:
        if environ.get(env.url_var):
            return _env_route(env, model, environ)
    local = _local_route(None)
    if model and model != local.model:
        # Running the local model under another model's name would record a route that
        # never served the session.
        raise CliError(
            f"--model {model} names no provider, and none is configured or has a key in the "
            f"environment; pass --provider (or --provider local to use {local.model})",
            EXIT_USAGE,
        )
    return local


def _env_route(env: EnvProvider, model: str | None, environ: Mapping[str, str]) -> Route:
    url = environ.get(env.url_var)
    if url and not re.match(r"https?://[^/\s]", url):
        raise CliError(
            f"{env.url_var} must start with http:// or https:// (for example "
            f"http://127.0.0.1:8080/v1), got {url!r}", EXIT_USAGE,
        )
    if environ.get(env.key_var):
        return Route(provider=env.name, model=model or env.model, source="env", env=env)
    # A base URL alone is a local or self-hosted server (llama.cpp, Ollama, vLLM), which takes
    # no key: it is called without one, and said so.
    warning = f"{env.url_var} is set without {env.key_var}: calling {env.endpoint(environ)} "
    warning += "without an API key"
    if model is None:
        warning += f"; pass --model if the server does not serve {env.model}"
    return Route(
        provider=env.name, model=model or env.model, source="env", env=env, keyless=True,
        warnings=(warning,),
    )


def _register_env_provider(rt: Context, env: EnvProvider, environ: Mapping[str, str]) -> None:
    from agentloop.llm import AnthropicAdapter, OpenAIChatAdapter

    key = environ.get(env.key_var) or None
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
    quiet: bool = False
    postgres: bool = False  # db is a PostgreSQL connection string
    lease_seconds: float | None = None  # of the configured store


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
    stored = config.persistence
    if not args.no_persist:
        if args.db:
            db = args.db if _is_dsn(args.db) else os.path.expanduser(args.db)
        elif stored is not None and stored.backend == "postgres":
            db = stored.dsn  # validated by the config: never the throwaway file of path ""
        elif stored is not None:
            db = _beside(args.config, stored.path)
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
        quiet=args.quiet,
        postgres=db is not None and (
            _is_dsn(db) or (not args.db and stored is not None and stored.backend == "postgres")
        ),
        lease_seconds=stored.lease_seconds if stored is not None else None,
    )


def _is_dsn(db: str) -> bool:
    """Whether ``--db`` (or the chosen store) names a PostgreSQL database, not a file."""
    return db.startswith(("postgresql://", "postgres://"))


def _store_plugin(plan: Plan) -> Any:
    """The persistence plugin for ``plan.db``: PostgreSQL for a DSN, else SQLite."""
    assert plan.db is not None
    if plan.postgres:
        try:
            from agentloop_postgres import postgres
        except ImportError:
            raise CliError(
                "a PostgreSQL store needs the 'postgres' extra: pip install 'agentloop[postgres]'",
                EXIT_USAGE,
            ) from None
        if plan.lease_seconds is not None:
            return postgres(plan.db, lease_seconds=plan.lease_seconds)
        return postgres(plan.db)
    from agentloop_sqlite import sqlite

    return sqlite(plan.db)


# --- output ---------------------------------------------------------------------------------


def _one_line(text: object, limit: int = 400) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _json_text(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def describe_error(error: object, base_url: str | None = None) -> str:
    """One line from a ``turn/end`` error object; ``base_url``: where the calls went."""
    if not isinstance(error, Mapping):
        return "the turn failed"
    message = error.get("message") or error.get("type") or "the turn failed"
    details = []
    if error.get("status") is not None:
        details.append(f"HTTP {error['status']}")
    if error.get("code"):
        details.append(str(error["code"]))
    suffix = f" ({', '.join(details)})" if details else ""
    if error.get("status") == 404 and base_url:
        # Nearly always a base URL without the API's version prefix, not a missing model.
        suffix += f"; is the base URL {base_url} right?"
        if not base_url.rstrip("/").endswith("/v1"):
            suffix += f" OpenAI-compatible servers serve under /v1: {base_url.rstrip('/')}/v1"
    return _one_line(f"{message}{suffix}", 600)


def _base_url(plan: Plan) -> str | None:
    """The endpoint the plan's calls go to, for error messages (``None``: the local model)."""
    route = plan.route
    if route.env is not None:
        return route.env.endpoint(os.environ)
    provider = plan.config.providers.get(route.provider)
    return provider.base_url if isinstance(provider, ProviderConfig) else None


class Printer:
    """Renders one turn's events, read from ``run.events()``, as they are appended.

    Text goes to ``out``; reasoning (dimmed on a terminal), tool activity and notes to ``err``.
    """

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self.color = _isatty(err) and not os.environ.get("NO_COLOR")
        self.show_reasoning = True
        self.turn_end: SessionEvent | None = None
        self.broken = False
        self._text_open = False
        self._reasoning_open = False
        self._reasoning_hidden = 0
        self._thought: list[str] = []
        self.last_reasoning = ""
        self._progress_open = False  # a progress line is drawn on err, to be overwritten
        self._progress_shown: tuple[str, float] = ("", -1e9)

    def progress(self, e: ToolProgress) -> None:
        """A running tool's progress: on a terminal one line, redrawn in place; elsewhere
        a line when the message changes, at most one a second (the latest is never lost for
        long: the tool's result follows)."""
        line = progress_line(e)
        try:
            if _isatty(self.err) and not self._text_open and not self._reasoning_open:
                self.err.write("\r\x1b[2K" + self.dim(_one_line(line, 200)))
                self.err.flush()
                self._progress_open = True
                return
            now = trio.current_time()
            last, at = self._progress_shown
            if line != last and now - at >= 1.0:
                self._progress_shown = (line, now)
                self.note(line)
        except OSError:
            self.broken = True

    def _clear_progress(self) -> None:
        if self._progress_open:
            self._progress_open = False
            self.err.write("\r\x1b[2K")

    def show(self, e: SessionEvent) -> None:
        """Render ``e``; a closed stdout (``| head``) only stops the text, never the turn."""
        try:
            self._show(e)
        except OSError:
            self.broken = True

    def _show(self, e: SessionEvent) -> None:
        data = e.data
        if e.type == "turn/start":
            self.turn_end = None
        elif e.type == "assistant/chunk":
            if data["kind"] == "text":
                self._end_reasoning()
                self._write(self.out, data["delta"])
                self._text_open = not data["delta"].endswith("\n")
            elif data["kind"] == "reasoning":
                self._thought.append(data["delta"])
                if not self.show_reasoning:
                    self._reasoning_hidden += len(data["delta"])
                    return
                self._reasoning_open = True
                self._write(self.err, self.dim(data["delta"]))
        elif e.type == "tool/call":
            # The next step's text is another paragraph, also in a file.
            self.finish()
            args = data["arguments"]
            shown = args if isinstance(args, str) else _json_text(args)
            self.note(f"[tool] {data['name']} {_one_line(shown, 200)}")
        elif e.type == "tool/result":
            if data.get("is_error"):
                outcome = f"error: {_one_line(content_text(data['content']), 200)}"
            else:
                outcome = f"ok: {_one_line(content_text(data['content']), 120)}"
            self.note(f"[tool] {data['name']} -> {outcome}")
        elif e.type == "tool/approval-requested":
            args = data.get("arguments")
            shown = args if isinstance(args, str) else _json_text(args)
            prompt = f" ({_one_line(data['prompt'], 200)})" if data.get("prompt") else ""
            self.note(f"[approval] {data['name']} {_one_line(shown, 200)}{prompt}")
        elif e.type == "turn/end":
            self.turn_end = e
            self.finish()
            if data["reason"] == "max-tokens":
                self.note("[stopped at the max-tokens limit]")

    def finish(self) -> None:
        """End an open line of text or reasoning (and clear a progress line)."""
        with contextlib.suppress(OSError):
            self._clear_progress()
        self._end_reasoning()
        if self._text_open:
            self._text_open = False
            with contextlib.suppress(OSError):
                self._write(self.out, "\n")

    def dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.color else text

    def _end_reasoning(self) -> None:
        if self._thought:
            self.last_reasoning, self._thought = "".join(self._thought), []
        if self._reasoning_hidden:
            hidden, self._reasoning_hidden = self._reasoning_hidden, 0
            self._write(self.err, self.dim(f"[reasoning hidden, {hidden} characters]") + "\n")
        if self._reasoning_open:
            self._reasoning_open = False
            self._write(self.err, "\n")

    def _write(self, stream: TextIO, text: str) -> None:
        if self.broken and stream is self.out:
            return
        self._clear_progress()
        stream.write(text)
        stream.flush()

    def note(self, line: str) -> None:
        """A status line on stderr, starting on a fresh line of the terminal."""
        self._end_reasoning()
        if self._text_open and _isatty(self.out) and not self.broken:
            self._write(self.out, "\n")
            self._text_open = False
        self._write(self.err, self.dim(line) + "\n")

    def reveal(self) -> None:
        """``/think``: the last reasoning in full, dimmed."""
        self._end_reasoning()
        if not self.last_reasoning:
            self.note("[no reasoning yet]")
            return
        self._write(self.err, self.dim(self.last_reasoning.rstrip("\n")) + "\n")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _fail(err: TextIO, message: str) -> None:
    err.write(f"{PROG}: error: {_one_line(message, 1000)}\n")
    err.flush()


def _warn(err: TextIO, message: str) -> None:
    err.write(f"{PROG}: warning: {_one_line(message, 1000)}\n")
    err.flush()


# --- Ctrl-C ---------------------------------------------------------------------------------


@attrs.define
class _Interrupts:
    """Ctrl-C cancels the running turn; with no turn running it calls ``on_idle``, else it
    ends the command."""

    scope: trio.CancelScope
    agent: Agent | None = None
    seen: bool = False
    on_idle: Callable[[], None] | None = None

    def interrupt(self) -> None:
        self.seen = True
        agent = self.agent
        if agent is not None and agent.status == "running" and agent.cancel("user"):
            return
        if self.on_idle is not None:
            self.on_idle()
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


# --- the runtime, the agent, one turn -------------------------------------------------------


def _fresh_id(command: str) -> str:
    return f"{command}-{uuid.uuid4().hex[:8]}"


def _local_progress(err: TextIO) -> None:
    local = _local_module()
    first = local is not None and not local.default_model_path().is_file()
    what = "assembling the local model (Gemma 3 270M, about 250 MB, once) and starting it"
    if not first:
        what = "starting the local model (a llama.cpp server)"
    err.write(f"{PROG}: {what}...\n")
    err.flush()


@contextlib.asynccontextmanager
async def _runtime(
    plan: Plan, environ: Mapping[str, str], err: TextIO, *, compact: bool = False
) -> AsyncIterator[Context]:
    """Open the runtime and check that what the plan needs loaded.

    ``compact`` loads the compaction plugin unless the config names it: a long chat then keeps
    working once its history outgrows the model's context (the local model's is 2,048 tokens).
    """
    failures: list[PluginFailed] = []
    started = False

    def on_failure(event: PluginFailed) -> None:
        failures.append(event)
        if started:
            # The provider it served is gone; the next model call will fail on that.
            _warn(err, f"plugin {event.plugin} stopped: {_error_text(event.error)}")

    def on_mcp_failure(event: McpServerFailed) -> None:
        _warn(err, event.message)

    async def watch_plugins(ctx: Context) -> None:
        ctx.events.on(PluginFailed, on_failure)
        ctx.events.on(McpServerFailed, on_mcp_failure)
        await trio.lowlevel.checkpoint()

    # The watcher loads first, before the config's own plugins, to hear of their failures.
    plugins: list[Any] = [watch_plugins, *plan.config.plugins]
    store_name = None
    if plan.db is not None:
        store = _store_plugin(plan)
        store_name = getattr(store, "__name__", None)
        plugins.append(store)
    if plan.load_local:
        plugins.append("local")
        if not plan.quiet:
            _local_progress(err)
    if compact and not any(p in ("compact", "agentloop_compact") for p in plan.config.plugins):
        plugins.append("compact")
    for warning in plan.route.warnings:
        _warn(err, warning)
    config = attrs.evolve(plan.config, plugins=())
    async with open_runtime(config, plugins=plugins) as rt:
        if failures:
            failure = failures[0]
            # A store that cannot be opened is configuration (--db, [persistence]).
            code = EXIT_USAGE if failure.plugin == store_name else EXIT_FAILED
            raise CliError(f"plugin {failure.plugin} failed: {_error_text(failure.error)}", code)
        started = True
        if plan.route.env is not None:
            _register_env_provider(rt, plan.route.env, environ)
        yield rt


async def _open_agent(
    rt: Context, plan: Plan, session_id: str, options: AgentOptions, command: str
) -> AgentHandle:
    """The agent of ``session_id``: resumed when it is stored, else created."""
    backend = rt.session_persistence
    if session_id == plan.resume or (backend is not None and await backend.exists(session_id)):
        return await rt.agents.resume(resume_session_id=session_id, agent_options=options)
    meta = {"cwd": os.getcwd(), "label": f"{PROG} {command}"}
    return await rt.agents.create(session_id=session_id, meta=meta, agent_options=options)


# The protocol servers (``mcp-serve``, ``acp``) open their runtime and agents as run/chat do.
cli_runtime = _runtime
open_cli_agent = _open_agent


def _header(err: TextIO, plan: Plan, options: AgentOptions, session_id: str) -> None:
    if plan.quiet:
        return
    route = f"{options.provider}/{options.model}"
    stored = "" if plan.db is not None else " (not stored)"
    err.write(f"{PROG}: {route} ({plan.route.origin}), session {session_id}{stored}\n")
    err.flush()


def _error_text(error: BaseException) -> str:
    if isinstance(error, (AgentLoopError, OSError)):
        return str(error) or type(error).__name__
    return repr(error)


@attrs.frozen
class TurnOutcome:
    """How one turn shown on the terminal ended: the exit status it stands for, its usage."""

    code: int
    usage: Mapping[str, Any] | None = None


Approver = Callable[[Agent, SessionEvent], Any]


async def _refuse_approval(agent: Agent, event: SessionEvent) -> None:
    await trio.lowlevel.checkpoint()
    reason = f"{PROG} run cannot ask for approval; use {PROG} chat"
    agent.deny(event.data["call_id"], reason)


def progress_line(e: ToolProgress) -> str:
    """``[progress] message (42%)``: what the chat shows of a running tool's progress."""
    done = "" if e.fraction is None else f" ({e.fraction:.0%})"
    return f"[progress] {e.message}{done}"


async def _show_progress(run: Run, printer: Printer) -> None:
    async for event in run.progress():
        printer.progress(event)


async def _show_turn(
    agent: Agent, content: str, printer: Printer, interrupts: _Interrupts, approve: Approver,
    base_url: str | None = None,
) -> TurnOutcome:
    """Queue ``content`` with ``agent.run`` and render its turn; a failure is one line."""
    interrupts.seen = False
    interrupts.agent = agent
    usage: Mapping[str, Any] | None = None
    try:
        async with agent.run(content) as run, trio.open_nursery() as nursery:
            nursery.start_soon(_show_progress, run, printer)
            async for event in run.events():
                printer.show(event)
                if event.type == "tool/approval-requested":
                    await approve(agent, event)
                elif event.type == "turn/end" and isinstance(event.data.get("usage"), Mapping):
                    usage = event.data["usage"]
            nursery.cancel_scope.cancel()
        printer.finish()
        try:
            result = await run.result()
        except TurnFailed as failed:
            _fail(printer.err, describe_error(failed.data, base_url))
            return TurnOutcome(EXIT_FAILED)
    finally:
        interrupts.agent = None
    usage = usage if usage is not None else result.usage
    if result.reason in ("completed", "max-tokens"):
        return TurnOutcome(EXIT_OK, usage)
    if result.reason == "aborted" and interrupts.seen:
        return TurnOutcome(EXIT_INTERRUPTED, usage)
    if result.reason == "rejected":
        _fail(printer.err, "the turn was rejected by a hook")
    else:
        _fail(printer.err, f"the turn ended: {result.reason}")
    return TurnOutcome(EXIT_FAILED, usage)


def _tolerant_stdin() -> None:
    """Read stdin's undecodable bytes as escapes, so that a bad line is reported (and in a
    chat skipped) by :func:`utf8_problem` instead of ending the program with a traceback."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        with contextlib.suppress(ValueError, OSError):
            reconfigure(errors="surrogateescape")


def utf8_problem(text: str) -> str | None:
    """Where ``text`` (argv or stdin, undecodable bytes escaped) is not valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        return None
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate at character {exc.start}"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte 0x{raw[exc.start]:02x} at byte {exc.start}"
    return None


async def _run(args: argparse.Namespace, plan: Plan, out: TextIO, err: TextIO) -> int:
    prompt = args.prompt
    if prompt == "-":
        _tolerant_stdin()
        prompt = await trio.to_thread.run_sync(sys.stdin.read)
    problem = utf8_problem(prompt)
    if problem is not None:
        raise CliError(f"the prompt is not valid UTF-8 ({problem})", EXIT_USAGE)
    if not prompt.strip():
        raise CliError("the prompt is empty", EXIT_USAGE)
    session_id: str | None = None
    code = EXIT_INTERRUPTED
    async with _interrupts() as interrupts, _runtime(plan, os.environ, err) as rt:
        wanted = plan.resume or plan.session or _fresh_id("run")
        async with await _open_agent(rt, plan, wanted, plan.options, "run") as handle:
            session_id = handle.agent.id
            _header(err, plan, plan.options, session_id)
            printer = Printer(out, err)
            outcome = await _show_turn(
                handle.agent, prompt, printer, interrupts, _refuse_approval, _base_url(plan)
            )
            code = outcome.code
    if session_id is not None and plan.db is not None and not plan.quiet:
        err.write(f"session: {session_id}\n")
    return code


# --- chat -----------------------------------------------------------------------------------

_CHAT_HELP: Final = (
    "/sessions  list stored sessions;  /resume ID  continue one;  /model NAME  switch model;  "
    "/reasoning  show or hide reasoning;  /think  show the last reasoning;  "
    "/queue TEXT  queue a follow-up;  /quit (or Ctrl-D)"
)
_GREETING: Final = (
    "Enter sends, typing during a turn steers it, Ctrl-C cancels the turn, Ctrl-D quits; /help"
)
_SCREEN_GREETING: Final = (
    "Enter sends (steers a running turn), Alt-Enter queues, Ctrl-C cancels or clears, "
    "Ctrl-D quits; /help"
)


def _history_path() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                           "share")
    return os.path.join(base, "agentloop", "chat_history")


@attrs.define
class _LineSource:
    """Lines typed (with readline's editing and history on a terminal) or piped in.

    ``readline`` blocks, so it runs on a worker thread, one line at a time, and hands each line
    to trio over a channel; the prompt is written by the chat, so readline's own is empty.
    """

    tty: bool
    history: str | None = None
    err: TextIO | None = None
    """Where a line that is not UTF-8 is reported (and skipped)."""
    lines: int = 0

    def setup(self) -> None:
        _tolerant_stdin()
        if not self.tty:
            return
        import readline

        readline.set_history_length(1000)
        self.history = _history_path()
        with contextlib.suppress(OSError):
            readline.read_history_file(self.history)

    def save(self) -> None:
        if self.history is None:
            return
        import readline

        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(self.history), exist_ok=True)
            readline.write_history_file(self.history)

    def read(self) -> str | None:
        if self.tty:
            try:
                return input()
            except EOFError:
                return None
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None

    async def feed(self, tx: trio.MemorySendChannel[str]) -> None:
        async with tx:
            while True:
                line = await trio.to_thread.run_sync(self.read, abandon_on_cancel=True)
                if line is None:
                    return
                self.lines += 1
                problem = utf8_problem(line)
                if problem is not None:
                    if self.err is not None:
                        _fail(self.err, f"input line {self.lines} is not valid UTF-8 "
                                        f"({problem}); it was skipped")
                    continue
                await tx.send(line)


async def _next_line(rx: trio.MemoryReceiveChannel[str]) -> str | None:
    try:
        return await rx.receive()
    except trio.EndOfChannel:
        return None


def _token_count(usage: Mapping[str, Any] | None) -> int:
    if not usage:
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    return sum(v for k in ("input_tokens", "output_tokens")
               if isinstance(v := usage.get(k), int))


class ChatScreen(Protocol):
    """What the chat sets and asks of its terminal UI (``_cli_screen._Screen``)."""

    prompt: str
    status: str
    busy: bool
    talking: bool

    def refresh(self) -> None: ...


@attrs.define
class _Chat:
    """One chat: its line source, its state between turns, and its commands."""

    plan: Plan
    rt: Context
    out: TextIO
    err: TextIO
    interrupts: _Interrupts
    lines: trio.MemoryReceiveChannel[str]
    tty: bool
    options: AgentOptions
    printer: Printer
    code: int = EXIT_OK
    tokens: int = 0
    quit: bool = False
    queued: deque[str] = attrs.field(factory=deque)
    switch: tuple[str, AgentOptions] | None = None
    screen: ChatScreen | None = None
    agent: Agent | None = None
    session_id: str | None = None
    window: int | None = None
    context_used: int | None = None

    def prompt(self) -> None:
        if self.tty and self.screen is None:
            self.err.write("> ")
            self.err.flush()

    def ask(self, question: str | None) -> None:
        """Ask at the prompt (``None``: back to the usual prompt)."""
        if self.screen is not None:
            self.screen.prompt = question or "> "
            self.screen.refresh()
        elif question is not None:
            self.err.write(question)
            self.err.flush()

    def on_usage(self, used: int) -> None:
        self.context_used = used
        if self.agent is not None:
            self.status(self.agent)

    def status(self, agent: Agent) -> None:
        if self.screen is not None:
            self.screen.status = status_line(
                route=f"{self.options.provider}/{self.options.model}", session=agent.id,
                turn=agent.session.turns, tokens=self.tokens, window=self.window,
                used=self.context_used, busy=self.screen.busy,
            )
            self.screen.refresh()
        elif self.tty:
            route = f"{self.options.provider}/{self.options.model}"
            self.printer.note(
                f"[{route} · session {agent.id} · turn {agent.session.turns} · "
                f"{self.tokens:,} tokens]"
            )

    def on_idle_interrupt(self) -> None:
        if self.screen is not None:
            self.printer.note("(Ctrl-D quits)")
        elif self.tty:
            # Ctrl-C at the prompt leaves the chat running: Ctrl-D is the way out.
            self.err.write("\n(Ctrl-D quits)\n> ")
            self.err.flush()
        else:
            self.interrupts.scope.cancel()

    async def approve(self, agent: Agent, event: SessionEvent) -> None:
        self.ask(f"approve {event.data['name']}? [y/n] ")
        if self.tty:
            await trio.lowlevel.checkpoint()  # the reader beside the turn takes the answer
            return
        line = await _next_line(self.lines)
        self._answer(agent, event.data["call_id"], line)

    def _answer(self, agent: Agent, call_id: str, line: str | None) -> bool:
        word = (line or "").strip().lower()
        if word in ("y", "yes"):
            agent.approve(call_id)
        elif word in ("n", "no") or line is None:
            agent.deny(call_id, "denied at the terminal")
        else:
            self.ask("answer y or n: ")
            return False
        if self.screen is not None:
            self.ask(None)
        return True

    async def beside_turn(self, agent: Agent) -> None:
        """Lines typed while a turn runs: approval answers, follow-ups, else steering."""
        while True:
            line = await _next_line(self.lines)
            if line is None:
                self.quit = True
                return
            pending = agent.pending_approvals
            if pending:
                self._answer(agent, pending[0].call_id, line)
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/queue "):
                self.queued.append(text.removeprefix("/queue ").strip())
                self.printer.note("[queued for after this turn]")
            elif agent.status == "running":
                agent.steer(text)
                self.printer.note("[steering the running turn]")
            else:
                self.queued.append(text)

    async def turn(self, agent: Agent, text: str) -> None:
        if self.screen is not None:
            self.screen.busy = True
            self.status(agent)
        try:
            async with trio.open_nursery() as nursery:
                if self.tty:
                    nursery.start_soon(self.beside_turn, agent)
                outcome = await _show_turn(
                    agent, text, self.printer, self.interrupts, self.approve,
                    _base_url(self.plan),
                )
                nursery.cancel_scope.cancel()
        finally:
            if self.screen is not None:
                self.screen.busy = False
                self.ask(None)
        self.code = outcome.code
        self.tokens += _token_count(outcome.usage)
        if outcome.code == EXIT_INTERRUPTED:
            self.printer.note("[interrupted; what was shown is kept]")
        self.status(agent)

    async def command(self, agent: Agent, text: str) -> None:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        backend = self.rt.session_persistence
        if name in ("/quit", "/exit"):
            self.quit = True
        elif name == "/help":
            self.printer.note(_CHAT_HELP)
        elif name == "/reasoning":
            self.printer.show_reasoning = not self.printer.show_reasoning
            if self.screen is not None:
                shown = "expanded" if self.printer.show_reasoning else "collapsed"
            else:
                shown = "shown" if self.printer.show_reasoning else "hidden"
            self.printer.note(f"[reasoning {shown}]")
        elif name == "/think":
            self.printer.reveal()
        elif name == "/queue" and arg:
            self.queued.append(arg)
        elif name == "/sessions":
            if backend is None:
                self.printer.note("[no session store: started with --no-persist]")
                return
            for info in await backend.list():
                mark = " *" if info.id == agent.id else ""
                self.printer.note(f"{info.id}  {info.turns} turns  {_when(info.updated_at)}{mark}")
        elif name == "/resume" and arg:
            if backend is None or not await backend.exists(arg):
                self.printer.note(f"[no stored session {arg!r}; /sessions lists them]")
                return
            self.switch = (arg, self.options)
        elif name == "/model":
            if not arg:
                self.printer.note(f"[{self.options.provider}/{self.options.model}]")
            elif backend is None:
                self.printer.note("[/model needs the session store: started with --no-persist]")
            else:
                self.switch = (agent.id, attrs.evolve(self.options, model=arg))
        else:
            self.printer.note(f"[unknown command {name}] {_CHAT_HELP}")

    async def sessions(self, wanted: str) -> None:
        """Talk in session ``wanted``, then in each one ``/resume`` or ``/model`` switches to."""
        while True:
            async with await _open_agent(self.rt, self.plan, wanted, self.options,
                                         "chat") as handle:
                agent = handle.agent
                self.session_id = agent.id
                _header(self.err, self.plan, self.options, agent.id)
                if self.tty and not self.plan.quiet:
                    greeting = _GREETING if self.screen is None else _SCREEN_GREETING
                    self.printer.note(greeting)
                provider = self.options.provider
                adapter = self.rt.llm.adapter(provider) if provider else None
                self.window = context_window(adapter, self.options.model, self.plan.config)
                self.context_used = last_context_use(agent.session.events)
                await self.talk(agent)
            if self.switch is None:
                return
            wanted, self.options = self.switch
            self.switch = None

    async def talk(self, agent: Agent) -> None:
        """Turns with ``agent`` until Ctrl-D, ``/quit``, or a switch of session or model."""
        self.interrupts.on_idle = self.on_idle_interrupt
        self.agent = agent
        if self.screen is not None:
            self.screen.talking = True
            self.status(agent)
        while not self.quit and self.switch is None:
            if self.queued:
                await self.turn(agent, self.queued.popleft())
                continue
            self.prompt()
            line = await _next_line(self.lines)
            if line is None:
                if self.tty:
                    self.err.write("\n")
                return
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                await self.command(agent, text)
            else:
                await self.turn(agent, text)


def _terminal_state() -> list[Any] | None:
    # readline puts the terminal in its own mode while it reads; a chat that ends while a
    # line is half read must not leave it there.
    import termios

    try:
        return termios.tcgetattr(sys.stdin.fileno())
    except (OSError, ValueError, termios.error):
        return None


def _restore_terminal(saved: list[Any] | None) -> None:
    if saved is None:
        return
    import termios

    with contextlib.suppress(OSError, ValueError, termios.error):
        termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)



# --- sessions -------------------------------------------------------------------------------


def _store_path(args: argparse.Namespace) -> str:
    """``--db``, else the config's ``[persistence]``, else the default store."""
    if args.db:
        return os.path.expanduser(str(args.db))
    if args.config:
        persistence = load_config(args.config).persistence
        if persistence is not None:
            if persistence.backend == "postgres" and persistence.dsn:
                return str(persistence.dsn)
            if persistence.path:
                return _beside(args.config, persistence.path)
    return _default_db()


def _beside(config_file: str, path: str) -> str:
    """A path from a config file: a relative one means next to that file, wherever the
    command runs (as ``./sessions.db`` in a project's config should)."""
    path = os.path.expanduser(path)
    if not path or os.path.isabs(path):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(config_file)), path)


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
            raise CliError(f"no session {must_exist!r}: {path} does not exist", EXIT_USAGE)
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
    async with _open_store(_store_path(args)) as store:
        infos = await store.list() if store is not None else []
    # The store derives each row's lineage: no session's log is loaded to find its parent.
    parents = {i.id: i.parent_session_id for i in infos if i.parent_session_id is not None}
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
            yield f"--- turn {e.turn} ended: {data.get('reason')}{detail}{_usage_note(data)} ---"


_USAGE_LABELS: Final = (
    ("input_tokens", "in"), ("output_tokens", "out"), ("cache_read_tokens", "cache read"),
    ("cache_write_tokens", "cache write"), ("reasoning_tokens", "reasoning"),
)


def _usage_note(data: Mapping[str, object]) -> str:
    """``, tokens: in 12, out 3, cost 0.0012`` from a ``turn/end``'s usage, or nothing.

    The cost shows when the calls were made with a ``[prices]`` table: ``cost unknown`` when
    none of them had a price, and the calls without one counted beside a known cost.
    """
    usage = data.get("usage")
    if not isinstance(usage, Mapping):
        return ""
    parts = [f"{label} {usage[key]}" for key, label in _USAGE_LABELS
             if isinstance(usage.get(key), int)]
    note = f", tokens: {', '.join(parts)}" if parts else ""
    if "cost" in usage:
        cost, unpriced = usage["cost"], usage.get("unpriced_calls")
        note += f", cost {cost:.6g}" if isinstance(cost, (int, float)) else ", cost unknown"
        if isinstance(cost, (int, float)) and isinstance(unpriced, int) and unpriced:
            note += f" (+{unpriced} unpriced calls)"
    return note


def _usage_total(events: Sequence[SessionEvent], total: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The usage of every ``turn/end`` of ``events`` added to ``total``: counts and cost
    summed, a cost ``None`` (no price) kept only while no other is known."""
    total = {} if total is None else total
    for e in events:
        usage = e.data.get("usage") if e.type == "turn/end" else None
        if isinstance(usage, Mapping):
            _add_usage(total, usage)
    return total


def _add_usage(total: dict[str, Any], usage: Mapping[str, Any]) -> None:
    for key, value in usage.items():
        if isinstance(value, bool):
            continue
        if key == "cost":
            if isinstance(value, (int, float)):
                total["cost"] = (total.get("cost") or 0.0) + value
            else:
                total.setdefault("cost", None)
        elif isinstance(value, int):
            total[key] = total.get(key, 0) + value


async def _sessions_show(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    descendants: list[tuple[int, StoredSession]] = []
    async with _open_store(_store_path(args), must_exist=args.id) as store:
        try:
            stored = await store.load(args.id)
        except SessionNotFound:
            raise CliError(f"no session {args.id!r} in {store.path}", EXIT_USAGE) from None
        if args.tree:
            children: dict[str, list[str]] = {}
            for info in reversed(await store.list()):  # oldest first
                if info.parent_session_id is not None:
                    children.setdefault(info.parent_session_id, []).append(info.id)
            stack = [(1, sid) for sid in reversed(children.get(args.id, []))]
            seen = {args.id}
            while stack:
                depth, sid = stack.pop()
                if sid in seen:
                    continue  # a cycle in hand-edited meta must not loop
                seen.add(sid)
                descendants.append((depth, await store.load(sid)))
                stack += [(depth + 1, kid) for kid in reversed(children.get(sid, []))]
    if args.json:
        for e in stored.events:
            out.write(_json_text({"seq": e.seq, "type": e.type, "turn": e.turn, "data": e.data}))
            out.write("\n")
        return EXIT_OK
    cwd = stored.meta.get("cwd")
    out.write(f"session {stored.id}" + (f" (cwd {cwd})" if cwd else "") + "\n")
    for line in transcript(stored.events):
        out.write(line + "\n")
    tree = _usage_total(stored.events)
    note = _usage_note({"usage": tree})
    if note:
        out.write(f"session total{note}\n")
    for depth, child in descendants:
        pad = "  " * depth
        out.write(f"{pad}session {child.id}\n")
        for line in transcript(child.events):
            out.write(pad + line.replace("\n", "\n" + pad) + "\n")
        own = _usage_total(child.events)
        note = _usage_note({"usage": own})
        if note:
            out.write(f"{pad}session total{note}\n")
        _add_usage(tree, own)
    if args.tree:
        note = _usage_note({"usage": tree})
        count = 1 + len(descendants)
        out.write(f"tree total ({count} session{'s' if count > 1 else ''}){note}\n")
    return EXIT_OK
