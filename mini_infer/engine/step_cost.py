"""What a step costs: the scheduler's model of a step's time from its shape, learnt from the steps it runs.

A step's time on this machine is modelled as fixed + per_token x tokens + per_position x attended positions:
the fixed part is what every step pays (the weights' read, launches, the host's work), the per-token part the
matmuls' compute, the per-position part attention (a token at position p attends to p + 1 positions). The model
fits the three by least squares of the relative error (so that the short decoding steps whose length it decides
weigh as much as long prefill-only ones) over the most recent steps, kept in two windows, steps with prompt tokens and
decode-only steps, so that a long run of decode steps does not wash out what prompts cost. Timings on these
machines drift by tens of per cent over minutes; a model refitted as the steps come follows them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 64  # steps of each kind the fit keeps
MIN_STEPS = 2  # a model with fewer steps of prompt tokens predicts nothing yet


@dataclass(slots=True)
class StepShape:
    """A step's size: tokens computed, positions attended (summed over its tokens), the requests that decode in it
    (one token past their prompt) and the other tokens (prompt chunks, recomputation)."""

    tokens: int = 0
    positions: int = 0
    decodes: int = 0
    prompt_tokens: int = 0

    def add(self, num_new: int, num_computed: int, num_prompt: int) -> None:
        """A request computing `num_new` tokens after `num_computed` cached ones, of a `num_prompt`-token prompt."""
        self.tokens += num_new
        self.positions += attended(num_new, num_computed)
        if num_new == 1 and num_computed >= num_prompt:
            self.decodes += 1
        else:
            self.prompt_tokens += num_new

    def with_chunk(self, num_new: int, num_computed: int) -> StepShape:
        """This shape plus a prompt chunk of `num_new` tokens after `num_computed`."""
        return StepShape(self.tokens + num_new, self.positions + attended(num_new, num_computed), self.decodes,
                         self.prompt_tokens + num_new)


def attended(num_new: int, num_computed: int) -> int:
    """Positions that `num_new` tokens after `num_computed` attend to: (c + 1) + ... + (c + n)."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


class StepCost:
    """The interface the scheduler uses (a fake one in the tests): predicted seconds for a step shape, or None
    while the model knows too little; and the measured time of a step."""

    def predict(self, shape: StepShape) -> float | None:
        raise NotImplementedError

    def observe(self, shape: StepShape, seconds: float) -> None:
        raise NotImplementedError


class OnlineStepCost(StepCost):
    """Least squares over the recent steps (module docstring): the normal equations' sums are kept as steps come
    and go, and solved when a prediction follows new steps."""

    def __init__(self) -> None:
        self._windows = {True: deque(), False: deque()}  # steps with prompt tokens, decode-only steps
        self._gram = [[0.0] * 3 for _ in range(3)]
        self._moment = [0.0] * 3
        self._coef: tuple[float, float, float] | None = None
        self._stale = False

    def observe(self, shape: StepShape, seconds: float) -> None:
        window = self._windows[shape.prompt_tokens > 0]
        window.append((features(shape), seconds))
        self._accumulate(*window[-1], 1.0)
        if len(window) > WINDOW:
            self._accumulate(*window.popleft(), -1.0)
        self._stale = True

    def _accumulate(self, x: tuple[float, float, float], seconds: float, sign: float) -> None:
        weight = sign / (seconds * seconds)  # relative errors: a 60 ms step counts as much as a 600 ms one
        for i in range(3):
            self._moment[i] += weight * x[i] * seconds
            for j in range(3):
                self._gram[i][j] += weight * x[i] * x[j]

    def predict(self, shape: StepShape) -> float | None:
        coef = self.coefficients
        return None if coef is None else sum(c * x for c, x in zip(coef, features(shape)))

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed s, s per token, s per attended position) for the steps seen (None before MIN_STEPS with prompt
        tokens)."""
        if self._stale:
            self._coef = solve(self._gram, self._moment) if len(self._windows[True]) >= MIN_STEPS else None
            self._stale = False
        return self._coef


def features(shape: StepShape) -> tuple[float, float, float]:
    return 1.0, float(shape.tokens), float(shape.positions)


def solve(gram: list[list[float]], moment: list[float]) -> tuple[float, float, float]:
    """Least-squares (fixed, per_token, per_position) >= 0 from the normal equations; a coefficient the steps do
    not determine (or that fits below 0) is dropped and the rest refitted without it."""
    active = [0, 1, 2]
    while active:
        coef = _solve_active(gram, moment, active)
        if coef is not None and all(c >= 0 for c in coef):
            full = [0.0, 0.0, 0.0]
            for index, c in zip(active, coef):
                full[index] = c
            return full[0], full[1], full[2]
        # the most negative coefficient goes, or, for a singular system, the last one
        active.remove(active[-1] if coef is None else active[min(range(len(coef)), key=coef.__getitem__)])
    return 0.0, 0.0, 0.0


def _solve_active(gram: list[list[float]], moment: list[float], active: list[int]) -> list[float] | None:
    """Gaussian elimination over the active columns, scaled to unit diagonal; None when singular."""
    n = len(active)
    scale = [gram[i][i] ** 0.5 or 1.0 for i in active]
    a = [[gram[active[i]][active[j]] / (scale[i] * scale[j]) for j in range(n)] for i in range(n)]
    b = [moment[active[i]] / scale[i] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-9:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n):
                a[r][k] -= f * a[col][k]
            b[r] -= f * b[col]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (b[r] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return [x[i] / scale[i] for i in range(n)]
