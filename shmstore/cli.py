"""The ``shmstore`` command: look into and manage node stores.

    shmstore [--name NAME] [--node NODE] [--session S] [--json]
             stores | status | ls [--all-sessions] | info KEY | rm KEY | move KEY memory|disk | check
             | gc [--job JOBID] | destroy [NAME] [--force]

``stores``, ``status``, ``ls``, ``info`` and ``check`` only look: they start no
spill process and remove nothing, even on a store whose job is gone.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from .errors import InvalidArgumentError, ShmStoreError, StoreInUseError
from .levels import Level, ObjectInfo
from .placement import spill_progress_line
from .store import Store, connect, destroy, observe
from .stores import collect_mpi_orphans, collect_stale, list_stores
from .units import format_size

__all__ = ["main"]


def _common(suppress: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name (``shmstore gc --json``)."""
    c = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    c.add_argument("--name", help="store name (default: $SHMSTORE_NAME, job-$SLURM_JOB_ID or 'default')", **kw)
    c.add_argument("--node", help="node id (default: $SHMSTORE_NODE, else $PMI_HOSTNAME, else $SLURMD_NODENAME, "
                                  "else the host name: as shmstore.mpi names nodes)", **kw)
    c.add_argument("--session", help="session whose objects ls/info/rm see (default: '')", **kw)
    c.add_argument("--json", action="store_true", help="machine-readable output", **kw)
    return c


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmstore", description="Inspect and manage shmstore node stores.",
                                parents=[_common(False)])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = [_common(True)]
    st = sub.add_parser("stores", parents=common, help="the stores on this host (name, node, clients, stale or not)")
    st.add_argument("--all-users", action="store_true", help="every user's stores, not only yours")
    sub.add_parser("status", parents=common, help="capacity and usage per level, clients, spill process")
    sub.add_parser("ls", parents=common, help="objects of the session").add_argument(
        "--all-sessions", action="store_true", help="objects of every session, with a session column")
    sub.add_parser("info", parents=common, help="one object").add_argument("key")
    sub.add_parser("rm", parents=common, help="delete an object").add_argument("key")
    m = sub.add_parser("move", parents=common,
                       help="move an object to another level (spill or restore), showing progress")
    m.add_argument("key")
    m.add_argument("level", choices=["memory", "disk"])
    sub.add_parser("check", parents=common,
                   help="check the store's invariants (table, allocator, counters, spill files); exit 1 on a problem")
    gc_says = ("remove stores that no live process uses (job epilogs): without --name or --job every such store "
               "of yours on this host, not only this job's (as root --uid's or every user's), and the MPI "
               "library's shared memory segments (mpich_*, sm_segment.*, vader_segment.*) no live process maps; "
               "with --name NAME or --job JOBID only that store")
    g = sub.add_parser("gc", parents=common, help=gc_says, description=gc_says)
    g.add_argument("--job", metavar="JOBID", help="only Slurm job JOBID's store (named job-JOBID, as in a job)")
    g.add_argument("--all-users", action="store_true", help="every user's stale stores (root: a Slurm epilog)")
    g.add_argument("--uid", type=int, help="that user's stale stores (root)")
    d = sub.add_parser("destroy", parents=common, help="remove a store's segments and spill files")
    d.add_argument("store", nargs="?", help="store name (default: --name)")
    d.add_argument("--force", action="store_true", help="even while clients are attached")
    return p


def _open(args: argparse.Namespace, look: bool) -> Store:
    kw = {k: v for k, v in (("node", args.node), ("session", args.session)) if v is not None}
    if look:
        return observe(args.name, **kw)
    return connect(args.name, create=False, prefault=0, **kw)


