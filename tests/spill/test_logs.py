"""The spill process holds none of its creator's stdio nor its session, and what it logs stays visible."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import shmstore
from shmstore.config import Config

from helpers import ROOT, shm_segments, spill_running, wait_for

CREATOR = """
import os, sys, shmstore
s = shmstore.connect(os.environ['N'], capacity='16MiB', spill_dir=os.environ['D'])
s.put('a', b'x' * 1000)
print(s.spill_pid, flush=True)
if os.environ.get('WAIT'):
    sys.stdin.readline()  # until the test has attached
assert s.wait_spill_ready(30)  # it runs, and logs (a spill process still starting at close is stopped)
s.close()
"""


def _env(name: str, spill_dir: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, N=name, D=spill_dir, **extra)
    for var in ("SHMSTORE_LOG", "SHMSTORE_LOG_FILE"):
        if var not in extra:
            env.pop(var, None)
    return env


def _log_path(name: str, spill_dir: str) -> str:
    return os.path.join(spill_dir, f"shmstore-{os.getuid()}-{name}-{Config.from_kwargs().node}.log")


def _gone(name: str) -> bool:
    return not any(f"-{name}-" in s for s in shm_segments())


def _creator(name: str, spill_dir: str, **env: str) -> subprocess.Popen[bytes]:
    """The creating process, its stdio pipes as ``subprocess.run(capture_output=True)`` or ``| tee`` make
    them, in a session of its own (as a terminal's foreground job is)."""
    return subprocess.Popen([sys.executable, "-c", CREATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(name, spill_dir, WAIT="1", **env),
                            start_new_session=True)


def test_a_runner_reading_the_creators_output_is_not_held_by_the_spill_process(name, tmp_path):
    """Regression (issue 19): a step run under ``subprocess.run(capture_output=True)`` or ``| tee`` that made a
    store others attached to: the runner waited for the end of the step's pipes, held open by the spill
    process, until the last client closed."""
    creator = _creator(name, str(tmp_path))
    try:
        spill = int(creator.stdout.readline())
        with shmstore.connect(name, create=False) as s:  # another client: the store and its spill process stay
            t0 = time.monotonic()
            out, err = creator.communicate(b"\n", timeout=30)  # reads to the pipes' end, as a runner does
            assert creator.returncode == 0, err
            assert time.monotonic() - t0 < 10
            assert spill_running(spill) and s.get("a") == b"x" * 1000
            held = {fd: os.readlink(f"/proc/{spill}/fd/{fd}") for fd in (0, 1, 2)}
            assert not [t for t in held.values() if t.startswith(("pipe:", "socket:"))], held
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.communicate(timeout=30)
    assert wait_for(lambda: _gone(name), timeout=15)


def test_signals_to_the_creators_terminal_do_not_reach_the_spill_process(name, tmp_path):
    """Ctrl-C, Ctrl-\\, Ctrl-Z and a hangup go to the terminal's foreground process group: the creator's, not
    the spill process's (a session of its own), which keeps serving the clients left."""
    creator = _creator(name, str(tmp_path))
    try:
        spill = int(creator.stdout.readline())
        with shmstore.connect(name, create=False) as s:
            group = os.getpgid(creator.pid)
            assert os.getsid(spill) == spill != os.getsid(creator.pid) and os.getpgid(spill) != group
            for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGHUP):
                os.killpg(group, sig)
            os.killpg(group, signal.SIGCONT)
            creator.communicate(timeout=30)  # it died of one of them
            time.sleep(0.3)
            with open(f"/proc/{spill}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            assert state in (b"S", b"R"), state  # neither dead nor stopped
            s.put("b", b"still served")
            assert s.spill_pid == spill and s.get("a") == b"x" * 1000
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.communicate(timeout=30)
    assert wait_for(lambda: _gone(name), timeout=15)


def _run_creator(name: str, spill_dir: str, stderr: object = subprocess.PIPE, **env: str) -> str:
    """Run the creator to its end (it closes the store, the last client); returns its captured stderr."""
    r = subprocess.run([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, stderr=stderr, timeout=60,
                       env=_env(name, spill_dir, **env))
    assert r.returncode == 0
    assert wait_for(lambda: _gone(name), timeout=15)
    return r.stderr.decode() if isinstance(r.stderr, bytes) else ""


def test_problems_go_to_a_log_file_beside_the_spill_directory_where_stderr_is_a_pipe(name, tmp_path):
    """The creator's stderr is a pipe: the spill process's warnings go to <spill root>/shmstore-...log, made at
    the first line; a store without problems leaves no file."""
    log = _log_path(name, str(tmp_path))
    err = _run_creator(name, str(tmp_path), SHMSTORE_LOG="loud")  # a bad value: the spill process warns
    assert "SHMSTORE_LOG" not in err, err
    assert wait_for(lambda: os.path.exists(log) and "SHMSTORE_LOG" in open(log).read(), timeout=10)
    assert os.stat(log).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == [os.path.basename(log)]  # the store's spill directory went with it
    quiet = name + "q"
    _run_creator(quiet, str(tmp_path))
    assert not os.path.exists(_log_path(quiet, str(tmp_path)))
    chatty = name + "i"
    _run_creator(chatty, str(tmp_path), SHMSTORE_LOG="info")
    assert "removed the store" in open(_log_path(chatty, str(tmp_path))).read()


def test_problems_go_to_the_creators_stderr_where_it_is_a_file(name, tmp_path):
    """A batch job's output file (``2> log``): nobody waits for its end, so the spill process shares it."""
    out = tmp_path / "job.err"
    spill_dir = tmp_path / "spill"
    with open(out, "wb") as f:
        _run_creator(name, str(spill_dir), stderr=f, SHMSTORE_LOG="loud")
    assert wait_for(lambda: "SHMSTORE_LOG" in out.read_text(), timeout=10), out.read_text()
    assert not os.path.exists(_log_path(name, str(spill_dir)))


def test_shmstore_log_file_names_the_log_and_its_missing_parents_are_made(name, tmp_path):
    log = tmp_path / "logs" / "job42" / "spill.log"
    _run_creator(name, str(tmp_path), SHMSTORE_LOG="loud", SHMSTORE_LOG_FILE=str(log))
    assert wait_for(lambda: log.exists() and "SHMSTORE_LOG" in log.read_text(), timeout=10)
    assert os.stat(log.parent).st_mode & 0o777 == 0o700


def test_status_names_the_log_of_a_spill_process_that_reported_problems(name, tmp_path):
    creator = _creator(name, str(tmp_path), SHMSTORE_LOG="loud")
    try:
        creator.stdout.readline()
        log = _log_path(name, str(tmp_path))
        assert wait_for(lambda: os.path.exists(log), timeout=10)
        cmd = [sys.executable, "-m", "shmstore", "--name", name]
        st = json.loads(subprocess.run(cmd + ["--json", "status"], capture_output=True, timeout=60).stdout)
        assert st["spill"]["log"] == log
        text = subprocess.run(cmd + ["status"], capture_output=True, text=True, timeout=60).stdout
        assert f"log (problems it reported): {log}" in text
    finally:
        creator.communicate(b"\n", timeout=30)
    assert wait_for(lambda: _gone(name), timeout=15)


def test_a_fifo_or_link_planted_as_the_log_file_is_neither_waited_on_nor_followed(name, tmp_path):
    """The log sits in a directory anybody may write (/tmp) under a predictable name."""
    fifo_store, link_store = name + "f", name + "l"
    os.mkfifo(_log_path(fifo_store, str(tmp_path)))
    target = tmp_path / "precious"
    target.write_text("theirs\n")
    os.symlink(target, _log_path(link_store, str(tmp_path)))
    for store in (fifo_store, link_store):
        t0 = time.monotonic()
        _run_creator(store, str(tmp_path), SHMSTORE_LOG="loud")  # the store works and goes with its client
        assert time.monotonic() - t0 < 30
    assert target.read_text() == "theirs\n"
    assert os.path.islink(_log_path(link_store, str(tmp_path)))
    import stat
    assert stat.S_ISFIFO(os.lstat(_log_path(fifo_store, str(tmp_path))).st_mode)
