"""primitives/segment.py on real shared memory: create, attach, close, unlink; names it created only.

Every name here is ``/shmstore-<uid>-<this run's prefix>...``, so the leak check of conftest.py sees any
segment a test leaves behind.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from shmstore.primitives.segment import Segment, list_segments, segment_exists, unlink_segment

from helpers import unique_name


@pytest.fixture
def name():
    n = f"/shmstore-{os.getuid()}-{unique_name('seg')}"
    yield n
    unlink_segment(n)  # whatever the test left


def test_create_attach_share_bytes_then_close_and_unlink(name):
    with Segment.create(name, 8192) as a:
        assert a.size == 8192 and segment_exists(name) and a.named() is True
        assert oct(os.stat(f"/dev/shm/{name[1:]}").st_mode & 0o777) == "0o600"  # owner-only
        a.mapping()[100:105] = b"hello"
        with Segment.attach(name) as b:
            assert b.size == 8192 and bytes(b.mapping()[100:105]) == b"hello"
            b.mapping()[0] = 7
            assert a.mapping()[0] == 7  # one segment, two mappings
        assert b.mm is None
        a.unlink()
        assert not segment_exists(name) and a.named() is False
        assert a.mapping()[0] == 7  # unlinking takes the name, not the mapping
    assert a.mm is None
    with pytest.raises(ValueError, match="closed"):
        a.mapping()


def test_close_is_idempotent_and_safe_on_a_half_built_segment(name):
    seg = Segment.create(name, 4096)
    seg.close()
    seg.close()
    assert seg.named() is None  # closed: nothing to compare the name with
    seg.unlink()
    seg.unlink()  # the name is gone already: nothing raised
    half = Segment.__new__(Segment)  # __init__ never ran: the class defaults make close() safe
    half.close()


def test_the_read_only_mapping_sees_every_write_and_lends_no_writable_buffer(name):
    """What views are built over (issue 30 item 4): the same pages, mapped PROT_READ, exporting a read-only
    buffer (so numpy refuses setflags(write=True)); made once, closed with the segment."""
    with Segment.create(name, 8192) as seg:
        ro = seg.readonly_mapping()
        assert seg.readonly_mapping() is ro
        seg.mapping()[10:15] = b"hello"
        assert ro[10:15] == b"hello"  # one set of pages
        assert memoryview(ro).readonly
        view = np.ndarray((8,), np.uint8, ro, 8)
        with pytest.raises(ValueError, match="WRITEABLE"):
            view.setflags(write=True)
        with pytest.raises(TypeError):
            ro[0] = 1
        del view
    assert seg.ro is None and ro.closed
    with pytest.raises(ValueError, match="closed"):
        seg.readonly_mapping()


def test_create_refuses_an_existing_name_and_leaves_it(name):
    with Segment.create(name, 4096) as first:
        first.mapping()[0] = 42
        with pytest.raises(FileExistsError):
            Segment.create(name, 4096)
        with Segment.attach(name) as again:
            assert again.mapping()[0] == 42  # the failed create neither truncated nor unlinked it
        first.unlink()


def test_a_failed_create_leaves_no_name(name):
    with pytest.raises(OSError):
        Segment.create(name, -1)  # ftruncate refuses: all or nothing
    assert not segment_exists(name)


def test_attach_of_a_missing_name_raises_file_not_found(name):
    with pytest.raises(FileNotFoundError):
        Segment.attach(name)


def test_unlink_segment_removes_only_names_of_this_user_s_regular_files(name, tmp_path):
    assert unlink_segment(name) is False  # nothing there
    with Segment.create(name, 4096):
        pass
    assert name in list_segments(name)
    assert unlink_segment(name) is True and not segment_exists(name)
    fifo = f"/dev/shm/{name[1:]}"
    os.mkfifo(fifo, 0o600)  # something else under one of our names: refused, never opened or removed
    try:
        assert unlink_segment(name) is False and os.path.exists(fifo)
        with pytest.raises(PermissionError):
            Segment.attach(name)
    finally:
        os.unlink(fifo)


def test_pickling_sends_the_name_and_the_receiver_attaches(name):
    with Segment.create(name, 4096) as seg:
        seg.mapping()[1] = 9
        with pickle.loads(pickle.dumps(seg)) as other:
            assert other is not seg and other.name == name and other.mapping()[1] == 9
        seg.unlink()
