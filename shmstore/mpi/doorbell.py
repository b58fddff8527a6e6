"""A node service's doorbell: an idle service sleeps in the kernel, and the request itself wakes it.

An idle node service used to probe MPI every 1 ms (every core busy) or 50 us
(a core to spare): a request after silence waited for the next probe, and on
a VM the woken thread's first microseconds cost more again; the first remote
get after a pause took 3-4 ms where a raw MPI round trip after the same
pause took 0.3-0.4 ms. With a doorbell, the idle service blocks in
``ppoll`` on a UDP socket of its own (no CPU, the GIL released) and probes
MPI only when woken or, as a safety net for a message nobody rang for,
every ``SAFETY`` seconds; and every nap of a service that is not idle (the
naps between requests that come at a pace, 50 to 200 us) is a sleep on the
same socket (``poll.Ring``), so a rung request is seen at once, not at the
nap's end (on a VM a 200 us nap lasts ~300 us, a wake-up by a ring ~70: 1 MiB
gets 0.5 ms apart took 1.1 ms before, 0.5-0.6 ms after). A rank that sends a
request to a node it has not sent to for ``RING_AFTER`` seconds rings that
node's bell right after the MPI send (one ``sendto`` of one byte, ~4 us;
back-to-back requests ring nothing: after a request the service probes back
to back for its spin window, then naps 50 us first). A ring that is lost or
refused costs nothing but the nap's or the safety net's delay; the MPI
message is the request, the ring only a wake-up.

Addresses: each leader binds its bell on every interface (port chosen by
the kernel) and publishes its host name, port and IPv4 addresses; a peer on
the same host (the same host name and network namespace: emulated nodes)
rings 127.0.0.1, another one the address sharing a subnet with one of its
own interfaces, else every address listed.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import threading
import time
from typing import Any

from ..primitives.native import current_cpu

__all__ = ["Doorbell", "Bells", "local_addresses", "my_card", "kernel_id", "pid_space", "SAFETY", "RING_AFTER"]

SAFETY = 0.01  # an idle service looks at MPI at least this often (a message sent without a ring)
# ring a node this rank has not sent to for this long: its service may be napping (or asleep), and a ring cuts
# the nap short; a node asked more often than this is probing back to back after the last request
RING_AFTER = 100e-6
_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def local_addresses() -> list[tuple[str, str]]:
    """(IPv4 address, netmask) of every interface up here, loopback included (SIOCGIFADDR per interface)."""
    out: list[tuple[str, str]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]
                mask = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24]
            except OSError:  # no IPv4 address on it
                continue
            out.append((socket.inet_ntoa(addr), socket.inet_ntoa(mask)))
    return out


def _namespace(kind: str) -> str:
    """This process's namespace of ``kind`` ("net", "pid"), as /proc names it ("": unknown)."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def _netns() -> str:
    """This process's network namespace (two emulated nodes on one host may or may not share one)."""
    return _namespace("net")


def pid_space() -> str:
    """This process's process-id namespace ("": unknown): thread ids name the same threads only within one."""
    return _namespace("pid")


def kernel_id() -> int:
    """This machine's kernel (FNV-1a of its boot_id, as ``_probe.c`` computes it; 0: unknown): a ring carries it
    with the ringing thread's CPU, so that a service woken on that very CPU naps right after answering instead
    of spinning there (``_probe.c``, ``poll.ring_origin``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            raw = f.read().rstrip(b"\n ")
    except OSError:
        return 0
    if not raw:
        return 0
    h = 2166136261
    for b in raw:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h or 1


def my_card() -> tuple[str, str, int, list[tuple[str, str]]]:
    """This rank's own card (no bell: port 0), to choose the address it rings others at."""
    return socket.gethostname(), _netns(), 0, local_addresses()


class Doorbell:
    """The service's side: a bound UDP socket (non-blocking) to sleep on; the service's prober naps on it
    (``poll.Ring``) and takes its rings. Owned by the node's Service thread."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def card(self) -> tuple[str, str, int, list[tuple[str, str]]]:
        """What peers need to ring it: (host name, network namespace, port, [(address, netmask)])."""
        return socket.gethostname(), _netns(), self.port, local_addresses()

    def ring_self(self) -> None:
        """Wake the loop sleeping on this bell (the service closing)."""
        try:
            self.sock.sendto(b"!", ("127.0.0.1", self.port))
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


class Bells:
    """The ringing side, one per rank: the bells of every node, and when this rank last sent to each."""

    def __init__(self, cards: list[Any], mine: Any) -> None:
        self._targets = [_targets(card, mine) if card is not None else [] for card in cards]
        self._last = [float("-inf")] * len(cards)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._lock = threading.Lock()
        self.rings = 0
        self._kernel = kernel_id()

    def sent(self, node: int) -> None:
        """This rank just sent a request to ``node``'s service: ring it if it may be asleep."""
        now = time.monotonic()
        last, self._last[node] = self._last[node], now
        if now - last < RING_AFTER:
            return
        # the ring says which CPU of which machine it comes from (see _probe.c's take_rings)
        cpu = current_cpu()
        ring = struct.pack("=II", self._kernel, cpu) if self._kernel and cpu >= 0 else b"!"
        with self._lock:
            for addr in self._targets[node]:
                try:
                    self._sock.sendto(ring, addr)
                except OSError:  # unreachable, buffer full: the safety net covers it
                    pass
            self.rings += 1

    def close(self) -> None:
        self._sock.close()


def _targets(card: Any, mine: Any) -> list[tuple[str, int]]:
    """Where to ring the bell described by ``card`` from the rank whose own card is ``mine``."""
    host, ns, port, addrs = card
    if host == mine[0] and ns == mine[1] and ns:
        return [("127.0.0.1", port)]
    ours = [ipaddress.ip_interface(f"{a}/{m}").network for a, m in mine[3] if not a.startswith("127.")]
    theirs = [a for a, _ in addrs if not a.startswith("127.")]
    shared = [a for a in theirs if any(ipaddress.ip_address(a) in net for net in ours)]
    return [(a, port) for a in (shared[:1] or theirs)]
