"""training layer of kaitian_ros: collaborative training on torch.distributed (see docs/training.md).

Sits beside ``runtime`` and above ``core`` (it builds models with ``core.models``); see
docs/architecture.md.
"""
