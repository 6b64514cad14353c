"""Trio's scheduling tie-breaks, seeded per race so that an order can be searched and replayed.

Trio runs the tasks that became ready at one instant in an order drawn from one module-level
``random.Random`` (shuffled under hypothesis, reversed half the time otherwise). Hypothesis
reseeds that random the same way before every example, so without this module every operation
list is tried in one order only. ``seeded(seed)`` seeds it for one ``trio.run`` and restores
it afterwards: the same operations with the same seed take the same interleaving.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import random
from collections.abc import Iterator

__all__ = ["scheduler_random", "seeded"]

# Trio has no public API for its scheduler's random (the documented hook is hypothesis's
# ``register_random``, which fixes it rather than searching it), so this is read from the one
# module that defines it, by name, and checked: a trio that moves it fails here, loudly.
_TRIO_RUN = "trio._core._run"
_TRIO_RANDOM = "_r"


def scheduler_random() -> random.Random:
    """The ``random.Random`` trio's run loop draws its tie-breaks from."""
    module = importlib.import_module(_TRIO_RUN)
    rng = getattr(module, _TRIO_RANDOM, None)
    if not isinstance(rng, random.Random):
        raise RuntimeError(
            f"this trio keeps no scheduler random at {_TRIO_RUN}.{_TRIO_RANDOM} (found "
            f"{rng!r}); run_race cannot seed its tie-breaks"
        )
    return rng


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed trio's tie-breaks with ``seed`` for the block; restore the previous state after."""
    rng = scheduler_random()
    before = rng.getstate()
    rng.seed(seed)
    # The cyclic collector runs when the process's allocation count says so, and a collected
    # async generator is finalized by a task trio schedules then: with it running, the same
    # seed could take another interleaving after other work in the process. Within the block
    # only reference counts free objects, which the operations decide.
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        rng.setstate(before)
