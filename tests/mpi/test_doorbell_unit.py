"""The doorbell's parts without MPI: a ring wakes the sleeper, silence does not; rings go only after this rank's
silence towards a node; the address rung is the loopback on the same host and network namespace, else one
sharing a subnet, else every address listed."""
from __future__ import annotations

from shmstore.mpi import doorbell as D
from shmstore.mpi.poll import _nap_or_ring


def _rung(bell: D.Doorbell, timeout: float) -> bool:
    """Whether ``bell`` rings within ``timeout`` seconds, every ring taken (the Python prober's own wait)."""
    return _nap_or_ring(bell.sock.fileno(), timeout)


def test_a_ring_wakes_the_sleeper_and_silence_lets_it_sleep(monkeypatch):
    bell = D.Doorbell()
    try:
        assert _rung(bell, 0.01) is False
        host, ns, port, addrs = bell.card()
        assert port == bell.port and any(a == "127.0.0.1" for a, _ in addrs)
        bells = D.Bells([bell.card()], D.my_card())
        try:
            bells.sent(0)  # first request to that node: rings
            assert _rung(bell, 30) is True and bells.rings == 1
            monkeypatch.setattr(D, "RING_AFTER", 3600.0)  # "right after", however slow this machine
            bells.sent(0)  # the service is awake: no ring
            assert bells.rings == 1 and _rung(bell, 0.01) is False
            monkeypatch.setattr(D, "RING_AFTER", 0.0)  # silence long enough
            bells.sent(0)
            assert bells.rings == 2 and _rung(bell, 30) is True
            bell.ring_self()
            bell.ring_self()
            assert _rung(bell, 30) is True and _rung(bell, 0.01) is False  # both rings taken by one wake
        finally:
            bells.close()
    finally:
        bell.close()


def test_the_address_rung_is_the_nearest_the_peer_listed():
    mine = ("h0", "net:[1]", 0, [("127.0.0.1", "255.0.0.0"), ("10.9.0.2", "255.255.255.0")])
    same = ("h0", "net:[1]", 4000, [("127.0.0.1", "255.0.0.0"), ("10.9.0.3", "255.255.255.0")])
    other_ns = ("h0", "net:[2]", 4001, [("127.0.0.1", "255.0.0.0"), ("192.168.5.7", "255.255.255.0"),
                                         ("10.9.0.3", "255.255.255.0")])
    far = ("h1", "net:[3]", 4002, [("127.0.0.1", "255.0.0.0"), ("172.16.0.4", "255.255.0.0"),
                                   ("192.168.9.9", "255.255.255.0")])
    assert D._targets(same, mine) == [("127.0.0.1", 4000)]
    assert D._targets(other_ns, mine) == [("10.9.0.3", 4001)]  # the one sharing our subnet
    assert D._targets(far, mine) == [("172.16.0.4", 4002), ("192.168.9.9", 4002)]  # none shared: every one
