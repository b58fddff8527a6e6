"""Config precedence and validation."""
from __future__ import annotations

import os
import warnings

import pytest

import shmstore
from shmstore.config import Config
from shmstore.errors import ConfigError
from shmstore.units import format_size, parse_size


def test_keyword_beats_environment_beats_default(monkeypatch):
    monkeypatch.delenv("SHMSTORE_CAPACITY", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SHMSTORE_NAME", raising=False)
    assert Config.from_kwargs().name == "default"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert Config.from_kwargs().name == "job-77"
    monkeypatch.setenv("SHMSTORE_CAPACITY", "2GiB")
    monkeypatch.setenv("SHMSTORE_NAME", "envname")
    cfg = Config.from_kwargs()
    assert cfg.capacity == 2 << 30 and cfg.name == "envname"
    assert Config.from_kwargs(capacity="1MiB", name="kw").capacity == 1 << 20


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("SHMSTORE_HIGH_WATERMARK", "1.5")
    with pytest.raises(ConfigError, match="SHMSTORE_HIGH_WATERMARK"):
        Config.from_kwargs()
    monkeypatch.setenv("SHMSTORE_HIGH_WATERMARK", "0.9")
    monkeypatch.setenv("SHMSTORE_PERSIST", "maybe")
    with pytest.raises(ConfigError, match="SHMSTORE_PERSIST"):
        Config.from_kwargs()
    with pytest.raises(ConfigError, match="capacity="):
        Config.from_kwargs(capacity="lots", persist=False)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="capacty"):
        Config.from_kwargs(capacty="1GiB")


@pytest.mark.parametrize("bad", [{"name": "has space"}, {"name": "a/b"}, {"node": ""}, {"max_objects": 0},
                                 {"low_watermark": 0.95}, {"lock_timeout": -1}, {"capacity": 10}])
def test_invalid_values(bad):
    with pytest.raises(ConfigError):
        Config.from_kwargs(**bad)


def test_sizes():
    assert parse_size("8GiB") == 8 << 30 and parse_size("512M") == 512 << 20
    assert parse_size("1.5k") == 1536 and parse_size(100) == 100 and parse_size("3 MB") == 3_000_000
    for bad in ("-1", "ten", "5 parsecs", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(1536) == "1.5 KiB" and format_size(64) == "64 B" and format_size(3 << 30) == "3.0 GiB"


def test_every_variable_goes_through_one_reader_with_the_same_errors(monkeypatch):
    from shmstore import config  # (shmstore.mpi.tags.default_streams reads SHMSTORE_STREAMS through it)
    monkeypatch.setenv("SHMSTORE_STREAMS", "3")
    with pytest.raises(shmstore.ConfigError, match="SHMSTORE_STREAMS"):
        config.stream_count()
    monkeypatch.setenv("SHMSTORE_STREAMS", "1")
    assert config.stream_count() == 1
    monkeypatch.setenv("SHMSTORE_PURE_PYTHON", "maybe")
    with pytest.raises(shmstore.ConfigError, match="SHMSTORE_PURE_PYTHON.*boolean"):
        config.pure_python()
    monkeypatch.setenv("SHMSTORE_NODE", "no spaces")
    with pytest.raises(shmstore.ConfigError, match="SHMSTORE_NODE"):
        config.node_label()
    monkeypatch.setenv("SHMSTORE_NODE", "n7")
    assert config.node_label() == "n7"


def test_bad_switch_fails_at_import_naming_it():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import shmstore"], capture_output=True, text=True,
                       env=dict(os.environ, SHMSTORE_PURE_PYTHON="perhaps"))
    assert r.returncode != 0 and "SHMSTORE_PURE_PYTHON" in r.stderr


def test_default_node_and_max_objects_follow_the_launcher_and_the_capacity(monkeypatch):
    """A plain connect(), a Cluster and the CLI name a node alike (under Slurm the CLI used the host name
    while the job's stores were named after SLURMD_NODENAME); max_objects grows with capacity."""
    import socket

    from shmstore.config import Config
    for var in ("SHMSTORE_NODE", "PMI_HOSTNAME", "SLURMD_NODENAME", "SHMSTORE_MAX_OBJECTS"):
        monkeypatch.delenv(var, raising=False)
    assert Config.from_kwargs().node == socket.gethostname().split(".")[0]
    monkeypatch.setenv("SLURMD_NODENAME", "cn042")
    assert Config.from_kwargs().node == "cn042"
    monkeypatch.setenv("PMI_HOSTNAME", "n1")
    assert Config.from_kwargs().node == "n1"
    monkeypatch.setenv("SHMSTORE_NODE", "emu0")
    assert Config.from_kwargs().node == "emu0" and Config.from_kwargs(node="x").node == "x"
    assert Config.from_kwargs(capacity="64MiB").max_objects == 65536
    assert Config.from_kwargs(capacity="8GiB").max_objects == 524288
    assert Config.from_kwargs(capacity="1TiB").max_objects == 1 << 22
    assert Config.from_kwargs(capacity="8GiB", max_objects=1000).max_objects == 1000


