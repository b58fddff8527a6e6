"""Binary records declared once: a table of fields gives the struct, numpy dtype, indices and docs.

A record is declared as a small table, one field per line::

    EXTENT = Record("EXTENT", 40, '''
        0   offset     u64  arena offset
        8   size       u64  bytes
        ...
    ''')

(byte offset, name, type, meaning; a line that does not start with a
number goes on with the meaning of the field before). Types: ``u8 u16 u32 u64 i32 i64 f64``,
``bytes<N>``, and arrays such as ``i64[8]``. Everything else derives from the
table: :attr:`Record.struct` (the fields in offset order, gaps as pad bytes,
up to the end of the last field), :attr:`Record.dtype` (for vectorised scans),
the position of each field in an unpacked tuple (:meth:`Record.indices`), its
byte offset (:attr:`Record.offset`), keyword packing (:meth:`Record.pack`) and
the documentation table (:meth:`Record.doc`). Adding a field is one line.

Single fields are read and written with :meth:`Record.get`/:meth:`Record.set`
(a struct of that field alone: a struct that spans other fields would write
its pad bytes as zeros over them); :meth:`Record.at` binds a record to a fixed
offset (a segment header). ``tuple_type`` names a ``NamedTuple`` class to
unpack into instead of the generated one, so that mypy knows its fields; the
record refuses one whose fields are not its own, in its order.

Every store into shared memory copies packed bytes in (``buf[a:b] =
struct.pack(...)``), never ``struct.pack_into``: pack_into first fills its
whole target with zeros and then writes the fields, so another process
reading without a lock may see 0 in a field that is being rewritten with its
own value (measured: 7% of such reads; the spill process's heartbeat made a
client read a DISK capacity of 0 this way). A memcpy of packed bytes never
shows a value that is neither the old one nor the new one for an aligned
field of up to 8 bytes.
"""
from __future__ import annotations

import collections
import re
import struct
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Record", "Field", "Placed"]

_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i32": "i", "i64": "q", "f64": "d"}
_DTYPES = {"u8": "u1", "u16": "<u2", "u32": "<u4", "u64": "<u8", "i32": "<i4", "i64": "<i8", "f64": "<f8"}
_ARRAY = re.compile(r"^([a-z0-9]+)\[(\d+)\]$")
_BYTES = re.compile(r"^bytes(\d+)$")


class Field(NamedTuple):
    offset: int
    name: str
    type: str
    doc: str
    # struct code of the field alone ("Q", "16s", "8q") bytes values it unpacks to (8 for i64[8], 1 otherwise)
    code: str
    size: int
    n: int


def _field(offset: int, name: str, type_: str, doc: str) -> Field:
    code, n = _CODES.get(type_, ""), 1
    bytes_, array = _BYTES.match(type_), _ARRAY.match(type_)
    if bytes_:
        code = bytes_.group(1) + "s"
    elif array and array.group(1) in _CODES:
        n = int(array.group(2))
        code = f"{n}{_CODES[array.group(1)]}"
    if not code:
        raise ValueError(f"field {name!r}: unknown type {type_!r}")
    return Field(offset, name, type_, doc, code, struct.calcsize("<" + code), n)


