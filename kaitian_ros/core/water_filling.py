"""The finish-time model of the share policy (docs/policy.md): node i with share x_i of the rows
finishes at x_i * k_i + fixed_i; ``equalise_finish_time`` water-fills one common finish time
(sum x_i = 1), ``predicted_makespan`` evaluates any split."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _slopes(work: float, bytes_total: float, speeds: Sequence[float],
            link_rates: Sequence[float], fixed_ms: Sequence[float]) -> list[float]:
    n = len(speeds)
    if n == 0:
        raise ValueError("need at least one node")
    if len(link_rates) != n or len(fixed_ms) != n:
        raise ValueError("speeds, link_rates and fixed_ms must have the same length")
    if not (math.isfinite(work) and work > 0):
        raise ValueError(f"work must be finite and > 0, got {work!r}")
    if not (math.isfinite(bytes_total) and bytes_total >= 0):
        raise ValueError(f"bytes_total must be finite and >= 0, got {bytes_total!r}")
    k = []
    for s, link, f in zip(speeds, link_rates, fixed_ms):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"speeds must be finite and > 0, got {s!r}")
        if not (link > 0) or math.isnan(link):
            raise ValueError(f"link_rates must be > 0 (inf allowed), got {link!r}")
        if not (math.isfinite(f) and f >= 0):
            raise ValueError(f"fixed_ms must be finite and >= 0, got {f!r}")
        transfer = 0.0 if (bytes_total == 0 or math.isinf(link)) else bytes_total / link
        # Overlap model: compute and transfer of slabs overlap, so the slower one dominates.
        k.append(max(work / s, transfer))
    return k


def equalise_finish_time(work: float, bytes_total: float, speeds: Sequence[float],
                         link_rates: Sequence[float], fixed_ms: Sequence[float]
                         ) -> tuple[float, ...]:
    """Shares (>= 0, sum 1) that give every participating node the same predicted finish time.

    Exact water-filling instead of bisection: T_i = x_i*k_i + f_i is linear in x_i, so for the
    active set A (nodes with f_i < T) T = (1 + sum f_i/k_i) / sum 1/k_i. Nodes are added in
    increasing f_i while their fixed cost is below the current T; a node whose fixed cost alone
    exceeds T gets nothing. Deterministic, no tolerance loop.
    """
    k = _slopes(work, bytes_total, speeds, link_rates, fixed_ms)
    n = len(k)
    idx = sorted(range(n), key=lambda i: (fixed_ms[i], i))
    inv_sum = 0.0
    f_over_k = 0.0
    t = math.inf
    for i in idx:
        if fixed_ms[i] >= t:
            break
        inv_sum += 1.0 / k[i]
        f_over_k += fixed_ms[i] / k[i]
        t = (1.0 + f_over_k) / inv_sum
    x = [max(0.0, (t - fixed_ms[i]) / k[i]) for i in range(n)]
    total = sum(x)
    # Renormalise away rounding so the sum is 1 to ~1 ulp.
    return tuple(v / total for v in x)


def predicted_makespan(work: float, bytes_total: float, speeds: Sequence[float],
                       link_rates: Sequence[float], fixed_ms: Sequence[float],
                       shares: Sequence[float]) -> float:
    """max_i T_i over nodes with a positive share (a node with no rows does not take part)."""
    k = _slopes(work, bytes_total, speeds, link_rates, fixed_ms)
    if len(shares) != len(k):
        raise ValueError("shares must align with speeds")
    times = [x * ki + f for x, ki, f in zip(shares, k, fixed_ms) if x > 0]
    return max(times) if times else 0.0