def test_mpi_switches_are_read_here_naming_the_variable(monkeypatch):
    """The MPI layer's switches (service spin, MPICH's VCIs) are read by config.py like every other."""
    from shmstore import config
    monkeypatch.delenv("SHMSTORE_SERVICE_SPIN_US", raising=False)
    monkeypatch.delenv("MPIR_CVAR_CH4_NUM_VCIS", raising=False)
    assert config.service_spin() is None and config.mpich_vcis() == 1
    monkeypatch.setenv("SHMSTORE_SERVICE_SPIN_US", "50")
    assert config.service_spin() == pytest.approx(50e-6)
    for bad in ("-1", "2e6", "fast"):
        monkeypatch.setenv("SHMSTORE_SERVICE_SPIN_US", bad)
        with pytest.raises(ConfigError, match="SHMSTORE_SERVICE_SPIN_US"):
            config.service_spin()
    monkeypatch.setenv("MPIR_CVAR_CH4_NUM_VCIS", "4")
    assert config.mpich_vcis() == 4
    monkeypatch.setenv("MPIR_CVAR_CH4_NUM_VCIS", "many")
    assert config.mpich_vcis() == 1


@pytest.mark.parametrize("raw, off", [("1", True), ("yes", True), ("true", True), ("0", False), ("no", False),
                                      ("false", False), ("", False)])
def test_no_gpu_is_a_boolean(monkeypatch, raw, off):
    """``SHMSTORE_NO_GPU=0`` keeps the GPU level (it used to disable it: any value counted as set)."""
    from shmstore.config import no_gpu
    from shmstore.levels import device
    monkeypatch.setenv("SHMSTORE_NO_GPU", raw)
    assert no_gpu() is off
    monkeypatch.setattr(device, "_CUPY", [])  # asked again, not the answer this process kept
    _, why = device.cupy_or_reason()
    assert (why == "SHMSTORE_NO_GPU is set") is off


def test_no_gpu_rejects_nonsense(monkeypatch):
    from shmstore.config import no_gpu
    monkeypatch.setenv("SHMSTORE_NO_GPU", "maybe")
    with pytest.raises(ConfigError, match="SHMSTORE_NO_GPU"):
        no_gpu()


# ---- connect() to an existing store: the settings it keeps (issue 21 item 7) ------------------------------
def _connect_quietly(name, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning expected here
        return shmstore.connect(name, **kwargs)


def test_connect_warns_naming_each_setting_an_existing_store_ignores(name, tmp_path):
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path), max_clients=40, prefault=0):
        with pytest.warns(shmstore.ConfigWarning) as caught:
            other = shmstore.connect(name, capacity="32MiB", spill_dir=str(tmp_path / "elsewhere"),
                                     disk_capacity="1GiB", high_watermark=0.95, max_clients=40)
        other.close()
        assert len(caught) == 1 and caught[0].filename == __file__  # one warning, at the caller of connect()
        msg = str(caught[0].message)
        assert name in msg and "capacity=32.0 MiB (the store has 16.0 MiB)" in msg
        assert f"spill_dir='{tmp_path / 'elsewhere'}' (the store has '{tmp_path}')" in msg
        assert "disk_capacity=1.0 GiB (the store has" in msg and "high_watermark=0.95 (the store has 0.9)" in msg
        assert "max_clients" not in msg and "destroy" in msg  # asked as it is: not named
        assert issubclass(shmstore.ConfigWarning, shmstore.ShmStoreWarning)
        assert issubclass(shmstore.ConfigWarning, UserWarning)


def test_connect_is_quiet_when_nothing_or_the_same_is_asked(name, tmp_path):
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path), prefault=0):
        _connect_quietly(name).close()  # nothing asked: the store as it is, no word
        _connect_quietly(name, capacity="16MiB", spill_dir=str(tmp_path) + "/", session="s",
                         lock_timeout=5, prefault=0).close()  # the same, or per-connection settings only
        _connect_quietly(name, capacity=None).close()


def test_connect_strict_raises_and_leaves_the_store_as_it_was(name, tmp_path):
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path), prefault=0) as first:
        first.put("k", 1)
        with pytest.raises(ConfigError, match=r"capacity=32\.0 MiB \(the store has 16\.0 MiB\)"):
            shmstore.connect(name, capacity="32MiB", strict=True)
        _connect_quietly(name, capacity="16MiB", strict=True).close()  # strict and matching: fine
        assert first.get("k") == 1 and len(first.status()["clients"]) == 1  # no client slot left behind


def test_connect_warns_for_a_setting_asked_through_the_environment(name, tmp_path, monkeypatch):
    with shmstore.connect(name, capacity="16MiB", spill_dir=str(tmp_path), prefault=0):
        monkeypatch.setenv("SHMSTORE_CAPACITY", "24MiB")
        monkeypatch.setenv("SHMSTORE_PERSIST", "1")
        with pytest.warns(shmstore.ConfigWarning, match=r"capacity=24\.0 MiB.*persist=True \(the store has False\)"):
            shmstore.connect(name).close()

