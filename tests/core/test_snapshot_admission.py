"""Admission on recurrent state kept as snapshots (KVFacts.truncate = SNAPSHOTS): a
session is reused or forked only back to a snapshot the runtime says it holds, and its
snapshots' bytes are part of what it costs."""

from __future__ import annotations

from butter.backend import ForkKind, KVFacts, TruncateKind
from butter.engine.admission import Admission
from butter.engine.records import Session

KV = KVFacts(budget_bytes=10_000, token_bytes=2, max_positions=1000, fork=ForkKind.COPY,
             truncate=TruncateKind.SNAPSHOTS, snapshot_bytes=100, snapshots=3,
             snapshot_every=32)


def snapshots_at(*positions: int, length: int = 120):
    """A runtime's ``reachable`` for sessions holding ``length`` tokens and snapshots at
    ``positions`` (the whole state is there too)."""
    def reachable(seq_id: int, keep: int, tail=None) -> int:
        return max((p for p in (*positions, length) if p <= keep), default=0)
    return reachable


def test_a_session_is_reused_back_to_its_last_snapshot_inside_the_prefix() -> None:
    admission = Admission(KV, parallel=2, reachable=snapshots_at(32, 64, 96))
    held = Session(seq_id=0, tokens=list(range(120)))
    prompt = list(range(80)) + [999] * 10  # departs at 80
    session, reuse = admission.pick_session([held], prompt)
    assert session is held and reuse == 64
    # The whole sequence is reusable as it is, snapshot or not.
    session, reuse = admission.pick_session([held], list(range(120)) + [5, 6])
    assert reuse == 120
    # No snapshot inside the shared prefix: nothing is reused.
    assert admission.pick_session([held], list(range(20)) + [999])[1] == 0


def test_a_fork_source_gives_only_what_a_snapshot_holds() -> None:
    admission = Admission(KV, parallel=2, reachable=snapshots_at(32, length=50))
    busy = Session(seq_id=1, tokens=list(range(50)))
    source, shared = admission.best_source([busy], list(range(45)) + [7], better_than=0)
    assert source is busy and shared == 32
    assert admission.best_source([busy], list(range(45)) + [7], better_than=32) == (None, 0)


def test_cost_counts_the_snapshots_a_session_keeps() -> None:
    assert KV.cost(31) == 62  # no snapshot before 32 positions
    assert KV.cost(32) == 64 + 100
    assert KV.cost(1000) == 2000 + 3 * 100  # at most ``snapshots`` of them
