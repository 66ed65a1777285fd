"""The lease check's verdict as a table: (same session, lease still held by its session,
generation kept) → :class:`LeaseVerdict`. No server needed."""

from __future__ import annotations

import pytest

from dualwrite.writer.lease_keeper import LeaseVerdict, lease_verdict

pytestmark = pytest.mark.unit

INTACT, CLAIMED, MOVED, LOST = (LeaseVerdict.INTACT, LeaseVerdict.CLAIMED, LeaseVerdict.MOVED,
                                LeaseVerdict.LOST)

# same_session: the connection answered as the session that took the lease (None: no answer,
# or no connection); still_held: that session still holds the lease (None: not asked, or no
# answer); generation_kept: the id's fencing generation is still the writer's.
TABLE = [
    (True, None, True, INTACT),
    (True, None, False, CLAIMED),
    (True, True, True, INTACT),  # not asked when the session is the same: ignored
    (False, True, True, MOVED),  # a transaction pooler moved the connection
    (False, True, False, MOVED),
    (False, False, True, LOST),  # the lease's session ended: someone may have acted
    (False, None, True, LOST),  # asking who holds the lease failed
    (None, None, True, LOST),  # the session did not answer
    (None, True, True, LOST),
    (None, None, False, LOST),
]


@pytest.mark.parametrize(("same_session", "still_held", "generation_kept", "verdict"), TABLE)
def test_lease_verdict(same_session: bool | None, still_held: bool | None, generation_kept: bool,
                       verdict: LeaseVerdict) -> None:
    assert lease_verdict(same_session=same_session, still_held=still_held,
                         generation_kept=generation_kept) is verdict


def test_the_verdicts_keep_their_names() -> None:
    assert [v.value for v in LeaseVerdict] == ["intact", "claimed", "moved", "lost"]
