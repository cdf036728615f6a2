"""A leader and a standby under any timing of renewals, losses and polls.

The leader sends renewals at any gaps; each may be lost, or stored and its confirmation
lost, or stored and confirmed late. The standby polls at any times with a clock of its
own, running up to 1.4 times as fast as the leader's. Whatever happens, at the moment
the standby may take the lease the leader has stopped acting: it acts only until
:func:`acts_until` of a renewal it sent, and the standby's watching takes longer than
that from the moment the renewal was sent.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import Lease
from phalanx.services.lease import ACTS_FOR, Sighting, acts_until, deposed, may_take, sighted

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=400)
#: A renewal: the gap since the last was sent, how long it took to be stored, how long
#: its confirmation took, whether it was stored, whether it was confirmed.
renewal = st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 2.0), st.floats(0.0, 2.0),
                    st.booleans(), st.booleans())


@SETTINGS
@given(lease_s=st.floats(0.3, 5.0), renewals=st.lists(renewal, max_size=20),
       polls=st.lists(st.floats(0.01, 2.0), min_size=1, max_size=60),
       rate=st.floats(1 / 1.4, 1.4), offset=st.floats(-1e6, 1e6))
def test_a_standby_never_takes_the_lease_while_the_leader_acts(
        lease_s: float, renewals: list[tuple[float, float, float, bool, bool]],
        polls: list[float], rate: float, offset: float) -> None:
    # The leader's take (revision 1), sent, stored and confirmed at 0; then its renewals.
    sent, stored, confirmed = [0.0], [0.0], [0.0]
    at = 0.0
    for gap, store_s, confirm_s, is_stored, is_confirmed in renewals:
        at += gap * lease_s
        sent.append(at)
        stored.append(at + store_s * lease_s if is_stored else float("inf"))
        confirmed.append(stored[-1] + confirm_s * lease_s if is_confirmed else float("inf"))
    lease = Lease(holder="leader", epoch=1, expires_at=0.0)
    seen: Sighting | None = None
    now = 0.0
    for gap in polls:
        now += gap * lease_s
        written = [i for i in range(len(sent)) if stored[i] <= now]
        revision = 1 + len(written) - 1  # each stored renewal is the next revision
        mine = offset + rate * now  # the standby's own clock
        seen = sighted(seen, revision, mine)
        if may_take(lease, "standby", seen, revision, lease_s, mine):
            # The leader acts at ``now`` only on a confirmed renewal whose deadline is
            # ahead; a renewal stored after the take is refused (compare-and-swap).
            acting = [i for i in written if confirmed[i] <= now
                      and not deposed(sent[i], lease_s, now)]
            assert not acting, (now, [(sent[i], acts_until(sent[i], lease_s))
                                      for i in acting])
            # And by a margin: a third of a lease at equal rates.
            if rate == 1.0:
                assert all(now - acts_until(sent[i], lease_s) >= lease_s * (1 - ACTS_FOR)
                           - 1e-9 for i in written)
            return


@SETTINGS
@given(lease_s=st.floats(0.01, 100.0), sent=st.floats(-1e6, 1e6),
       later=st.floats(0.0, 10.0))
def test_a_leader_acts_exactly_until_two_thirds_of_a_lease_after_its_last_renewal(
        lease_s: float, sent: float, later: float) -> None:
    now = sent + later * lease_s
    assert deposed(sent, lease_s, now) == (now >= acts_until(sent, lease_s))
    assert acts_until(sent, lease_s) < sent + lease_s  # before any takeover
    assert deposed(sent, lease_s, sent + lease_s)
