"""Which (incarnation, version) a listener accepts from a restartable authority."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kaitian_ros.core.authority import MAX_FIRST_VERSION, MAX_VERSION_STEP, AuthorityTracker, new_incarnation

A, B = 0xA1, 0xB1


def test_versions_move_forward_within_an_incarnation() -> None:
    t = AuthorityTracker("plan")
    assert t.check(A, 5).accept  # a late joiner starts wherever the authority is
    assert t.check(A, 6).accept and t.check(A, 6 + MAX_VERSION_STEP).accept
    dup = t.check(A, 6 + MAX_VERSION_STEP)
    assert not dup.accept and not dup.rejected  # latched re-delivery: quiet
    stale = t.check(A, 7)
    assert stale.rejected and stale.reason.startswith("stale version")
    jump = t.check(A, 2**32 - 1)
    assert jump.rejected and jump.reason.startswith("implausible version")
    assert t.version == 6 + MAX_VERSION_STEP


def test_a_restart_resets_and_the_old_incarnation_is_retired() -> None:
    t = AuthorityTracker("plan")
    assert t.check(A, 40).accept
    restart = t.check(B, 1)
    assert restart.accept and restart.reset and "restarted" in restart.reason
    assert (t.incarnation, t.version, t.restarts) == (B, 1, 1)
    late = t.check(A, 41)  # the dead authority's message arrives late: no flapping back
    assert late.rejected and late.reason.startswith("retired incarnation")
    assert t.check(B, 2).accept


def test_first_message_is_not_a_reset_and_forged_starts_are_refused() -> None:
    t = AuthorityTracker("assignment")
    assert t.check(0, 1).reason.startswith("no incarnation")
    assert t.check(A, 0).reason.startswith("implausible version")
    assert t.check(A, MAX_FIRST_VERSION + 1).reason.startswith("implausible version")
    first = t.check(A, 1)
    assert first.accept and not first.reset and first.reason == ""
    assert t.check(B, 2**32 - 1).rejected and t.incarnation == A


def test_new_incarnations_are_nonzero_and_distinct() -> None:
    ids = {new_incarnation() for _ in range(1000)}
    assert len(ids) == 1000 and 0 not in ids and all(0 < i < 2**64 for i in ids)


@given(st.lists(st.tuples(st.sampled_from([A, B, 0, 7]), st.integers(0, 2**32 - 1)), max_size=60))
def test_accepted_versions_never_go_back_nor_jump_within_an_incarnation(messages) -> None:
    t = AuthorityTracker("plan")
    last: dict[int, int] = {}
    for inc, version in messages:
        before = (t.incarnation, t.version)
        verdict = t.check(inc, version)
        if verdict.accept:
            if inc == before[0]:
                assert before[1] < version <= before[1] + MAX_VERSION_STEP
            else:
                assert version <= MAX_FIRST_VERSION and inc != 0 and inc not in last
                if before[0]:
                    last[before[0]] = before[1]
            assert (t.incarnation, t.version) == (inc, version)
        else:
            assert (t.incarnation, t.version) == before


def test_guard_tells_its_own_messages_from_impostors_and_reincarnates_at_a_bounded_rate() -> None:
    from kaitian_ros.core.authority import ImpersonationGuard

    guard = ImpersonationGuard("coordinator", 0xAB, min_interval_s=2.0)
    guard.published(1, b"one")
    guard.published(2, b"two")
    assert guard.check(0xAB, 2, b"two") == ""                      # its own echo
    assert "content it did not publish" in guard.check(0xAB, 2, b"forged")
    assert "version it did not publish" in guard.check(0xAB, 3, b"three")
    assert "another coordinator incarnation" in guard.check(0xCD, 1, b"x")
    assert guard.impostors == 3
    new = guard.reincarnate(10.0)
    assert new is not None and new != 0xAB and guard.incarnation == new
    assert guard.check(0xAB, 2, b"two") == ""                      # a late echo of its former self
    assert guard.check(new, 2, b"two") != ""                       # nothing published under the new one yet
    assert guard.due(10.5) is None and guard.reincarnate(11.0) is None  # rate bound: no ping-pong
    confirmed = guard.due(12.0)                                    # the answer confirmed once, when due
    assert confirmed not in (None, new) and guard.incarnation == confirmed
    assert guard.due(20.0) is None                                 # and only once


def test_guard_owes_an_answer_to_an_impostor_that_came_too_soon() -> None:
    from kaitian_ros.core.authority import ImpersonationGuard

    guard = ImpersonationGuard("scheduler", 5, min_interval_s=1.0)
    first = guard.reincarnate(0.0)
    assert guard.due(1.0) not in (None, first)                     # confirmation
    assert guard.reincarnate(1.5) is None                          # a new impostor, too soon
    owed = guard.due(2.0)
    assert owed is not None                                        # answered when due (well after the
    assert guard.due(9.0) is None                                  # impostor's message: no race to confirm)


def test_guard_keeps_a_bounded_record() -> None:
    from kaitian_ros.core.authority import ImpersonationGuard

    guard = ImpersonationGuard("scheduler", 7, kept=4)
    for v in range(1, 11):
        guard.published(v, bytes([v]))
    assert guard.check(7, 10, bytes([10])) == "" and guard.check(7, 7, bytes([7])) == ""
    assert guard.check(7, 6, bytes([6])) != ""  # forgotten: an old version re-sent now is not trusted


def test_guard_answer_remembers_when_an_impostor_was_seen() -> None:
    from kaitian_ros.core.authority import ImpersonationGuard

    guard = ImpersonationGuard("coordinator", 3)
    assert not guard.impostor_within(100.0, 30.0)
    assert guard.answer(100.0) not in (None, 3)
    assert guard.impostor_within(129.0, 30.0) and not guard.impostor_within(131.0, 30.0)