def _print_status(st: dict[str, Any]) -> None:
    print(f"store {st['name']!r} on node {st['node']!r} ({st['segments']}){' persistent' if st['persistent'] else ''}")
    for level, c in st["levels"].items():
        print(f"  {level:<7} used {format_size(c['used'])} of {format_size(c['total'])}, "
              f"pinned {format_size(c['pinned'])}, spillable {format_size(c['spillable'])}, "
              f"{c['objects']} object(s)")
    print(f"  spilled {format_size(st['levels']['memory']['spilled'])}, restored "
          f"{format_size(st['levels']['memory']['restored'])} so far; spill files in {st['spill_dir']}")
    mv = st.get("moving")
    print(f"  moving entry {mv['entry']} to {mv['to']}: {format_size(mv['done'])} of {format_size(mv['total'])}"
          if mv else "  no move running")
    for ck in st.get("checkpoints", []):
        print(f"  checkpoint {ck['name']!r} (id {ck['id']}) part {ck['part']}: {format_size(ck['done'])} of "
              f"{format_size(ck['total'])} flushed")
    print("  " + _clients_line(st["clients"]))
    print(f"  spill process {st['spill']['pid']} ({'running' if st['spill']['alive'] else 'not running'})")
    if st["spill"].get("log"):
        print(f"  spill process log (problems it reported): {st['spill']['log']}")


def _clients_line(clients: list[dict[str, Any]]) -> str:
    """``clients: 1 alive (pid 7), 2 dead (pids 8, 9: ...)``: dead ones are registered but gone.

    Counts processes, each pid named once: a process connected twice (two sessions, a Cluster beside its own
    connection) holds two client slots, said as ``(pid 7, 2 connections)``.
    """
    def pids(alive: bool) -> tuple[int, str]:
        slots = [c["pid"] for c in clients if c["alive"] == alive]
        procs = list(dict.fromkeys(slots))  # each pid once, in slot order
        named = f" (pid{'s' if len(procs) > 1 else ''} {', '.join(map(str, procs))}" if procs else ""
        return len(procs), named + (f", {len(slots)} connections" if len(slots) > len(procs) else "")
    n_alive, alive = pids(True)
    n_dead, dead = pids(False)
    line = f"clients: {n_alive} alive" + (alive + ")" if n_alive else "")
    if n_dead:
        line += f", {n_dead} dead{dead}: gone; the spill process, or `shmstore gc`, reclaims their slots)"
    return line


def _print_list(infos: list[ObjectInfo], sessions: bool, as_json: bool) -> None:
    """``ls``: one line per object (key, size, level, kind), led by its session (``-`` for the default one)
    with ``--all-sessions``; JSON objects carry their session always."""
    if as_json:
        print(json.dumps([_info_dict(i) for i in infos], indent=2))
        return
    if sessions:
        infos = sorted(infos, key=lambda i: (i.session, i.key))
    for i in infos:
        pinned = "  pinned" if i.pinned else ""
        session = f"{i.session or '-'}\t" if sessions else ""
        print(f"{session}{i.key}\t{format_size(i.size)}\t{i.level.name.lower()}\t{i.kind}{pinned}")


def _info_text(info: ObjectInfo) -> str:
    """``info``: one ``field: value`` line each, sizes in binary units and ``created`` as a local date-time
    (``--json`` keeps bytes and seconds since the epoch)."""
    d = _info_dict(info)
    d["size"], d["stored"] = format_size(info.size), format_size(info.stored)
    d["created"] = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(info.created))
    return "\n".join(f"{k}: {v}" for k, v in d.items())


