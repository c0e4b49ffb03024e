"""Arrival schedules for open-loop load, precomputed from a seed.

Inter-arrival gaps: `poisson` exponential with mean 1/rate; `gamma` with shape
= burstiness and scale = 1/(rate * burstiness) (vLLM's convention: the mean
gap stays 1/rate, burstiness < 1 clusters arrivals, > 1 evens them out, 1 is
Poisson); `constant` exactly 1/rate. The first arrival is at 0. The schedule
is not rescaled to hit a nominal end time: the achieved rate is measured.
"""

from __future__ import annotations

import numpy as np


def gaps(n: int, rate: float, arrival: str = "poisson", burstiness: float = 1.0, seed=0) -> np.ndarray:
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = np.random.default_rng(_seed(seed))
    if arrival == "constant":
        return np.full(n, 1.0 / rate)
    if arrival == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    if arrival == "gamma":
        if burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    raise ValueError(f"unknown arrival process {arrival!r}")


def arrivals(rate: float, *, count: int | None = None, duration_s: float | None = None, arrival: str = "poisson",
             burstiness: float = 1.0, seed=0) -> list[float]:
    """Arrival offsets in seconds: `count` of them, or all that fall before `duration_s`."""
    if count is None and duration_s is None:
        raise ValueError("give count or duration_s")
    if count is not None:
        g = gaps(count, rate, arrival, burstiness, seed)
        return [0.0, *np.cumsum(g[:-1]).tolist()][:count]
    # Draw in blocks until the horizon is passed; the same seed gives the same prefix.
    assert duration_s is not None  # checked above
    n = max(16, int(rate * duration_s * 1.5) + 16)
    while True:
        g = gaps(n, rate, arrival, burstiness, seed)
        t = np.concatenate([[0.0], np.cumsum(g[:-1])])
        if t[-1] >= duration_s:
            return t[t < duration_s].tolist()
        n *= 2


def _seed(seed) -> int:
    # numpy wants ints; levels are mixed into the seed as strings elsewhere
    if isinstance(seed, int):
        return seed & 0xFFFFFFFF
    import hashlib

    return int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:4], "little")
