"""meta/records.py and the records of meta/layout: each declared once, everything else derived from it."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from shmstore.meta import layout as L
from shmstore.meta.records import Record


def _values(rec: Record) -> dict[str, object]:
    """A distinct value for every field of ``rec``."""
    values: dict[str, object] = {}
    for i, f in enumerate(rec.fields):
        if f.code.endswith("s"):
            values[f.name] = bytes([65 + i]) * min(f.size, 3)
        elif f.n > 1:
            values[f.name] = [i * 10 + j for j in range(f.n)]
        else:
            values[f.name] = float(i) + 0.5 if f.type == "f64" else i + 1
    return values


@pytest.mark.parametrize("rec", L.RECORDS, ids=lambda r: r.name)
def test_every_record_round_trips_through_struct_dtype_and_single_fields(rec):
    values = _values(rec)
    buf = bytearray(rec.size + 16)
    rec.pack(buf, 8, **values)
    back = rec.unpack(buf, 8)._asdict()
    view = np.ndarray((1,), rec.dtype, buffer=buf, offset=8)[0]
    for f in rec.fields:
        want, got = values[f.name], back[f.name]
        if f.code.endswith("s"):
            assert got.rstrip(b"\0") == want and bytes(view[f.name]).rstrip(b"\0") == want
        elif f.n > 1:
            assert list(got) == want and list(view[f.name]) == want
        else:
            assert got == want == view[f.name] == rec.get(buf, 8, f.name), f.name
        assert rec.offset[f.name] == f.offset and f.offset + f.size <= rec.size
    assert buf[:8] == bytes(8) and buf[8 + rec.size:] == bytes(8)  # nothing written outside the record
    assert rec.doc() in L.fields.__doc__  # the documentation shows the declaration itself
    with pytest.raises(TypeError, match="no field"):
        rec.pack(buf, 0, no_such_field=1)


@pytest.mark.parametrize("rec", L.RECORDS, ids=lambda r: r.name)
def test_set_writes_one_field_and_leaves_its_neighbours(rec):
    values = _values(rec)
    buf = bytearray(rec.size)
    rec.pack(buf, 0, **values)
    before = bytes(buf)
    for f in rec.fields:
        if f.n > 1 or f.code.endswith("s"):
            continue
        new = 7.25 if f.type == "f64" else 3
        rec.set(buf, 0, f.name, new)
        assert rec.get(buf, 0, f.name) == new
        changed = [i for i in range(rec.size) if buf[i] != before[i]]
        assert all(f.offset <= i < f.offset + f.size for i in changed), f.name
        buf[:] = before


def test_records_at_fixed_offsets():
    buf = bytearray(L.HEADER_SIZE)
    L.ALLOC.set(buf, "frontier", 12345)
    L.HEAD.set(buf, "spill_pid", 77)
    L.SPILL.set(buf, "disk_capacity", 1 << 40)
    assert L.ALLOC_STATE.get(buf, L.ALLOC_OFFSET, "frontier") == L.ALLOC.get(buf, "frontier") == 12345
    assert L.unpack_header(buf).spill_pid == 77 and L.unpack_spill_state(buf).disk_capacity == 1 << 40
    assert L.SPILL.unpack(buf).disk_capacity == 1 << 40


def test_entry_constants_are_computed_from_the_records():
    assert L.ENTRY_ARRAY_OFFSET == L.ENTRY_HEAD.size
    assert L.ENTRY_KEY_OFFSET == L.ENTRY_ARRAY_OFFSET + L.ENTRY_ARRAY.size
    assert L.ENTRY_SIZE == L.align(L.ENTRY_KEY_OFFSET + L.MAX_KEY) and L.ENTRY_SIZE % L.ALIGN == 0
    assert (L.ENTRY_ARRAY_OFFSET, L.ENTRY_KEY_OFFSET, L.ENTRY_SIZE) == (80, 168, 448)  # layout version 7
    lay = L.Layout(max_objects=8, max_clients=2, nstripes=2)
    assert lay.bucket(3) - lay.bucket(2) == L.BUCKET.size and lay.entry(1) - lay.entry(0) == L.ENTRY_SIZE
    assert L.ENTRY_DTYPE.itemsize == L.ENTRY_SIZE


def test_offsets_and_widths_agree_with_the_fast_path_layout():
    fast = L.fast_path_layout()
    for f in L.ENTRY_HEAD.fields:
        if f"{f.name}_off" in fast:
            assert (fast[f"{f.name}_off"], fast[f"{f.name}_width"]) == (f.offset, f.size), f.name
    assert fast["stats_objects_off"] == L.STRIPE_STATS.offset["objects"]
    assert fast["stats_objects_width"] == L.STRIPE_STATS.field("objects").size
    assert fast["stats_used_width"] * L.STRIPE_STATS.dtype["used"].shape[0] == L.STRIPE_STATS.field("used").size
    assert (fast["array_off"], fast["array_size"], fast["key_off"]) == (L.ENTRY_ARRAY_OFFSET, L.ENTRY_ARRAY.size,
                                                                       L.ENTRY_KEY_OFFSET)


def test_the_entry_tuple_is_typed_and_checked_against_the_record():
    assert L.ENTRY_HEAD.tuple is L.Entry
    assert L.Entry._fields == tuple(f.name for f in L.ENTRY_HEAD.fields)
    buf = bytearray(L.ENTRY_SIZE)
    e = L.Entry(1, 2, 3, 4.0, 5.0, 6, 7, 8, 9, -1, 11, 12, 13, 14, L.SEALED, L.KIND_RAW, 1, 0, 0)
    L.pack_entry(buf, 0, e)
    assert L.entry(buf, 0) == e == L.ENTRY_HEAD.unpack(buf, 0) and L.entry(buf, 0).writer == -1
    assert L.entry_raw(buf, 0)[L.E_STATE] == e.state == L.ENTRY_HEAD.get(buf, 0, "state")

    class Wrong(NamedTuple):
        b: int
        a: int

    with pytest.raises(ValueError, match="names"):
        Record("PAIR", 8, """
            0   a   u32  first
            4   b   u32  second
        """, tuple_type=Wrong)


def test_a_record_refuses_a_bad_declaration():
    with pytest.raises(ValueError, match="overlaps"):
        Record("BAD", 16, """
            0   a   u64  first
            4   b   u32  inside the first
        """)
    with pytest.raises(ValueError, match="past its size"):
        Record("BAD", 8, """
            0   a   u64  first
            8   b   u32  beyond the end
        """)
    with pytest.raises(ValueError, match="unknown type"):
        Record("BAD", 8, """
            0   a   u63  no such type
        """)
