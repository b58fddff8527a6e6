"""The package's floors hold: what may import what, who may name a level, nobody reaching into another's privates.

The rules README's "Layout" draws, read from the source with ``ast`` (no
imports run), so that a change that breaks one fails here with the line
that does, instead of growing back a cycle between floors unseen.
"""
from __future__ import annotations

import ast
import os

import pytest

from helpers import ROOT

PKG = os.path.join(ROOT, "shmstore")

# floor of each part of the package: an import may go to the same floor or below, never up
FLOORS = {
    "errors": 0, "units": 0, "values": 0, "config": 1,
    "primitives": 2,  # OS primitives: no record of the store
    "meta": 3,    # the shared records: layout, table, allocator, locks, the C table operations
    "node": 4,    # one node store: segments and clients, supplies, repair, checks, level protocols, values<->bytes
    "levels": 5,
    "client": 6,  # one process's verbs, above the levels
    "kernel": 6,  # (the old name: re-exports of the client's and the node store's names)
    "spill": 7,
    "persist": 7,  # the checkpoint folder's format, flush plans, the spill process's flusher
    "streams": 8, "placement": 8, "store": 9, "stores": 9, "refs": 9, "checkpoint": 9,
    "mapping": 9,  # store.mapping(): the MutableMapping view
    "cli": 10, "contrib": 10, "__init__": 10, "__main__": 10, "testing": 10,
    "mpi": 11,
}
LEVEL_CLASSES = {"MemoryLevel", "DiskLevel", "GpuLevel", "SpillDir"}


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for base, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(base, f)
                with open(path) as fh:
                    out.append((os.path.relpath(path, ROOT), ast.parse(fh.read(), path)))
    return sorted(out)


MODULES = _modules()


def _part(rel: str) -> str:
    """``shmstore/node/nodestore.py`` -> ``kernel``; ``shmstore/store.py`` -> ``store``."""
    parts = rel.split(os.sep)[1:]
    return parts[0] if len(parts) > 1 else parts[0][:-3]


def _imported_parts(rel: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, part of shmstore) of every import of this module, at any depth (lazy imports count too)."""
    here = rel.split(os.sep)[:-1]  # ['shmstore', 'kernel']
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
                if len(target) == 1:  # "from . import x" at the top: x is the part
                    out += [(node.lineno, a.name) for a in node.names]
                    continue
            elif node.module and node.module.split(".")[0] == "shmstore":
                target = node.module.split(".")
                if len(target) == 1:
                    out += [(node.lineno, a.name) for a in node.names]
                    continue
            else:
                continue
            out.append((node.lineno, target[1]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[1]) for a in node.names
                    if a.name.startswith("shmstore.") and a.name.count(".") >= 1]
    return out


def test_every_part_of_the_package_has_a_floor():
    missing = {_part(rel) for rel, _ in MODULES} - set(FLOORS)
    assert not missing, f"give these parts of shmstore a floor in FLOORS: {sorted(missing)}"


@pytest.mark.parametrize("rel,tree", MODULES, ids=[rel for rel, _ in MODULES])
def test_imports_go_to_the_same_floor_or_below(rel, tree):
    part = _part(rel)
    up = [f"{rel}:{line} imports shmstore.{target} (floor {FLOORS[target]} > {part}'s {FLOORS[part]})"
          for line, target in _imported_parts(rel, tree)
          if target in FLOORS and FLOORS[target] > FLOORS[part]]
    assert not up, "\n".join(up)


def test_no_concrete_level_is_named_outside_levels():
    """Callers speak to a level through its protocol (node/protocols.py), never to a class of one."""
    found = []
    for rel, tree in MODULES:
        if _part(rel) == "levels":
            continue
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in LEVEL_CLASSES:
                found.append(f"{rel}:{node.lineno} names {name}")
            if isinstance(node, ast.alias) and node.name in LEVEL_CLASSES:
                found.append(f"{rel} imports {node.name}")
    assert not found, "\n".join(found)


def _defined_privates() -> dict[str, set[str]]:
    """Private names (``_x``) each module defines: functions, classes, attributes it assigns on self."""
    out: dict[str, set[str]] = {}
    for rel, tree in MODULES:
        names = out.setdefault(rel, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {rel: {n for n in names if n.startswith("_") and not n.startswith("__")} for rel, names in out.items()}


def test_no_module_reaches_into_another_modules_privates():
    """``x._name`` where ``x`` is not ``self``/``cls`` and this module does not define ``_name``: a seam
    crossed through the back door (named tuples' ``_replace``/``_asdict``/``_make``/``_fields`` are public)."""
    privates = _defined_privates()
    allowed = {"_replace", "_asdict", "_make", "_fields", "_exit", "_getframe", "_current_frames",
               "_handleof", "_set_abort_status"}  # mpi4py documents MPI._handleof and MPI._set_abort_status
    found = []
    for rel, tree in MODULES:
        own = privates[rel]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in allowed):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own:
                continue
            found.append(f"{rel}:{node.lineno} reaches into .{node.attr}")
    assert not found, "\n".join(found)
