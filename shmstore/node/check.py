"""The invariant checker: what a node store's metadata promises, checked against itself.

:func:`check` freezes the store (every stripe lock in order, then the ALLOC
lock: the lock order of every other path, so it cannot deadlock with them)
and checks, exactly:

- chains: every ``writing``/``sealed`` entry is linked once, in its own
  bucket, with the hash of its key; chains hold nothing else, loop nowhere,
  and no key is linked twice;
- entries: the free list holds exactly the free entries; reserved and
  writing entries belong to attached clients; pins are set only on live
  entries, by attached clients;
- usage: each stripe's counters equal what its entries hold, per level;
- the allocator: used and free extents tile the arena exactly, linked to
  their physical neighbours; free extents sit in the right bins, coalesced;
  the record free list holds exactly the unused records; every used extent
  is named back by its owner (``alloc.py``); a move's extent is its own;
- each level's own state (``StorageLevel.check``): on an arena level
  (MEMORY, GPU) every object lies inside its extent and no two objects (nor
  a move's new copy) overlap; on DISK the quota counter equals what the
  table charges, no object names arena space, each object has its file,
  and no file is there that no entry explains.

Problems come back as sentences; an empty list means consistent. Retired
chunks that no object uses any more are not problems: the janitor frees them
on its next round.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from ..meta import layout as L
from ..meta.lock import holding
from .repair import valid_extents

if TYPE_CHECKING:
    from .nodestore import NodeStore

__all__ = ["check", "frozen"]

_T = TypeVar("_T")

_LIVE = (L.WRITING, L.SEALED, L.DELETED)


def frozen(node: NodeStore, fn: Callable[[], _T]) -> _T:
    """``fn()`` holding every stripe lock and the ALLOC lock: nothing in the store changes meanwhile.

    Raises:
        LockTimeoutError: a lock stayed taken for ``lock_timeout``.
    """
    return holding([*node.stripes, node.alloc_lock], fn)


# entries past the never-used cursor checked to be untouched (the tail is never scanned)
_BEYOND = 4096

def check(node: NodeStore) -> list[str]:
    """Every inconsistency of ``node``'s metadata, spill files and counters (see the module notes)."""
    return frozen(node, lambda: _check_frozen(node))


def _check_frozen(node: NodeStore) -> list[str]:
    buf, lay = node.buf, node.layout
    t = L.entry_table(buf, lay).copy()  # the entries ever handed out (see _check_entries for the rest)
    ext = L.extent_table(buf, lay).copy()
    clients = L.client_table(buf, lay).copy()
    pins = L.pin_table(buf, lay)[:, :len(t)].copy()
    stats = L.stats_table(buf, lay).copy()
    problems: list[str] = []
    linked = _check_chains(buf, lay, t, problems)
    _check_entries(buf, lay, t, linked, clients, pins, problems)
    _check_stats(lay, t, stats, problems)
    _check_allocator(node, buf, lay, t, ext, clients, problems)
    for level in node.levels.values():
        problems.extend(level.check(t))
    return problems


def _check_chains(buf: Any, lay: L.Layout, t: np.ndarray, problems: list[str]) -> set[int]:
    heads = np.frombuffer(buf, np.int32, lay.nbuckets, lay.buckets)
    bmask = lay.nbuckets - 1
    linked: set[int] = set()
    keys: dict[tuple[int, bytes], int] = {}
    for b in np.flatnonzero(heads):
        rec, steps = int(heads[b]), 0
        while rec:
            idx = rec - 1
            if not 0 <= idx < len(t) or idx in linked or steps > len(t):
                problems.append(f"bucket {b}: chain loops or points outside the entries in use (entry {idx})")
                break
            linked.add(idx)
            steps += 1
            e = t[idx]
            if e["state"] not in (L.WRITING, L.SEALED):
                problems.append(f"bucket {b}: entry {idx} in state {e['state']} is linked")
            if int(e["hash"]) & bmask != b:
                problems.append(f"bucket {b}: entry {idx} hashes to bucket {int(e['hash']) & bmask}")
            key = L.entry_key(buf, lay.entry(idx), int(e["keylen"]))
            if zlib.crc32(key, int(e["session"])) != int(e["hash"]):
                problems.append(f"entry {idx} ({key!r}): stored hash does not match its key")
            other = keys.setdefault((int(e["session"]), key), idx)
            if other != idx:
                problems.append(f"key {key!r} is linked twice (entries {other} and {idx})")
            rec = int(e["next"])
    return linked