def _info_dict(info: ObjectInfo) -> dict[str, Any]:
    d: dict[str, Any] = info._asdict()
    d["level"] = info.level.name.lower()
    return d


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "stores":
        found = list_stores(all_users=args.all_users)
        if args.json:
            print(json.dumps(found, indent=2))
        for s in [] if args.json else found:
            state = "persistent" if s["persistent"] else "stale" if s["stale"] else \
                f"{s['clients']} client(s), spill process {'running' if s['spill_alive'] else 'gone'}"
            owner = f"  uid {s['uid']}" if args.all_users else ""
            print(f"{s['name']}\tnode {s['node']}\t{format_size(s['capacity'])}\t{state}{owner}")
        if not found and not args.json:
            print("no stores on this host")
        return 0
    if args.cmd == "gc":
        _gc(args)
        return 0
    if args.cmd == "destroy":
        try:
            gone = destroy(args.store or args.name, force=args.force, node=args.node)
        except StoreInUseError as exc:  # the command's flag, not the function's keyword
            raise StoreInUseError(str(exc).replace("pass force=True", "pass --force")) from None
        print(json.dumps({"removed": gone}) if args.json else ("removed" if gone else "nothing to remove"))
        return 0
    with _open(args, look=args.cmd in ("status", "ls", "info", "check")) as store:
        if args.cmd == "status":
            st = store.status()
            st["clients"] = [c for c in st["clients"] if c["pid"] != _own_pid()]
            print(json.dumps(st, indent=2)) if args.json else _print_status(st)
        elif args.cmd == "ls":
            _print_list(store.list(all_sessions=args.all_sessions), args.all_sessions, args.json)
        elif args.cmd == "info":
            info = store.get_info(args.key)
            print(json.dumps(_info_dict(info), indent=2) if args.json else _info_text(info))
        elif args.cmd == "move":
            info = store.move(args.key, Level[args.level.upper()], progress=_Progress(args.key))
            print(json.dumps(_info_dict(info)) if args.json else f"{args.key!r} is on {args.level}")
        elif args.cmd == "check":
            problems = store.check()
            if args.json:
                print(json.dumps({"ok": not problems, "problems": problems}, indent=2))
            else:
                print("\n".join(problems) if problems else "ok: no inconsistency found")
            return 1 if problems else 0
        elif args.cmd == "rm":
            store.delete(args.key)
            print(json.dumps({"deleted": args.key}) if args.json else f"deleted {args.key!r}")
    return 0


def _gc(args: argparse.Namespace) -> None:
    """``gc``: the stale store named (``--name``, ``--job``), else every stale store of the user (``--uid``'s,
    every user's) on this host and the MPI library's leftovers; the text says which stores that was."""
    name = _gc_name(args)
    removed = collect_stale(uid=args.uid, all_users=args.all_users, name=name)
    # the MPI library's own leftovers of an aborted job: only where no store was named
    mpi = [] if name else collect_mpi_orphans(uid=args.uid, all_users=args.all_users)
    if args.json:
        print(json.dumps({"removed": removed, "mpi_segments": mpi}))
        return
    whose = "of any user" if args.all_users else "of yours" if args.uid is None else f"of uid {args.uid}"
    if name:
        print("removed " + ", ".join(removed) if removed else f"no stale store {name!r} {whose} on this host")
    elif removed:
        print(f"removed {', '.join(removed)}: every stale store {whose} on this host, not only this job's "
              f"(--name NAME or --job JOBID removes only that store)")
    else:
        print(f"no stale stores {whose} on this host")
    if mpi:
        print(f"removed {len(mpi)} MPI shared memory segment(s) no process maps: " + ", ".join(mpi))


def _gc_name(args: argparse.Namespace) -> str | None:
    """The one store ``gc`` is limited to: ``--name``, or ``job-JOBID`` for ``--job`` (how a Slurm job names
    its store); None for every stale store.

    Raises:
        InvalidArgumentError: ``--name`` and ``--job`` name different stores.
    """
    name: str | None = args.name
    if args.job is None:
        return name
    job = f"job-{args.job}"
    if name not in (None, job):
        raise InvalidArgumentError(f"--job {args.job} is store {job!r}, not --name {name!r} (give one of them)")
    return job


class _Progress:
    """Prints the progress of the move of ``key`` to stderr, at most a few times a second.

    ``Store.move`` calls it only while that move's copy runs, never while the
    spill process moves other objects before it (those are not this move).
    """

    def __init__(self, key: str) -> None:
        self._key = key
        self._last = 0.0
        self._shown = False

    def __call__(self, state: Any) -> None:
        now = time.monotonic()
        line = spill_progress_line(state, self._key)
        if line and now - self._last > 0.25:
            print("\r" + line, end="", file=sys.stderr, flush=True)
            self._last, self._shown = now, True

    def __del__(self) -> None:
        if self._shown:
            print(file=sys.stderr)


def _own_pid() -> int:
    import os
    return os.getpid()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # what a look skips (a FIFO or garbage under a store's name in /dev/shm) is said on stderr
    logging.basicConfig(level=logging.WARNING, format="shmstore: %(message)s")
    try:
        return _run(args)
    except FileNotFoundError:
        print(f"shmstore: no store {args.name or 'default'!r} on this node", file=sys.stderr)
        return 1
    except (ShmStoreError, PermissionError) as exc:
        print(f"shmstore: {exc}", file=sys.stderr)
        return 1
