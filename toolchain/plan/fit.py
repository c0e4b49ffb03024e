"""The downhill-simplex search both fits of the performance model use: tools/fit_efficiency.py (the shipped
efficiency table, from AIConfigurator's measured runs) and `toolchain calibrate` (a user's row, from their own
reports, plan/calibrate.py). No derivatives: the model's predictions are piecewise (batch limits, bounds), so a
gradient would be as ragged as the model.
"""

from __future__ import annotations

from typing import Callable


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.5, iterations: int = 600,
                tol: float = 1e-7) -> list[float]:
    """The downhill simplex (Nelder and Mead, 1965) with the usual coefficients: reflect 1, expand 2, contract
    0.5, shrink 0.5."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centre, worst, strict=True)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centre, worst, strict=True)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centre, worst, strict=True)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, xs, strict=True)] for xs in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=lambda i: values[i])]
