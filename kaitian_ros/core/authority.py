"""Versioned state from a restartable authority (the coordinator's plans, the scheduler's
assignments): which (incarnation, version) a listener should accept.

An authority picks a random non-zero 64-bit *incarnation* when it starts and numbers what it
publishes 1, 2, 3, ... within it. A listener tracks the incarnation it follows and the newest
version it accepted:

- the same incarnation, a version a little ahead (at most ``max_step``): accepted;
- the same incarnation and version again: a duplicate (a latched re-delivery), ignored quietly;
- the same incarnation, an older version or one implausibly far ahead: rejected with the reason
  (a version of 2**32 - 1 once sent all rows to one node for good);
- another incarnation: the authority restarted. Accepted, the listener resets its version
  bookkeeping (``reset``), and the incarnation it followed is retired: a late message of a
  retired incarnation is rejected, so two authorities cannot make a listener flap back;
- incarnation 0 or a first version above ``max_first``: rejected (not from an authority of this
  package, or forged).

Pure: no clock, no I/O. The listener owns one ``AuthorityTracker``.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass

MAX_VERSION_STEP = 1000   # a listener may miss versions (latched depth 1, a busy executor)
MAX_FIRST_VERSION = 2**30  # a year of one new version per second is 2**25
RETIRED_KEPT = 16


def new_incarnation() -> int:
    """A random non-zero 64-bit incarnation id."""
    return secrets.randbits(64) | 1


@dataclass(frozen=True)
class Verdict:
    accept: bool
    reset: bool = False  # a new incarnation: drop what was kept for the old one
    reason: str = ""     # why not accepted ("" for a quiet duplicate), or the reset's reason

    @property
    def rejected(self) -> bool:
        return not self.accept and bool(self.reason)


class AuthorityTracker:
    """The incarnation and newest version a listener follows, for one authority."""

    def __init__(self, what: str, *, max_step: int = MAX_VERSION_STEP, max_first: int = MAX_FIRST_VERSION) -> None:
        self.what = what
        self.max_step = max_step
        self.max_first = max_first
        self.incarnation = 0
        self.version = 0
        self.restarts = 0  # incarnations followed after the first
        self._retired: collections.deque[int] = collections.deque(maxlen=RETIRED_KEPT)

    def check(self, incarnation: int, version: int) -> Verdict:
        """Whether to accept ``version`` of ``incarnation``; on accept the tracker moves to it."""
        who = f"{self.what} incarnation {incarnation:016x}"
        if incarnation == 0:
            return Verdict(False, reason=f"no incarnation: {self.what} v{version} carries incarnation 0")
        if version < 1:
            return Verdict(False, reason=f"implausible version: {who} v{version}")
        if incarnation == self.incarnation:
            if version == self.version:
                return Verdict(False)
            if version < self.version:
                return Verdict(False, reason=f"stale version: {who} v{version} after v{self.version}")
            if version - self.version > self.max_step:
                return Verdict(False, reason=f"implausible version: {who} jumps from v{self.version} to "
                                             f"v{version} (at most +{self.max_step})")
            self.version = version
            return Verdict(True)
        if incarnation in self._retired:
            return Verdict(False, reason=f"retired incarnation: {who} v{version} (now following "
                                         f"{self.incarnation:016x})")
        if version > self.max_first:
            return Verdict(False, reason=f"implausible version: {who} starts at v{version}")
        first = self.incarnation == 0
        if not first:
            self._retired.append(self.incarnation)
            self.restarts += 1
        self.incarnation, self.version = incarnation, version
        return Verdict(True, reset=not first,
                       reason="" if first else f"{self.what} restarted: incarnation {incarnation:016x} from v{version}")


class ImpersonationGuard:
    """An authority's watch on its own topic: anything there it did not publish is forged.

    Listeners cannot tell a forged message in the authority's incarnation, or a forged new
    incarnation, from the real thing without the security option (a forged new incarnation made
    every compute node refuse the real coordinator's plans as retired). The authority can: it
    knows what it published. It records the digest of each version it sends; a message on its
    topic with its incarnation but another digest, or with an incarnation it never had, is an
    impostor. The authority then takes a new incarnation and publishes again, which listeners
    accept as a restart and which retires the impostor's incarnation with the old one. A
    persistent forger can repeat this; ``min_interval_s`` keeps two misconfigured authorities
    from re-incarnating each other in a tight loop. Pure: the caller passes the time.
    """

    def __init__(self, what: str, incarnation: int, *, kept: int = 64, min_interval_s: float = 1.0) -> None:
        self.what = what
        self.incarnation = incarnation
        self.min_interval_s = min_interval_s
        self._kept = kept
        self._digests: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._own: collections.deque[int] = collections.deque(maxlen=RETIRED_KEPT)  # my former incarnations
        self._last_change = float("-inf")
        self._owed = False  # an impostor came too soon after the last change: re-incarnate when due
        self.impostors = 0
        self.last_impostor_s = float("-inf")  # when ``answer`` was last called

    def published(self, version: int, digest: bytes) -> None:
        self._digests[version] = digest
        self._digests.move_to_end(version)
        while len(self._digests) > self._kept:
            self._digests.popitem(last=False)

    def check(self, incarnation: int, version: int, digest: bytes) -> str:
        """'' if the message is this authority's own (or an echo of a former incarnation's),
        else why it is forged."""
        if incarnation == self.incarnation:
            mine = self._digests.get(version)
            if mine == digest:
                return ""
            self.impostors += 1
            what = "content it did not publish" if mine is not None else "a version it did not publish"
            return f"impostor: {self.what} v{version} in this {self.what}'s incarnation with {what}"
        if incarnation in self._own:
            return ""
        self.impostors += 1
        return f"impostor: another {self.what} incarnation {incarnation:016x} v{version} on its topic"

    def answer(self, now_s: float) -> int | None:
        """An impostor was seen at ``now_s``: the incarnation to re-announce under (``reincarnate``)."""
        self.last_impostor_s = now_s
        return self.reincarnate(now_s)

    def impostor_within(self, now_s: float, window_s: float) -> bool:
        """Whether an impostor was seen in the last ``window_s`` (an ERROR on /diagnostics)."""
        return now_s - self.last_impostor_s < window_s

    def reincarnate(self, now_s: float, *, confirming: bool = False) -> int | None:
        """A new incarnation to publish under (the old one is remembered as this authority's
        own), or None if the last change was less than ``min_interval_s`` ago - then one is owed
        and ``due`` hands it out later: the impostor's message may be what listeners follow now.

        An answer to an impostor is confirmed once, ``min_interval_s`` later, by ``due``: a
        listener whose executor was busy can take the impostor's message after ours (seen: 2 ms
        after) and would follow it for good."""
        if now_s - self._last_change < self.min_interval_s:
            self._owed = True
            return None
        self._owed = not confirming
        self._last_change = now_s
        self._own.append(self.incarnation)
        self.incarnation = new_incarnation()
        self._digests.clear()
        return self.incarnation

    def due(self, now_s: float) -> int | None:
        """The owed re-incarnation (or the confirmation of the last one) once ``min_interval_s``
        has passed; call it periodically."""
        return self.reincarnate(now_s, confirming=True) if self._owed else None
