"""Checks several core test modules share: a plan's ownership and halo invariants, and the
split-equals-single-device tolerance."""

from __future__ import annotations

import torch

TOLERANCE = 1e-4  # max abs error relative to the reference's max magnitude


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """`out` equals the single-device `ref` within TOLERANCE of its scale (and is finite)."""
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = float((out - ref).abs().max())
    assert err <= TOLERANCE * float(ref.abs().max()), err


def assert_plan_invariants(g, plan) -> None:
    """Every output row of every segment owned exactly once (contiguous, node order); the halo
    rows a node receives are exactly the input rows it reads but did not compute itself, each
    sent once by the node that owns it."""
    ids = plan.node_ids
    assert plan.segments[0].in_value == 0 and plan.segments[-1].out_value == g.output_value
    for k, seg in enumerate(plan.segments):
        assert seg.in_value == (0 if k == 0 else plan.segments[k - 1].out_value)
        owned = [r for lo, hi in seg.out_rows for r in range(lo, hi)]
        assert owned == list(range(g.value_shapes[seg.out_value][1]))
        if k == 0:
            assert not seg.halos
            continue
        prev = plan.segments[k - 1].out_rows
        for i, n in enumerate(ids):
            lo, hi = seg.in_rows[i]
            missing = {r for r in range(lo, hi) if not prev[i][0] <= r < prev[i][1]}
            got = [r for h in plan.halo_sources(n, k) for r in range(h.lo, h.hi)]
            assert sorted(got) == sorted(missing) and len(got) == len(set(got))
            for h in plan.halo_sources(n, k):  # the sender owns what it sends
                j = ids.index(h.src)
                assert h.src != n and prev[j][0] <= h.lo < h.hi <= prev[j][1]
