"""How a function's time grows with its input, for the promises of bounded time on whatever a
policy writes: a test asserts the growth (linear, not quadratic), never a second on the clock, so
it holds on a machine several times slower than the one it was written on."""

from __future__ import annotations

import time
from typing import Callable


def seconds(fn: Callable[[], object], floor: float = 0.02) -> float:
    """The best of three timings of `fn`, each repeated until it has run `floor` seconds."""
    best = float("inf")
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= floor:
                break
        best = min(best, elapsed / reps)
    return best


def growth(fn: Callable[[object], object], make: Callable[[int], object], n: int, factor: int = 8) -> float:
    """time(fn(make(factor * n))) / time(fn(make(n))): about `factor` for linear work, `factor`**2
    for quadratic."""
    small, large = make(n), make(factor * n)
    return seconds(lambda: fn(large)) / seconds(lambda: fn(small))


def assert_linear(fn: Callable[[object], object], make: Callable[[int], object], n: int, what: str) -> None:
    """Eight times the input takes at most 20 times as long (linear: about 8; quadratic: 64).

    Timings on a shared machine wobble, so a ratio over the bound is measured once more before it
    fails: a quadratic cost is over it every time."""
    ratios = []
    for _ in range(2):
        ratios.append(growth(fn, make, n))
        if ratios[-1] <= 20:
            return
    raise AssertionError(f"{what}: 8x the input took {min(ratios):.1f}x the time (linear: about 8x)")
