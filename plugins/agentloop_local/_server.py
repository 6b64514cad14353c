"""Child-process entry point: serve a GGUF model over llama.cpp's HTTP server until stopped.

``python -m agentloop_local._server --model PATH --port N --ctx N --threads N
[--chat-template-file F] [--alias NAME] [--exit-on-stdin-eof]``

The context size and thread count have no defaults here: the plugin always passes its own
(see ``agentloop_local.local``), so they are decided in one place.

``xllamacpp.Server`` serves from threads inside the calling process, so it runs in a process
of its own that the plugin can stop. The process exits on SIGTERM or SIGINT, and with
``--exit-on-stdin-eof`` also when its standard input reaches end of file (its parent died).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from importlib import resources

__all__ = ["DEFAULT_TEMPLATE", "main", "default_chat_template"]

DEFAULT_TEMPLATE = "chat_template.jinja"
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def default_chat_template() -> str:
    """The packaged Gemma-style chat template (the model's GGUF has none)."""
    return resources.files(__package__ or "agentloop_local").joinpath(DEFAULT_TEMPLATE).read_text(
        encoding="utf-8"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m agentloop_local._server",
        description="Serve a GGUF model with llama.cpp's OpenAI-compatible server.",
    )
    parser.add_argument("--model", required=True, help="path of the .gguf file")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ctx", type=int, required=True, help="context window in tokens")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--chat-template-file", help="Jinja chat template (default: packaged)")
    parser.add_argument("--alias", default=None, help="the model name the server reports")
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    return parser


def _watch_stdin() -> None:
    while os.read(sys.stdin.fileno(), 65536):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the server, block until a stop signal, and exit without unwinding its threads."""
    args = _parser().parse_args(argv)
    import xllamacpp

    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    else:
        template = default_chat_template()
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.use_jinja = True
    params.chat_template = template
    if args.alias:
        params.model_alias = {args.alias}
    # Blocked before the server's threads exist, so they inherit the mask and only sigwait
    # below receives the stop signals.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        server = xllamacpp.Server(params)
    except Exception as exc:  # noqa: BLE001 - reported as one line to the parent
        print(f"agentloop_local: cannot start the model server: {exc}", file=sys.stderr)
        return 1
    if args.exit_on_stdin_eof:
        threading.Thread(target=_watch_stdin, name="stdin-eof", daemon=True).start()
    signal.sigwait(_STOP_SIGNALS)
    del server
    sys.stdout.flush()
    sys.stderr.flush()
    # The server's threads hold no state worth unwinding; joining them can take seconds.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
