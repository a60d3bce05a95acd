"""The waiting reservations' order: only a strictly lower priority value holds another back; an entry leaves when
granted, or a TTL after its last ask."""

from __future__ import annotations

from engine.core.waiting_reservations import WaitingReservations


def test_strictly_higher_priorities_go_first_and_stale_ones_are_forgotten() -> None:
    now = [0.0]
    waiting = WaitingReservations(ttl_s=1.0, clock=lambda: now[0])
    waiting.refused("a", 2)
    assert waiting.admits("b", 2) and waiting.admits("c", 1) and waiting.admits("a", 2)  # equals race; itself
    assert not waiting.admits("d", 3)
    now[0] = 0.9
    waiting.refused("a", 2)  # asked again: renewed
    now[0] = 1.8
    assert not waiting.admits("d", 3)
    now[0] = 2.0
    assert waiting.admits("d", 3) and len(waiting) == 0  # a asked last at 0.9: gone
    waiting.refused("a", 0)
    waiting.granted("a")
    assert waiting.admits("d", 3) and len(waiting) == 0
