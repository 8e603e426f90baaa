"""The names of the plan strategies, apart from the planner: the launcher checks a scenario's
parameters against them before any node starts, and importing the planner imports torch."""

from __future__ import annotations

STRATEGIES = ("stripes", "single", "layerwise")
STRATEGY_CHOICES = ("auto", *STRATEGIES)  # the coordinator's `strategy` parameter: auto picks one
