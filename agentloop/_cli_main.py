"""The ``agentloop`` command's entry: the argument parser, ``main`` and the dispatch to each
subcommand (the chat, on a terminal UI or plain lines; the protocol servers; the inspector;
a serving runtime of a fleet).

It sits above every other command-line module and nothing imports it, so the modules it
dispatches to (``_cli``'s shared parts, ``_cli_screen``, ``_cli_acp``, ``_cli_mcp_serve``,
``_cli_ui``, ``_cli_serve``) never import one another in a circle. ``docs/cli.md``
describes the commands.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Final, NoReturn, TextIO

import attrs
import trio

from agentloop import (
    AgentLoopError,
    ConfigError,
    InvalidContent,
    PersistenceConfig,
    PersistenceError,
    SessionNotFound,
    __version__,
)

from ._cli import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    Plan,
    Printer,
    _Chat,
    _fail,
    _fresh_id,
    _interrupts,
    _isatty,
    _LineSource,
    _positive_int,
    _restore_terminal,
    _run,
    _runtime,
    _sessions_list,
    _sessions_show,
    _store_path,
    _terminal_state,
    make_plan,
)

__all__ = ["main", "build_parser"]


# --- chat: a terminal UI or plain lines -------------------------------------------------------


async def _chat(args: argparse.Namespace, plan: Plan, out: TextIO, err: TextIO) -> int:
    from ._cli_screen import _chat_on_screen, _screen_fits

    if _screen_fits(args, out, err):
        return await _chat_on_screen(plan, out, err)
    tty = _isatty(sys.stdin)
    source = _LineSource(tty, err=err)
    source.setup()
    session_id: str | None = None
    code = EXIT_INTERRUPTED
    saved = _terminal_state() if tty else None
    try:
        async with (
            _interrupts() as interrupts,
            _runtime(plan, os.environ, err, compact=True) as rt,
            trio.open_nursery() as nursery,
        ):
            tx, rx = trio.open_memory_channel[str](0)
            nursery.start_soon(source.feed, tx)
            chat = _Chat(plan, rt, out, err, interrupts, rx, tty, plan.options, Printer(out, err))
            try:
                await chat.sessions(plan.resume or plan.session or _fresh_id("chat"))
            finally:
                session_id = chat.session_id
            code = chat.code
            nursery.cancel_scope.cancel()
    finally:
        source.save()
        _restore_terminal(saved)
    if session_id is not None and plan.db is not None and not plan.quiet:
        err.write(f"session: {session_id}\n")
    return code


# --- argument parsing and main --------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line and a hint, not argparse's usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE,
            f"{PROG}: error: {message}\nhint: {self.prog} --help shows the options\n",
        )


def _common_options() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="a TOML config file")
    common.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    common.add_argument(
        "-q", "--quiet", action="store_true",
        help="no header line, progress or session line on stderr (warnings and errors stay)",
    )
    return common


def _add_agent_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", metavar="P",
                        help="a configured provider, openai, deepseek, anthropic or local "
                        "(default: see providers below)")
    parser.add_argument("--model", metavar="M",
                        help="model name for the provider (default: the provider's own)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--session", metavar="ID", help="use this session id (resumed if stored)")
    which.add_argument("--resume", metavar="ID", help="continue a stored session")
    parser.add_argument("--max-tokens", type=_positive_int, metavar="N",
                        help="completion limit per model call (default: the provider's; 256 "
                        "for the local model)")
    parser.add_argument("--db", metavar="PATH",
                        help="the SQLite session store (default: the config's [persistence], "
                        "else ~/.local/share/agentloop/sessions.db)")
    parser.add_argument("--no-persist", action="store_true", help="do not store the session")


class _Help(argparse.RawDescriptionHelpFormatter):
    """A default shown after each option that has one; the epilog's examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: {action.default})"


_PROVIDERS_HELP: Final = """\
providers (the first that applies): --provider/--model; the config file's first agent or
provider; an API key in the environment (OPENAI_API_KEY: openai, gpt-4o-mini;
DEEPSEEK_API_KEY: deepseek, deepseek-chat; ANTHROPIC_API_KEY: anthropic,
claude-3-5-haiku-latest); a <NAME>_BASE_URL alone, for a server that takes no key
(llama.cpp, Ollama, vLLM); else the packaged local model (the [local] extra; its first
start assembles about 250 MB in a second or two, later starts take about two seconds)."""