def _check_entries(buf: Any, lay: L.Layout, t: np.ndarray, linked: set[int], clients: np.ndarray, pins: np.ndarray,
                   problems: list[str]) -> None:
    state = t["state"]
    shadow = (state == L.WRITING) & ((t["flags"] & L.FLAG_SHADOW) != 0)  # an overwrite being written
    for idx in np.flatnonzero(shadow):
        if int(idx) in linked:
            problems.append(f"entry {idx} ({_key(buf, lay, t, idx)!r}) is an overwrite being written but linked")
    for idx in np.flatnonzero(((state == L.WRITING) & ~shadow) | (state == L.SEALED)):
        if int(idx) not in linked:
            problems.append(f"entry {idx} ({_key(buf, lay, t, idx)!r}) is {_state(state[idx])} but in no chain")
    next_unused, head = L.entry_cursor(buf)
    free_list: list[int] = []
    rec = head
    while rec and len(free_list) <= len(t):
        free_list.append(rec - 1)
        rec = int(t["next"][rec - 1]) if 0 < rec <= len(t) else 0
    free_set = set(free_list)
    expect = set(np.flatnonzero(state[:next_unused] == L.FREE).tolist())
    if len(free_set) != len(free_list):
        problems.append("the entry free list loops")
    if free_set != expect:
        problems.append(f"entry free list: {len(expect - free_set)} free entries missing from it, "
                        f"{len(free_set - expect)} entries on it that are not free")
    beyond = L.entry_table(buf, lay, next_unused + _BEYOND)[next_unused:]  # a window, not the whole tail
    if (beyond["state"] != L.FREE).any() or beyond["next"].any():
        problems.append("entries beyond the never-used cursor are in use")
    if (L.pin_table(buf, lay)[:, next_unused: next_unused + _BEYOND] != 0).any():
        problems.append("entries beyond the never-used cursor are pinned")
    attached = set(np.flatnonzero(clients["state"] == 1).tolist())
    for idx in np.flatnonzero((state == L.RESERVED) | (state == L.WRITING)):
        if int(t["writer"][idx]) not in attached:
            problems.append(f"entry {idx} is {_state(state[idx])} for client slot {t['writer'][idx]}, "
                            f"which is not attached")
    pinned = np.flatnonzero(pins.any(axis=0))
    for idx in pinned[~np.isin(state[pinned], (L.SEALED, L.DELETED))]:
        problems.append(f"entry {idx} is pinned but {_state(state[idx])}")
    high = L.ALLOC.get(buf, "slots_high")
    for used in sorted(attached | set(np.flatnonzero(pins.any(axis=1)).tolist())):
        if used >= high:
            problems.append(f"client slot {used} is in use but beyond the slots ever taken ({high})")
    for slot in np.flatnonzero(pins.any(axis=1)):
        if int(slot) not in attached:
            problems.append(f"client slot {slot} is not attached but holds pins")


def _check_stats(lay: L.Layout, t: np.ndarray, stats: np.ndarray, problems: list[str]) -> None:
    live = np.isin(t["state"], _LIVE)
    stripe = lay.stripe_of_bucket(t["hash"] & (lay.nbuckets - 1))
    for s in range(lay.nstripes):
        mine = live & (stripe == s)
        for level in range(3):
            want = int(t["size"][mine & (t["level"] == level)].sum())
            if int(stats["used"][s][level]) != want:
                problems.append(f"stripe {s}: {L.LEVEL_NAMES[level]} usage counter says "
                                f"{int(stats['used'][s][level])} B, its objects hold {want} B")
        if int(stats["objects"][s]) != int(mine.sum()):
            problems.append(f"stripe {s}: object counter says {int(stats['objects'][s])}, it holds {int(mine.sum())}")
        deleted = int((mine & (t["state"] == L.DELETED)).sum())
        if int(stats["deleted"][s]) != deleted:
            problems.append(f"stripe {s}: deleted counter says {int(stats['deleted'][s])}, it holds {deleted}")


def _check_allocator(node: NodeStore, buf: Any, lay: L.Layout, t: np.ndarray, ext: np.ndarray, clients: np.ndarray,
                     problems: list[str]) -> None:
    n, head = L.extent_cursor(buf)
    flags = ext["flags"][:n]
    used = np.flatnonzero(np.isin(flags, (L.EXT_USED, L.EXT_CHUNK, L.EXT_RETIRED))) + 1
    free = np.flatnonzero(flags == L.EXT_FREE) + 1
    seen: set[int] = set()
    for arena in [node.alloc, *node.device_allocators()]:
        lo, hi = arena.base, arena.base + arena.capacity
        inside = (ext["offset"] >= lo) & (ext["offset"] < hi)
        _check_tiling(node, arena, ext, used[inside[used - 1]], free[inside[free - 1]], problems)
        seen |= _check_bins(lay, arena, ext, problems)
    if seen != set(free.tolist()):
        problems.append(f"allocator bins hold {len(seen)} free extents, {len(free)} extents are free")
    unused: list[int] = []
    rec = head
    while rec and len(unused) <= n:
        unused.append(rec)
        rec = int(ext["next_free"][rec - 1]) if 0 < rec <= n else 0
    if set(unused) != set((np.flatnonzero(flags == L.EXT_UNUSED) + 1).tolist()):
        problems.append("the unused extent records and the record free list disagree")
    keep, _ = valid_extents(buf, lay)
    retired = set((np.flatnonzero(flags == L.EXT_RETIRED) + 1).tolist())
    for rec in sorted(set(used.tolist()) - set(keep.tolist()) - retired):
        x = ext[rec - 1]
        problems.append(f"extent {rec} ({x['size']} B at {x['offset']}, kind {x['flags']}, owner {x['owner']}) "
                        f"is not named back by its owner: leaked")
    if L.ALLOC.get(buf, "retired") != len(retired):
        problems.append(f"retired chunk counter says {L.ALLOC.get(buf, 'retired')}, there are {len(retired)}")
    for slot in np.flatnonzero((clients["state"] == 1) & (clients["chunk"] != 0)):
        rec = int(clients["chunk"][slot])
        if not 0 < rec <= n or ext["flags"][rec - 1] != L.EXT_CHUNK or ext["owner"][rec - 1] != -(slot + 1):
            problems.append(f"client slot {slot}'s chunk {rec} is not a chunk of it")
    _check_moves(t, ext, n, problems)


