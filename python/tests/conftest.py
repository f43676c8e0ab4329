"""Fixtures: a private tensord per test module, and a client per test.

The daemon is the build's ($TENSORD_BIN, set by ctest; else build/daemon/
tensord), started on a socket in /tmp/tensord-test.<tag>.XXXXXX like the C
harness (tests/lib/harness.c), its instance recorded in
/tmp/tensord-test.<tag>.instances for tests/check-clean.sh. At the end of each
module it is stopped with SIGTERM, and no segment of it may be left.
"""

from __future__ import annotations

import ctypes
import gc
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator, List, Optional

import pytest

import tensord

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(os.path.dirname(HERE))


def tensord_bin() -> str:
    return os.environ.get("TENSORD_BIN") or os.path.join(
        TOP, "build", "daemon", "tensord"
    )


def tag() -> str:
    path = os.environ.get("TDT_TAG_FILE")
    if path and os.path.exists(path):
        with open(path) as f:
            t = f.read().strip()
        if t:
            return t
    return "python"


def daemon_env() -> dict:
    """tensord's environment: ours, except under make asan, where ctest
    preloads libasan into the interpreter with leak checks off
    (python/CMakeLists.txt): tensord, an ASan binary of its own, gets no
    preload and TDT_DAEMON_ASAN_OPTIONS (leak checks on)."""
    env = dict(os.environ)
    opts = env.get("TDT_DAEMON_ASAN_OPTIONS")
    if opts is not None:
        env.pop("LD_PRELOAD", None)
        env["ASAN_OPTIONS"] = opts
    return env


def _die_with_parent() -> None:
    # A test run that dies takes its daemon with it (SIGTERM cleans up).
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Daemon:
    """A tensord of our own on a temporary socket."""

    def __init__(self, args: Optional[List[str]] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"tensord-test.{tag()}.", dir="/tmp")
        self.sock = os.path.join(self.dir, "tensord.sock")
        self.logpath = os.path.join(self.dir, "tensord.log")
        log = open(self.logpath, "wb")
        self.proc = subprocess.Popen(
            [tensord_bin(), "--socket", self.sock, "--log-level", "debug"]
            + list(args or []),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            env=daemon_env(),
        )
        log.close()
        self._wait_ready()
        with tensord.connect(self.sock) as c:
            self.instance = c.stat()["instance"]
        with open(f"/tmp/tensord-test.{tag()}.instances", "a") as f:
            f.write(f"{self.instance:016x}\n")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tensord exited with {self.proc.returncode}:\n{self.log()}"
                )
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.sock)
                return
            except OSError:
                time.sleep(0.01)
            finally:
                s.close()
        raise RuntimeError(f"tensord did not listen within 10 s:\n{self.log()}")

    def log(self) -> str:
        try:
            with open(self.logpath, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def segments(self) -> List[str]:
        """This daemon's segments in /dev/shm: its storages' and its
        recycling pool's (tensord.<instance>-pool.*), which a clean stop
        unlinks too."""
        inst = f"{self.instance:016x}"
        return glob.glob(f"/dev/shm/tensord.{inst}.*") + glob.glob(
            f"/dev/shm/tensord.{inst}-pool.*"
        )

    def stop(self) -> None:
        """SIGTERM, wait; asserts that no segment is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("tensord did not stop within 10 s of SIGTERM")
        left = self.segments()
        log = self.log()
        shutil.rmtree(self.dir, ignore_errors=True)
        assert not left, f"segments left in /dev/shm: {left}\n{log}"
        assert self.proc.returncode == 0, (
            f"tensord exited with {self.proc.returncode}\n{log}"
        )


@pytest.fixture(scope="module")
def tensord_daemon() -> Iterator[Daemon]:
    """A tensord for this module."""
    d = Daemon()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def daemon(tensord_daemon: Daemon) -> str:
    """The socket path of this module's tensord."""
    return tensord_daemon.sock


def storages(sock: str) -> list:
    """Every live storage, seen by a connection of its own."""
    with tensord.connect(sock) as c:
        return c.ls()


def wait_storages(sock: str, pred, timeout: float = 2.0) -> list:
    """Polls ls() until pred(list) holds (releases are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        ls = storages(sock)
        if pred(ls) or time.monotonic() > deadline:
            return ls
        time.sleep(0.01)


def wait_until(pred, what: str, timeout: float = 10.0) -> None:
    """Polls pred until it is true; fails the test naming what after timeout."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail("still not true after %.0f s: %s" % (timeout, what))
        time.sleep(0.02)


def nothing_left(client: tensord.Client) -> bool:
    """No storage and no key left in client's daemon."""
    return not client.ls() and client.stat()["keys"] == 0


@pytest.fixture
def client(daemon: str) -> Iterator[tensord.Client]:
    """A client of the module's daemon. After the test: the keys the test
    left are removed, and every storage must then be gone."""
    c = tensord.connect(daemon)
    try:
        yield c
    finally:
        c.close()
        gc.collect()
        with tensord.connect(daemon) as check:
            for s in check.ls():
                for k in s["keys"]:
                    try:
                        check.unpublish(k)
                    except tensord.NotFound:
                        pass
        left = wait_storages(daemon, lambda ls: not ls)
        assert not left, f"storages left after the test: {left}"


@pytest.fixture
def clean(client: tensord.Client) -> Iterator[tensord.Client]:
    """The client fixture, and after the test: nothing of it left in the
    daemon, no storage and no key (modules that install reducers or
    scopes override it)."""
    yield client
    gc.collect()
    wait_until(lambda: nothing_left(client), "no storage and no key left")