_EXAMPLES: Final = f"""\
examples:
  {PROG} run "Write a haiku about structured concurrency."
  OPENAI_BASE_URL=http://127.0.0.1:8080/v1 {PROG} run --model qwen3 "Hello"   # llama.cpp
  OPENAI_BASE_URL=http://127.0.0.1:11434/v1 {PROG} chat --model llama3.2       # Ollama
  {PROG} run --provider deepseek --model deepseek-reasoner "Why is the sky blue?"
  {PROG} run --resume run-1a2b3c4d "And now in French."
  {PROG} sessions list

{_PROVIDERS_HELP}"""


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``agentloop`` argument parser."""
    common = _common_options()
    parser = _Parser(prog=PROG, description="Run LLM agents on the agentloop runtime.",
                     epilog=_EXAMPLES, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", parents=[common], help="run one prompt and stream the answer",
                              epilog=_EXAMPLES, formatter_class=_Help)
    _add_agent_options(run)
    run.add_argument("prompt", metavar="PROMPT", help="the prompt ('-' reads it from stdin)")
    chat = commands.add_parser("chat", parents=[common], help="chat in one session",
                               epilog=_EXAMPLES, formatter_class=_Help)
    _add_agent_options(chat)
    chat.add_argument("--plain", action="store_true",
                      help="line input (readline) and plain text, not the terminal UI")
    sessions = commands.add_parser("sessions", help="read stored sessions")
    which = sessions.add_subparsers(dest="sessions_command", required=True, metavar="ACTION")
    listing = which.add_parser("list", parents=[common], help="list stored sessions")
    listing.add_argument("--db", metavar="PATH", help="the session store")
    show = which.add_parser("show", parents=[common], help="print a session's transcript")
    show.add_argument("id", metavar="ID")
    form = show.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="the raw log, one JSON object a line")
    form.add_argument("--tree", action="store_true",
                      help="then its sub-agents' sessions, indented under their parents")
    show.add_argument("--db", metavar="PATH", help="the session store")
    tail = which.add_parser(
        "tail", parents=[common],
        help="print a session's events from a seq; --follow: then live as they are written",
    )
    tail.add_argument("id", metavar="ID")
    tail.add_argument("--from-seq", type=_nonnegative, default=0, metavar="N",
                      help="the first seq to print (default: from the start)")
    tail.add_argument("--follow", "-f", action="store_true",
                      help="keep printing new events (PostgreSQL: written by any runtime; "
                           "SQLite: by this process only)")
    tail.add_argument("--json", action="store_true", help="one JSON object a line")
    tail.add_argument("--db", metavar="PATH", help="the session store (a path or a DSN)")
    serve = commands.add_parser(
        "mcp-serve", parents=[common],
        help="serve the configured agents as an MCP server over stdio (tool: ask)",
    )
    _add_agent_options(serve)
    serve.add_argument("--agent", metavar="ID", help="serve only this configured agent")
    acp = commands.add_parser(
        "acp", parents=[common],
        help="serve an agent to an editor over the Agent Client Protocol on stdio",
    )
    _add_agent_options(acp)
    acp.add_argument("--agent", metavar="ID", help="the configured agent to serve")
    commands.add_parser(
        "serve", parents=[common],
        help="serve the sessions of a PostgreSQL store as one runtime of a fleet, until "
        "SIGTERM or Ctrl-C (the config's [persistence] and [fleet])",
    )
    ui = commands.add_parser("ui", parents=[common],
                             help="a web inspector of the sessions (the 'ui' extra)")
    ui.add_argument("--provider", metavar="P", help="provider route for new sessions")
    ui.add_argument("--model", metavar="M", help="model name for the provider")
    ui.add_argument("--db", metavar="PATH|DSN", help="the session store")
    ui.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks one)")
    ui.add_argument("--public", action="store_true",
                    help="allow a --host beyond loopback")
    ui.set_defaults(session=None, resume=None, max_tokens=None, no_persist=False)
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
    if isinstance(exc, SessionNotFound):
        return str(exc), EXIT_USAGE
    if isinstance(exc, InvalidContent):
        return f"the prompt cannot be sent: {exc}", EXIT_USAGE
    if isinstance(exc, PersistenceError):
        # Nearly always a store that cannot be opened or is not one: configuration.
        return f"session store: {exc}", EXIT_USAGE
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
    # The local model's one-time notes (tools it cannot see) are shown even when not verbose.
    local_logger = logging.getLogger("agentloop_local")
    local_handler = logging.StreamHandler(err)
    local_handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    local_previous = (local_logger.level, local_logger.propagate)
    local_logger.addHandler(local_handler)
    local_logger.setLevel(logging.INFO if verbose else logging.WARNING)
    local_logger.propagate = False

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]
        local_logger.removeHandler(local_handler)
        local_logger.setLevel(local_previous[0])
        local_logger.propagate = local_previous[1]

    return restore


async def _ui(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        from ._cli_ui import check_host, run_inspector
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise CliError(f"agentloop ui needs the 'ui' extra ({exc.name} is missing)") from None
    try:
        check_host(args.host, args.public)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    store = _store_path(args)
    plan = make_plan(args, os.environ)
    if store.startswith(("postgresql://", "postgres://")):
        # The runtime drives what it resumes, so it opens the store itself (with leases).
        plan = attrs.evolve(plan, db=None, config=attrs.evolve(
            plan.config, persistence=PersistenceConfig(backend="postgres", dsn=store)))
    else:
        plan = attrs.evolve(plan, db=store)
    # Ctrl-C stops serving through a cancel scope, so the runtime closes as on any exit:
    # the agents the inspector resumed are disposed and flushed first.
    async with _interrupts() as interrupts, _runtime(plan, os.environ, err) as rt:
        await run_inspector(rt, host=args.host, port=args.port, store=store,
                            agent_options=plan.options, out=out)
    return EXIT_INTERRUPTED if interrupts.seen else EXIT_OK


def _dispatch(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.command == "ui":
        return trio.run(_ui, args, out, err)
    if args.command == "serve":
        from ._cli_serve import serve

        return trio.run(serve, args, out, err)
    if args.command == "sessions":
        if args.sessions_command == "list":
            return trio.run(_sessions_list, args, out, err)
        if args.sessions_command == "tail":
            from ._cli_tail import sessions_tail

            try:
                return trio.run(sessions_tail, args, out, err)
            except KeyboardInterrupt:
                return EXIT_INTERRUPTED
        return trio.run(_sessions_show, args, out, err)
    plan = make_plan(args, os.environ)
    if args.command == "mcp-serve":
        from ._cli_mcp_serve import mcp_serve

        return trio.run(mcp_serve, args, plan, out, err)
    if args.command == "acp":
        from ._cli_acp import serve_acp

        return trio.run(serve_acp, args, plan, out, err)
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
        if isinstance(reported, BrokenPipeError):
            # The reader went away (``| head``): it has what it wanted.
            _silence(out)
            return EXIT_OK
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
        _silence(out)
    except (OSError, ValueError):
        pass


def _silence(out: TextIO) -> None:
    # Keep interpreter shutdown from failing to flush into the closed pipe again.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
