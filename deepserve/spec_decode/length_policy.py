"""How many drafts each sequence verifies this step (DeepInfer's verification-length scheduler, §6.4).

Verifying a draft costs a query row in the step; it pays only if the draft is accepted. With a cost curve
`cost(g)` (step time in ms for g query rows) and each draft's cumulative acceptance probability
a(s, j) = prod_{i <= j} conf(s, i), the policy picks the number t of extra rows maximising expected tokens per ms:

    cands = all (seq, draft j) sorted by a descending (ties: lower seq, then lower j)
    t* = argmax_t (S + sum of the top t a's) / cost(S + t)        (S = decoding sequences; first best wins)

and gives sequence s the drafts it owns among the top t*. Since a(s, j) never rises with j, the top t of a sequence
are always its first ones. Points beyond the curve's largest size are never chosen.

The curve (`StepCostModel`) starts from a start-up measurement (or a file) and follows the live steps. DeepInfer
times the forward alone with CUDA events and fits a per-row slope to the excess over the profile. We time whole
steps on the host (scheduling, sampling and verification included), whose excess is mostly a per-step overhead,
not a per-row cost: read as a slope it would price every draft row as if it paid the step's host time, and the
policy would verify too few. So the excess of each size (the median of its samples over sizes with enough of them)
is fitted as overhead + slope * g (Theil-Sen: the median of pairwise slopes, then the median intercept; both
clamped at 0), and cost(g) = baseline(g) + overhead + slope * g.

The fit reads the whole window (up to 5000 samples: about 1.5 ms of Python), so it is redone once per
len(window) / REFITS_PER_WINDOW new samples, not every step (every step while the window is short): a small model's
GPU step takes well under a millisecond, and refitting each step cost confidence-scheduled speculation more than
its drafts saved (H200 runs of session 11).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

REFITS_PER_WINDOW = 100


class StepCostModel:
    """Step time in ms for g query rows: baseline(g) + overhead + slope * g.

    `padded=True` (CUDA graphs): a step of g rows costs the smallest captured size >= g. Otherwise the baseline is
    interpolated linearly between measured sizes (an eager step costs what its rows cost)."""

    def __init__(self, curve: list[tuple[int, float]], padded: bool = False, window: int = 5000,
                 min_samples: int = 10) -> None:
        if not curve:
            raise ValueError("a step cost curve needs at least one point")
        self.sizes = [int(g) for g, _ in sorted(curve)]
        self.ms = [float(m) for _, m in sorted(curve)]
        self.padded = padded
        self.min_samples = min_samples
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._since_fit = 0
        self.num_fits = 0
        self.slope = 0.0
        self.overhead = 0.0

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def baseline(self, g: int) -> float | None:
        """The start-up cost of g rows; None beyond the curve."""
        if g > self.sizes[-1]:
            return None
        i = bisect.bisect_left(self.sizes, g)
        if self.padded or self.sizes[i] == g or i == 0:
            return self.ms[i]
        g0, g1, m0, m1 = self.sizes[i - 1], self.sizes[i], self.ms[i - 1], self.ms[i]
        return m0 + (m1 - m0) * (g - g0) / (g1 - g0)

    def cost(self, g: int) -> float | None:
        base = self.baseline(g)
        return None if base is None else base + self.overhead + self.slope * g

    def observe(self, g: int, measured_ms: float) -> None:
        """A live step of g rows took `measured_ms`: refresh the online overhead and slope."""
        base = self.baseline(g)
        if base is None:
            return
        self._samples.append((g, measured_ms - base))
        self._since_fit += 1
        if self._since_fit >= max(1, len(self._samples) // REFITS_PER_WINDOW):
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        self.num_fits += 1
        by_size: dict[int, list[tuple[int, float]]] = {}
        for size, excess in self._samples:
            by_size.setdefault(self._bucket(size), []).append((size, excess))
        points = [(statistics.median(g for g, _ in v), statistics.median(e for _, e in v))
                  for v in by_size.values() if len(v) >= self.min_samples]
        if not points:
            return
        pair_slopes = [(e1 - e0) / (g1 - g0) for i, (g0, e0) in enumerate(points) for g1, e1 in points[i + 1:]
                       if g1 != g0]
        self.slope = max(statistics.median(pair_slopes), 0.0) if pair_slopes else 0.0
        self.overhead = max(statistics.median(e - self.slope * g for g, e in points), 0.0)

    def _bucket(self, g: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, g)]


def cumulative_acceptance(confidences: list[float]) -> list[float]:
    out, a = [], 1.0
    for c in confidences:
        a *= min(max(c, 0.0), 1.0)
        out.append(a)
    return out


def choose_verify_lengths(confidences: list[list[float]], cost) -> list[int]:
    """Drafts to verify per sequence. `confidences[s]`: per-draft confidences of sequence s (its proposed drafts;
    empty: none); `cost(g)`: ms of a step of g rows, None when g is beyond what can run."""
    num_seqs = len(confidences)
    if num_seqs == 0:
        return []
    base = cost(num_seqs)
    if base is None:
        return [0] * num_seqs
    cands = sorted(((a, s, j) for s, conf in enumerate(confidences) for j, a in enumerate(cumulative_acceptance(conf))),
                   key=lambda c: (-c[0], c[1], c[2]))
    best_t, best_value, expected = 0, num_seqs / base, float(num_seqs)
    for t, (a, _, _) in enumerate(cands, start=1):
        expected += a
        c = cost(num_seqs + t)
        if c is None:
            break                       # sizes beyond the curve are skipped, and every later t is beyond it too
        if expected / c > best_value:   # strictly greater: the smallest t wins a tie
            best_t, best_value = t, expected / c
    lengths = [0] * num_seqs
    for _, s, _ in cands[:best_t]:
        lengths[s] += 1
    return lengths
