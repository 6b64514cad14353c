"""A child process on a pseudo-terminal, for the tests that drive ``agentloop chat`` by keys.

The child runs on the slave side of a pty (Python's ``pty`` module, always there), so line
editing, Ctrl-C (the terminal's interrupt character, turned into SIGINT by the line
discipline) and Ctrl-D (end of input) behave as at a keyboard. ``test_cli_terminal`` reads
what it writes as text; ``test_cli_tui`` draws it on an emulated screen.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import struct
import termios
import time
from pathlib import Path

CTRL_C, CTRL_D = "\x03", "\x04"


def terminal_env(tmp_path: Path, term: str, *, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a chat child: no provider keys or base URL, data and
    cache under ``tmp_path``, ``TERM`` as given, unbuffered; ``drop`` names more to leave out."""
    unset = ("OPENAI_API_KEY", "DEEPSEEK_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL",
             "NO_COLOR", *drop)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               TERM=term, PYTHONUNBUFFERED="1")
    return env


class PtyChild:
    """``argv`` run on a pty (sized ``rows`` x ``columns`` before exec, when given)."""

    def __init__(
        self, argv: list[str], env: dict[str, str], size: tuple[int, int] | None = None
    ) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the pty is its controlling terminal
            try:
                if size is not None:
                    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.status: int | None = None
        self.closed = False  # the child closed its side of the pty

    def type(self, keys: str) -> float:
        os.write(self.fd, keys.encode())
        return time.monotonic()

    def read(self, timeout: float, size: int = 65536) -> bytes:
        """What the child wrote within ``timeout`` (``b""`` if nothing); sets ``closed`` once
        it has gone."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return b""
        try:
            chunk = os.read(self.fd, size)
        except OSError:  # EIO: the child has gone
            chunk = b""
        if chunk:
            self.received(chunk)
        else:
            self.closed = True
        return chunk

    def received(self, chunk: bytes) -> None:
        """What a subclass does with what the child writes (as it is read)."""

    def shown(self) -> str:
        """What the child has shown, for a failure's message."""
        return ""

    def wait(self, timeout: float = 60.0) -> int:
        """The child's exit status, reading what it writes until it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.closed:
                self.read(0.05)
            status = self.reaped()
            if status is not None:
                return status
            if self.closed:
                time.sleep(0.05)  # the child closed the pty and is exiting: poll its status
        raise AssertionError(f"the chat did not exit; it shows:\n{self.shown()}")

    def reaped(self) -> int | None:
        """The child's exit status once it has exited (reaping it), else None."""
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def close(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
        os.close(self.fd)
