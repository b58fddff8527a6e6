"""open_writer / open_reader: file-like, all-or-nothing."""
from __future__ import annotations

import io

import numpy as np
import pytest

import shmstore
from shmstore import Level


def test_writer_then_reader(store):
    data = bytes(range(256)) * 1000
    with store.open_writer("w", len(data)) as w:
        for i in range(0, len(data), 10000):
            assert w.write(data[i: i + 10000]) == len(data[i: i + 10000])
        assert "w" not in store  # invisible until sealed
    assert bytes(store.get("w")) == data
    with store.open_reader("w") as r:
        assert r.read(10) == data[:10] and r.tell() == 10
        r.seek(-6, io.SEEK_END)
        assert r.read() == data[-6:]
        assert r.read(5) == b""
        r.seek(100)
        buf = bytearray(50)
        assert r.readinto(buf) == 50 and bytes(buf) == data[100:150]
        buf = np.zeros(64, np.uint8)
        r.seek(0)
        assert r.readinto(buf) == 64 and bytes(buf) == data[:64]
    with pytest.raises(shmstore.StoreClosedError):
        r.read()


def test_writing_past_the_size_is_refused_and_changes_nothing(store):
    with store.open_writer("w", 10) as w:
        w.write(b"12345")
        with pytest.raises(shmstore.InvalidArgumentError, match="passes the end"):
            w.write(b"123456")
        w.write(b"67890")
    assert bytes(store.get("w")) == b"1234567890"


def test_error_inside_writer_drops_the_object(store):
    with pytest.raises(RuntimeError):
        with store.open_writer("w", 1 << 20) as w:
            w.write(b"x" * 1000)
            raise RuntimeError("boom")
    assert "w" not in store and store.get_capacity()[Level.MEMORY].used == 0
    store.put("w", 1)


def test_short_writer_is_dropped_with_a_clear_error(store):
    w = store.open_writer("w", 100)
    w.write(b"abc")
    with pytest.raises(shmstore.InvalidArgumentError, match="nothing was stored"):
        w.close()
    assert "w" not in store and store.get_capacity()[Level.MEMORY].used == 0


def test_zero_copy_fill_through_buffer(store):
    with store.open_writer("w", 8) as w:
        np.frombuffer(w.buffer, np.uint8)[:] = np.arange(8)
        w.advance(8)
    assert bytes(store.get("w")) == bytes(range(8))


@pytest.mark.parametrize("size", [-1, 1.5, "10", True])
def test_bad_sizes(store, size):
    with pytest.raises(shmstore.InvalidArgumentError):
        store.open_writer("w", size)
    assert store.list() == []


def test_empty_object_and_closed_store(name):
    s = shmstore.connect(name, capacity="8MiB")
    with s.open_writer("e", 0):
        pass
    assert bytes(s.get("e")) == b""
    with s.open_reader("e") as r:
        assert r.read() == b""
    s.close()
    with pytest.raises(shmstore.StoreClosedError):
        s.open_writer("x", 1)


def test_reader_pins_against_delete(store):
    store.put("a", b"abc" * 1000)
    r = store.open_reader("a")
    store.delete("a")
    assert r.read(3) == b"abc"
    assert store.get_capacity()[Level.MEMORY].used > 0
    r.close()
    import gc
    gc.collect()
    assert store.get_capacity()[Level.MEMORY].used == 0


@pytest.mark.parametrize("data", ["text", 5, None, [1, 2], 3.5])
def test_writer_refuses_what_is_not_bytes_like(store, data):
    with store.open_writer("w", 4) as w:
        with pytest.raises(shmstore.InvalidArgumentError, match="bytes-like"):
            w.write(data)
        w.write(b"abcd")
    assert bytes(store.get("w")) == b"abcd"


@pytest.mark.parametrize("n", [-5, -2, "3", 2.5, True])
def test_reader_refuses_bad_counts(store, n):
    store.put("r", b"0123456789")
    with store.open_reader("r") as r:
        with pytest.raises(shmstore.InvalidArgumentError, match="byte count"):
            r.read(n)
        assert r.read(3) == b"012" and r.read(-1) == b"3456789" and r.read() == b""
        r.seek(0)
        assert r.read(None) == b"0123456789"
