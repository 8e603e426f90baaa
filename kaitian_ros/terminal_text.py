"""Text from the wire made safe for a terminal."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with control characters shown escaped (``\\x1b``), not sent to the terminal:
    node ids, labels and reasons come from any publisher on the graph."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
