"""Row interval algebra: half-open row ranges ``[lo, hi)`` and sorted disjoint lists of them, as
the row maps of :mod:`kaitian_ros.core.graph`, the plans and the stripe executor use them."""

from __future__ import annotations

Interval = tuple[int, int]  # [lo, hi); empty when lo >= hi, canonical empty = (0, 0)
EMPTY: Interval = (0, 0)


def hull(a: Interval, b: Interval) -> Interval:
    if a[0] >= a[1]:
        return b if b[0] < b[1] else EMPTY
    if b[0] >= b[1]:
        return a
    return (min(a[0], b[0]), max(a[1], b[1]))


def intersect(a: Interval, b: Interval) -> Interval:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else EMPTY


def iv_add(ivs: list[Interval], new: Interval) -> list[Interval]:
    """Union of a sorted disjoint interval list with one interval (adjacent ones merge)."""
    lo, hi = new
    if lo >= hi:
        return ivs
    out: list[Interval] = []
    for a, b in ivs:
        if b < lo or a > hi:
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    out.append((lo, hi))
    out.sort()
    return out


def iv_intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if lo < hi:
            out.append((lo, hi))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def iv_sub(xs: list[Interval], cut: Interval) -> list[Interval]:
    out: list[Interval] = []
    for a, b in xs:
        if cut[1] <= a or cut[0] >= b or cut[0] >= cut[1]:
            out.append((a, b))
            continue
        if a < cut[0]:
            out.append((a, cut[0]))
        if cut[1] < b:
            out.append((cut[1], b))
    return out
