"""How a compute node's preparation in a warm interpreter or a fork server ended
(`compute_prepare.prepare`). Apart from it because the launcher reads the fork server's answer
and never imports torch, which `compute_prepare` does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

Outcome = Literal["built", "already", "refused"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)


@dataclass(frozen=True)
class Preparation:
    """How a `prepare` ended: `outcome` "built" (model built, costs measured), "already" (an
    earlier preparation did it: nothing to report) or "refused" (nothing prepared; the node
    then prepares itself or refuses its parameters), and `text` for the log."""

    outcome: Outcome
    text: str

    @property
    def news(self) -> bool:
        """Worth a line in the launcher's or the interpreter's log (not a repeat)."""
        return self.outcome != "already"

    def to_dict(self) -> dict[str, str]:
        return {"outcome": self.outcome, "text": self.text}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Preparation:
        """From a fork server's reply (ValueError: not one)."""
        outcome, text = d.get("outcome"), d.get("text")
        if outcome not in OUTCOMES or not isinstance(text, str):
            raise ValueError(f"not a preparation: {d!r}"[:300])
        return Preparation(cast(Outcome, outcome), text)


def refused(why: str) -> Preparation:
    return Preparation("refused", f"not prepared: {why}")
