"""Attaching to segments that are not ours fails clearly and changes nothing."""
from __future__ import annotations

import os

import pytest

import shmstore
from shmstore.config import Config
from shmstore.kernel import layout as L
from shmstore.kernel.node import store_prefix
from shmstore.kernel.segment import Segment


def _fake_meta(name: str, content: bytes, uid: int | None = None, mode: int = 0o600) -> Segment:
    seg = Segment.create(store_prefix(name, Config.from_kwargs().node) + "-meta", 1 << 16)
    seg.mm[: len(content)] = content
    if uid is not None:
        os.fchown(seg._fd, uid, -1)
    os.fchmod(seg._fd, mode)
    return seg


def _cleanup(seg: Segment) -> None:
    seg.close()
    seg.unlink()


def test_non_shmstore_segment_is_a_layout_error(name):
    seg = _fake_meta(name, b"NOTOURS!" + b"\1" * 100)
    try:
        with pytest.raises(shmstore.LayoutError, match="not a shmstore segment"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)


def test_other_layout_version_is_a_layout_error(name):
    buf = bytearray(L.HEADER_SIZE)
    L.pack_header(buf, L.Header(L.MAGIC, L.LAYOUT_VERSION + 1, L.STATE_READY, 0, os.getuid(), 1, 0, 1 << 20,
                                1 << 16, 16, 4, 4, 16, 0.0, name, "x"))
    seg = _fake_meta(name, bytes(buf))
    try:
        with pytest.raises(shmstore.LayoutError, match=f"layout version {L.LAYOUT_VERSION + 1}"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a segment to another user")
def test_segment_of_another_user_is_refused(name):
    seg = _fake_meta(name, b"\0" * 64, uid=4242)
    try:
        with pytest.raises(PermissionError, match="4242"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)


def test_segment_readable_by_others_is_refused(name):
    seg = _fake_meta(name, b"\0" * 64, mode=0o644)
    try:
        with pytest.raises(PermissionError, match="readable by others"):
            shmstore.connect(name)
    finally:
        _cleanup(seg)
