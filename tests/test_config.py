"""Config precedence and validation."""
from __future__ import annotations

import pytest

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