def _check_tiling(node: NodeStore, arena: Any, ext: np.ndarray, used: np.ndarray, free: np.ndarray,
                  problems: list[str]) -> None:
    recs = np.concatenate([used, free])
    order = recs[np.argsort(ext["offset"][recs - 1], kind="stable")]
    name = "arena" if arena.gpu < 0 else f"GPU arena {arena.gpu}"
    pos, prev = arena.base, 0
    for rec in order.tolist():
        x = ext[rec - 1]
        if int(x["offset"]) != pos:
            problems.append(f"{name}: {'gap' if x['offset'] > pos else 'overlap'} at offset {pos} "
                            f"(extent {rec} starts at {x['offset']})")
            return
        if int(x["prev_phys"]) != prev:
            problems.append(f"extent {rec}: physical predecessor says {x['prev_phys']}, it is {prev}")
        if prev and int(ext["next_phys"][prev - 1]) != rec:
            problems.append(f"extent {prev}: physical successor says {ext['next_phys'][prev - 1]}, it is {rec}")
        if prev and x["flags"] == L.EXT_FREE and ext["flags"][prev - 1] == L.EXT_FREE:
            problems.append(f"free extents {prev} and {rec} are adjacent but not coalesced")
        pos, prev = pos + int(x["size"]), rec
    if pos != arena.base + arena.capacity:
        problems.append(f"{name}: extents end at {pos}, the arena at {arena.base + arena.capacity}")
    elif prev and int(ext["next_phys"][prev - 1]) != 0:
        problems.append(f"extent {prev}: last in the {name} but has a successor")
    objects = used[ext["flags"][used - 1] == L.EXT_USED]  # chunks are cut from the top, past the frontier
    if arena.gpu < 0 and len(objects) \
            and int((ext["offset"][objects - 1] + ext["size"][objects - 1]).max()) > L.ALLOC.get(node.buf, "frontier"):
        problems.append("an object's extent lies beyond the allocator's frontier")


def _check_bins(lay: L.Layout, arena: Any, ext: np.ndarray, problems: list[str]) -> set[int]:
    """Check one arena's bins; returns the free records they hold."""
    seen: set[int] = set()
    mask = arena.bin_mask()
    lo, hi = arena.base, arena.base + arena.capacity
    for k in range(L.NBINS):
        rec, prev = arena.bin_head(k), 0
        if bool(rec) != bool(mask >> k & 1):
            problems.append(f"allocator bin {k}: bitmap and list disagree")
        while rec:
            if rec in seen or not 0 < rec <= lay.nextents:
                problems.append(f"allocator bin {k}: list loops or points outside (record {rec})")
                break
            seen.add(rec)
            x = ext[rec - 1]
            if x["flags"] != L.EXT_FREE or int(x["size"]).bit_length() - 1 != k or int(x["prev_free"]) != prev \
                    or not lo <= int(x["offset"]) < hi:
                problems.append(f"allocator bin {k}: record {rec} (kind {x['flags']}, {x['size']} B) is misfiled")
            prev, rec = rec, int(x["next_free"])
    return seen


def _check_moves(t: np.ndarray, ext: np.ndarray, n: int, problems: list[str]) -> None:
    """The extent a move placed is named only while it moves, and is its own. Where each level's objects lie
    (inside their extents, overlapping nothing) each level checks itself (``StorageLevel.check``)."""
    live = np.isin(t["state"], _LIVE)
    moving = live & ((t["flags"] & L.FLAG_MOVING) != 0)
    for idx in np.flatnonzero(~moving & (t["target_extent"] != 0)).tolist():  # ``target`` counts only while moving
        problems.append(f"entry {idx}: not moving but names the extent of a move")
    for idx in np.flatnonzero(moving & (t["target_extent"] != 0)).tolist():
        rec = int(t["target_extent"][idx])
        if not 0 < rec <= n or not (ext["flags"][rec - 1] == L.EXT_USED and ext["owner"][rec - 1] == idx + 1):
            problems.append(f"entry {idx}: the extent {rec} its move placed is not its own")


def _key(buf: Any, lay: L.Layout, t: np.ndarray, idx: Any) -> str:
    return L.entry_key(buf, lay.entry(int(idx)), int(t["keylen"][idx])).decode(errors="replace")


def _state(s: Any) -> str:
    return L.STATE_NAMES.get(int(s), str(int(s)))
