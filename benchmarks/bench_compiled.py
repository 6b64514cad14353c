"""What compiling the per-step modules with mypyc gives, and whether it still behaves.

    python benchmarks/bench_compiled.py [--modules _session,_reply,...] [--rounds 5]
        [--yardstick ../shared/bench] [--keep DIR]

A copy of ``agentloop`` (and ``plugins``) is made in a temporary folder and the modules named
by ``--modules`` are compiled there by ``mypyc`` (it comes with ``mypy``, the ``dev`` extra;
a C compiler is needed). Then:

1. the copy runs a turn whose first model call fails and whose ``agent/request-error``
   handler asks for a retry: the answer must be the second call's ("ok"), as the pure
   modules give; then the construct that breaks it, alone (an ``await`` in ``finally``
   while an exception passes through), is called twice interpreted and compiled;
2. the yardstick's W1 (``bench_agentloop.py`` and the trio floor ``floor_trio.py`` from
   ``--yardstick``) is timed for the pure tree and the compiled copy, interleaved round by
   round, and the medians of the per-round ratios to the floor are printed.

The default modules are those the opt-in compiled build compiles (pyproject.toml's build
hook; ``docs/how-to/compiled.md``). Nothing here changes how the package is built: the
compiled copy lives only in the temporary folder, so other sets can be tried side by side.
About 2 minutes (the compile takes most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def built_modules() -> str:
    """The modules the opt-in compiled build compiles (pyproject.toml's build hook)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    hook = config["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["custom"]
    return ",".join(Path(path).stem for path in hook["include"])


DEFAULT = built_modules()

RETRY_CHECK = textwrap.dedent("""
    import trio, agentloop
    import agentloop.events as ev
    from agentloop.testing import ScriptedModel

    async def main():
        async with agentloop.open_runtime() as rt:
            rt.llm.register("scripted", ScriptedModel([
                agentloop.ProviderError("busy", status=503, code="overloaded"), "ok",
            ]))
            tried = []
            rt.events.on(ev.AgentRequestError,
                         lambda e: tried.append(e.error.message) or agentloop.Retry())
            options = agentloop.AgentOptions(provider="scripted", model="m")
            async with await rt.agents.create(session_id="s", agent_options=options) as h:
                text = None
                with trio.move_on_after(5):
                    text = (await h.agent.ask("hi")).text
            print(repr(text), len(tried), compiled.__file__.rsplit(".", 1)[-1])

    import importlib, sys
    compiled = importlib.import_module("agentloop." + sys.argv[1])
    trio.run(main)
""")


# The construct behind the wrong retry, alone: an ``await`` in ``finally`` while an exception
# passes through it. Compiled, a later call raises the earlier call's exception again.
AWAIT_IN_FINALLY = textwrap.dedent("""
    import trio


    async def inner(fail: bool) -> str:
        try:
            if fail:
                raise ValueError("busy")
            await trio.lowlevel.checkpoint()
        finally:
            await trio.lowlevel.checkpoint()
        return "ok"
""")

CALL_TWICE = textwrap.dedent("""
    import trio, finally_await

    async def main():
        answers = []
        for fail in (True, False):
            try:
                answers.append(await finally_await.inner(fail))
            except ValueError as exc:
                answers.append(f"ValueError({exc})")
        print(finally_await.__file__.rsplit(".", 1)[-1], *answers)

    trio.run(main)
""")


def await_in_finally(target: Path) -> str:
    """The two calls' answers, interpreted and compiled."""
    folder = target / "finally_await"
    folder.mkdir()
    (folder / "finally_await.py").write_text(AWAIT_IN_FINALLY)
    interpreted = run([sys.executable, "-c", CALL_TWICE], None, cwd=folder).strip()
    mypyc = Path(sys.executable).with_name("mypyc")
    out = subprocess.run([str(mypyc), "finally_await.py"], cwd=folder, capture_output=True,
                         text=True)
    if out.returncode != 0:
        return f"{interpreted}; not compiled: {out.stdout.splitlines()[-1:]}"
    compiled = run([sys.executable, "-c", CALL_TWICE], None, cwd=folder).strip()
    return f"{interpreted}; {compiled}"


def compile_copy(target: Path, modules: list[str]) -> None:
    for part in ("agentloop", "plugins"):
        shutil.copytree(ROOT / part, target / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    mypyc = Path(sys.executable).with_name("mypyc")
    files = [f"agentloop/{m}.py" for m in modules]
    # No pyproject.toml in the copy: mypyc's setuptools reads none.
    out = subprocess.run([str(mypyc), *files], cwd=target, capture_output=True, text=True,
                         env={**os.environ, "MYPYPATH": "plugins"})
    if out.returncode != 0:
        errors = [line for line in out.stdout.splitlines() if " error: " in line]
        raise SystemExit("mypyc failed:\n" + "\n".join(errors or out.stderr.splitlines()[-5:]))
    shutil.rmtree(target / "build", ignore_errors=True)


def run(cmd: list[str], pythonpath: str | None, cwd: Path | None = None) -> str:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    # cwd: ``python -c`` puts the working folder first on sys.path, before PYTHONPATH.
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout


def median_of(script: Path, pythonpath: str | None) -> float:
    out = run([sys.executable, str(script), "--workload", "w1", "--reps", "3", "--json"],
              pythonpath)
    return float(json.loads(out.strip().splitlines()[-1])["median"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", default=DEFAULT)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--yardstick", default=str(ROOT.parent / "shared" / "bench"))
    p.add_argument("--keep", help="compile into this folder (kept) instead of a temporary one")
    a = p.parse_args()
    modules = [m.strip() for m in a.modules.split(",") if m.strip()]
    bench = Path(a.yardstick)
    if not (bench / "bench_agentloop.py").exists():
        raise SystemExit(f"no yardstick at {bench} (bench_agentloop.py, floor_trio.py)")
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(a.keep or tmp)
        target.mkdir(parents=True, exist_ok=True)
        print(f"compiling {', '.join(modules)} ...", flush=True)
        compile_copy(target, modules)
        copy = f"{target}{os.pathsep}{target / 'plugins'}"
        answer, errors, loaded = run(
            [sys.executable, "-c", RETRY_CHECK, modules[0]], copy, cwd=target
        ).split()
        same = answer == repr("ok") and errors == "1"
        print(f"retry after a provider error, compiled (loaded from .{loaded}): answer "
              f"{answer} after {errors} request error(s): "
              + ("as the pure modules" if same else "WRONG, the pure modules answer 'ok' after 1"))
        print("an await in finally, two calls (fail, then not):",
              await_in_finally(target), flush=True)
        pure, compiled = [], []
        for i in range(a.rounds):
            floor = median_of(bench / "floor_trio.py", None)
            p_us = median_of(bench / "bench_agentloop.py", None)
            c_us = median_of(bench / "bench_agentloop.py", copy)
            pure.append(p_us / floor)
            compiled.append(c_us / floor)
            print(f"round {i + 1}: floor {floor:.1f} us/step, pure {p_us:.1f} "
                  f"({p_us / floor:.2f}x), compiled {c_us:.1f} ({c_us / floor:.2f}x)", flush=True)
        print(f"W1, x trio floor: pure {statistics.median(pure):.2f}x, "
              f"compiled {statistics.median(compiled):.2f}x")


if __name__ == "__main__":
    main()
