"""CuPy's quarantine (``levels/device.py``) without a device: CUDA errors become DeviceError naming the
device, the object and what to do; no CuPy, a fork after CUDA started and exclusive compute modes say so
(issue 23 items 14 and 15)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import shmstore
from shmstore.levels import device
from shmstore.levels.device import compute_mode_problem, cuda_errors, cupy_or_reason


class CUDARuntimeError(RuntimeError):
    """Stands for CuPy's: the same module and message shape."""

    __module__ = "cupy_backends.cuda.api.runtime"


class OutOfMemoryError(MemoryError):
    __module__ = "cupy.cuda.memory"


@pytest.mark.parametrize("error,hint", [
    (CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal"), "CUDA_VISIBLE_DEVICES"),
    (OutOfMemoryError("Out of memory allocating 1,024 bytes"), "SHMSTORE_GPU_CAPACITY"),
    (CUDARuntimeError("cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable"),
     "nvidia-smi -c DEFAULT"),
    (CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered"), "restart the process"),
    (CUDARuntimeError("cudaErrorMapBufferObjectFailed: mapping of buffer object failed"), "--ipc=host"),
    (CUDARuntimeError("cudaErrorUnknown: unknown error"), "chained"),
])
def test_cuda_errors_become_device_errors_naming_device_key_and_remedy(error, hint):
    with pytest.raises(shmstore.DeviceError) as err, cuda_errors("store", "x", 1, "GPU 1 (0000:3B:00.0)"):
        raise error
    msg = str(err.value)
    assert msg.startswith("cannot store 'x' on GPU 1 (0000:3B:00.0): ") and hint in msg and str(error) in msg
    assert err.value.__cause__ is error and err.value.object_id == "x" and err.value.device == 1
    assert isinstance(err.value, (shmstore.ShmStoreError, RuntimeError))


def test_other_errors_pass_through_untouched():
    with pytest.raises(KeyError), cuda_errors("read", "x", 0):
        raise KeyError("x")
    inner = shmstore.DeviceError("already ours")
    with pytest.raises(shmstore.DeviceError) as err, cuda_errors("read", "x", 0):
        raise inner
    assert err.value is inner


def test_modes_that_lock_the_spill_process_or_its_clients_out_are_named():
    assert compute_mode_problem(0, "GPU 0") is None
    msg = compute_mode_problem(3, "GPU 0 (0000:3B:00.0)")
    assert msg is not None and "GPU 0 (0000:3B:00.0)" in msg and "EXCLUSIVE_PROCESS" in msg
    assert "nvidia-smi -c DEFAULT" in msg
    assert "PROHIBITED" in (compute_mode_problem(2, "GPU 0") or "")


def test_cuda_in_a_forked_child_is_refused_with_the_start_method_to_use(monkeypatch):
    answer = [(object(), None, os.getpid() + 1)]  # CuPy found by the parent, before it forked us
    monkeypatch.setattr(device, "_CUPY", answer)
    cupy, why = cupy_or_reason()
    assert cupy is None and "fork" in why and "spawn" in why
    with pytest.raises(shmstore.DeviceError, match="cannot read 'k' on the GPU: .*spawn"):
        device.need_cupy("read", "k")


class FakeDeviceArray:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "|u1", "data": (0, True), "version": 3}


def test_without_cupy_every_gpu_path_says_so(monkeypatch):
    # wherever this runs: the answer a process without CuPy gets (levels/device._probe)
    monkeypatch.setattr(device, "_CUPY", [(None, "CuPy is not installed (pip install 'shmstore[gpu]')", os.getpid())])
    with pytest.raises(shmstore.DeviceError, match="CuPy is not installed"):
        device.to_host(np.empty(4, np.uint8), FakeDeviceArray())
    with pytest.raises(shmstore.DeviceError, match="CuPy is not installed"):
        device.device_source()
    device.to_host(np.empty(0, np.uint8), FakeDeviceArray())  # nothing to copy: nothing asked
    device.settle(0)  # a view's release never raises


class FakeStream:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("synchronize the current stream")


class FakeCupy:
    """Just what copy_into touches: the current stream, and a device array's device and memory pointer."""

    def __init__(self, log):
        self.stream = FakeStream(log)
        self.cuda = self
        self.log = log

    def get_current_stream(self):
        return self.stream


class FakeDst:
    def __init__(self, log):
        self.log, self.data, self.device = log, self, self
        self.id = 2

    def __enter__(self):
        self.log.append("on device 2")

    def __exit__(self, *exc):
        self.log.append("back")

    def copy_from_host_async(self, ptr, n, stream):
        self.log.append(("copy host->device on", stream, n))

    def copy_from_host(self, ptr, n):  # the legacy-stream form: must not be used
        raise AssertionError("copy on the legacy stream")


def test_copies_run_on_the_current_stream_and_land_before_return(monkeypatch):
    log = []
    fake = FakeCupy(log)
    monkeypatch.setattr(device, "_CUPY", [(fake, None, os.getpid())])
    device.copy_into(FakeDst(log), b"abcd", 4, "store", "k")
    assert log == ["on device 2", ("copy host->device on", fake.stream, 4), "synchronize the current stream", "back"]


def test_a_views_release_waits_for_its_stream_never_for_the_whole_device_nor_inside_a_capture():
    """``settle`` (run before a view's pin goes): a synchronise of the current stream, never
    cudaDeviceSynchronize (all the process's GPU work, and it breaks a graph capture), none while capturing."""
    log = []

    class Stream:
        capturing = False

        def is_capturing(self):
            return self.capturing

        def synchronize(self):
            log.append("stream")

    stream = Stream()

    class Cupy:
        class cuda:
            class Device:
                def __init__(self, d):
                    log.append(("device", d))

                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    pass

            @staticmethod
            def get_current_stream():
                return stream

            class runtime:
                @staticmethod
                def deviceSynchronize():
                    log.append("device-wide")

    old = list(device._CUPY)
    device._CUPY[:] = [(Cupy, None, os.getpid())]
    try:
        device.settle(3)
        stream.capturing = True
        device.settle(3)
    finally:
        device._CUPY[:] = old
    assert log == [("device", 3), "stream", ("device", 3)]
