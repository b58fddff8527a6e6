"""Bulk copies into shared memory: the C helper and the numpy fallback give the same bytes."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from shmstore.primitives import copying

from helpers import ROOT

MiB = 1 << 20


def test_the_helper_is_used_where_it_was_built():
    built = bool(glob.glob(os.path.join(ROOT, "shmstore", "primitives", "_copy*.so")))
    pure = os.environ.get("SHMSTORE_PURE_PYTHON") == "1"
    assert (copying._helper is not None) == (built and not pure)


@pytest.fixture(params=["helper", "numpy"])
def mode(request, monkeypatch):
    if request.param == "helper":
        if copying._helper is None:
            pytest.skip("the C helper shmstore.primitives._copy was not built here")
    else:
        monkeypatch.setattr(copying, "_helper", None)
    return request.param


@pytest.mark.parametrize("sizes", [[0, 1, 63, 64, 65], [64 << 10, (64 << 10) + 7, 3 * MiB + 5],
                                   [256 << 10] * 80])  # the last one is over PARALLEL_MIN: threads
def test_copy_blobs_places_every_piece(mode, sizes):
    rng = np.random.default_rng(len(sizes))
    srcs = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    offs, pos = [], 3  # unaligned start: the helper's aligned streaming loop must not care
    for s in srcs:
        offs.append(pos)
        pos += s.nbytes + 5
    dst = np.zeros(pos + 11, np.uint8)
    copying.copy_blobs(dst, [(o, s.tobytes() if i % 2 else s) for i, (o, s) in enumerate(zip(offs, srcs))])
    expect = np.zeros_like(dst)
    for o, s in zip(offs, srcs):
        expect[o: o + s.nbytes] = s
    assert np.array_equal(dst, expect)


@pytest.mark.parametrize("order", ["C", "F"])
def test_copy_into_large_arrays(mode, order):
    src = np.asfortranarray(np.arange(5 * MiB, dtype=np.float32).reshape(1024, -1)) if order == "F" \
        else np.arange(5 * MiB, dtype=np.float32).reshape(1024, -1)
    dst = np.zeros(src.shape, src.dtype, order=order)
    copying.copy_into(dst, src)
    assert np.array_equal(dst, src)
    strided = src[:, ::3]
    out = np.zeros(strided.shape, strided.dtype)
    copying.copy_into(out, strided)
    assert np.array_equal(out, strided)


def test_helper_rejects_pieces_that_do_not_fit_and_copies_nothing():
    if copying._helper is None:
        pytest.skip("the C helper shmstore.primitives._copy was not built here")
    dst = np.zeros(100, np.uint8)
    for bad in ([(0, b"x" * 50), (60, b"y" * 41)], [(-1, b"z")], [(0, b"w" * 101)]):
        with pytest.raises(ValueError, match="does not fit"):
            copying._helper.copy_blobs(dst, bad)
        assert not dst.any()
    with pytest.raises(TypeError):
        copying._helper.copy_blobs(dst, [(0, 12)])
    assert not dst.any()
    with pytest.raises(TypeError):  # read-only destination
        copying._helper.copy_blobs(dst.tobytes(), [(0, b"x")])