class Record:
    """One binary record type: its fields, and what derives from them.

    Immutable after construction; owns no memory (its methods take a buffer
    and an offset). Thread-safe.
    """

    def __init__(self, name: str, size: int, table: str, tuple_type: Any = None) -> None:
        self.name, self.size = name, size
        fields: list[Field] = []
        for line in table.strip().splitlines():
            first = line.split(None, 1)[0]
            if not first.isdigit():  # the meaning goes on from the line before
                fields[-1] = fields[-1]._replace(doc=fields[-1].doc + " " + line.strip())
                continue
            off, fname, ftype, *doc = line.split(None, 3)
            fields.append(_field(int(off), fname, ftype, doc[0] if doc else ""))
        self.fields = sorted(fields)
        pos, code = 0, "<"
        for f in self.fields:
            if f.offset < pos:
                raise ValueError(f"{name}: field {f.name!r} at {f.offset} overlaps the one before")
            code += (f"{f.offset - pos}x" if f.offset > pos else "") + f.code
            pos = f.offset + f.size
        if pos > size:
            raise ValueError(f"{name}: fields end at {pos}, past its size {size}")
        self.struct = struct.Struct(code)
        self.offset = {f.name: f.offset for f in self.fields}
        self._index, i = {}, 0
        for f in self.fields:
            self._index[f.name] = i
            i += f.n
        make_tuple: Any = collections.namedtuple  # a class made at run time: mypy cannot follow it
        self.tuple: Any = make_tuple(name.title().replace("_", ""), [f.name for f in self.fields])
        self.dtype = np.dtype({"names": [f.name for f in self.fields],
                               "formats": [self._dtype_of(f) for f in self.fields],
                               "offsets": [f.offset for f in self.fields], "itemsize": size})
        self._fields = {f.name: struct.Struct("<" + f.code) for f in self.fields}
        self._zeros: list[Any] = []  # every field 0 (or b""), in struct order: what pack starts from
        for f in self.fields:
            self._zeros.extend([0] * f.n if f.n > 1 else [b"" if f.code.endswith("s") else 0])
        self._n = {f.name: f.n for f in self.fields}
        self._access = {f.name: (self._fields[f.name], f.offset) for f in self.fields}
        if tuple_type is not None:
            if tuple(tuple_type._fields) != tuple(f.name for f in self.fields):
                raise ValueError(f"{name}: {tuple_type.__name__} names {tuple_type._fields}, the record "
                                 f"{tuple(f.name for f in self.fields)}")
            self.tuple = tuple_type

    @staticmethod
    def _dtype_of(f: Field) -> Any:
        if f.type in _DTYPES:
            return _DTYPES[f.type]
        if f.code.endswith("s"):
            return f"S{f.size}"
        return (_DTYPES[f.type.split("[")[0]], (f.n,))

    # ---- access -----------------------------------------------------------------
    def indices(self, *names: str) -> tuple[int, ...]:
        """Positions of ``names`` in a tuple from ``struct.unpack_from`` (for hot paths).

        Raises:
            KeyError: a name the record does not have.
        """
        return tuple(self._index[n] for n in names)

    def field(self, name: str) -> struct.Struct:
        """A struct of field ``name`` alone, to read or write it at ``offset + self.offset[name]``."""
        return self._fields[name]

    def get(self, buf: Any, off: int, name: str) -> Any:
        """Field ``name`` of the record at ``off``.

        Raises:
            KeyError: a name the record does not have.
        """
        st, at = self._access[name]
        return st.unpack_from(buf, off + at)[0]

    def set(self, buf: Any, off: int, name: str, value: Any) -> None:
        """Store field ``name`` of the record at ``off`` alone (one memcpy of its packed bytes).

        Raises:
            KeyError: a name the record does not have.
        """
        st, at = self._access[name]
        at += off
        buf[at: at + st.size] = st.pack(value)  # not pack_into: see the module notes

    def at(self, off: int) -> Placed:
        """This record at a fixed offset (the header, the allocator state): ``get(buf, name)``/``set``."""
        return Placed(self, off)

    def unpack(self, buf: Any, off: int = 0) -> Any:
        """The record at ``off`` as a named tuple (arrays as tuples)."""
        flat = self.struct.unpack_from(buf, off)
        values, i = [], 0
        for f in self.fields:
            values.append(flat[i] if f.n == 1 else flat[i: i + f.n])
            i += f.n
        return self.tuple._make(values)

    def pack(self, buf: Any, off: int, **values: Any) -> None:
        """Write the whole record at ``off``: named fields, every other field 0 (pads too).

        Raises:
            TypeError: a name the record does not have.
        """
        buf[off: off + self.struct.size] = self.struct.pack(*self.flat(values))

    def flat(self, values: dict[str, Any]) -> list[Any]:
        """The values of a whole record in struct order, 0 (or b"") for those not given.

        Raises:
            TypeError: a name the record does not have.
        """
        out = self._zeros.copy()
        index, counts = self._index, self._n
        for name, v in values.items():
            if name not in index:
                raise TypeError(f"{self.name} has no field(s) {name}")
            if v is None:
                continue
            i = index[name]
            if counts[name] > 1:
                out[i: i + counts[name]] = v
            else:
                out[i] = v
        return out

    def span(self, first: str, last: str) -> struct.Struct:
        """A struct of the fields from ``first`` to ``last`` (in offset order), at ``offset[first]``.

        Pads between them are written as zeros: only for runs whose gaps are unused.
        """
        names = [f.name for f in self.fields]
        run = self.fields[names.index(first): names.index(last) + 1]
        pos, code = run[0].offset, "<"
        for f in run:
            code += (f"{f.offset - pos}x" if f.offset > pos else "") + f.code
            pos = f.offset + f.size
        return struct.Struct(code)

    def table_dtype(self, itemsize: int, *parts: tuple[int, Record, str, tuple[str, ...]]) -> np.dtype:
        """A dtype for arrays of slots of ``itemsize`` bytes holding this record at 0 and, for each
        ``(offset, record, prefix, names)`` in ``parts``, those fields of another record, prefixed."""
        names = [f.name for f in self.fields]
        formats = [self._dtype_of(f) for f in self.fields]
        offsets = [f.offset for f in self.fields]
        for base, rec, prefix, wanted in parts:
            for f in rec.fields:
                if f.name in wanted:
                    names.append(prefix + f.name)
                    formats.append(rec._dtype_of(f))
                    offsets.append(base + f.offset)
        return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})

    # ---- documentation -----------------------------------------------------------
    def doc(self) -> str:
        """The record's table for the module documentation."""
        head = f"{self.name} ({self.size} bytes)::\n\n    off  size type      field"
        rows = [f"    {f.offset:<4} {f.size:<4} {f.type:<9} {f.name}: {f.doc}" for f in self.fields]
        return "\n".join([head] + rows)


class Placed:
    """A record at a fixed offset of every buffer it is used on (``Record.at``); thread-safe, owns nothing."""

    __slots__ = ("record", "offset")

    def __init__(self, record: Record, offset: int) -> None:
        self.record, self.offset = record, offset

    def get(self, buf: Any, name: str) -> Any:
        return self.record.get(buf, self.offset, name)

    def set(self, buf: Any, name: str, value: Any) -> None:
        self.record.set(buf, self.offset, name, value)

    def unpack(self, buf: Any) -> Any:
        return self.record.unpack(buf, self.offset)
