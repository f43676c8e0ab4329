"""benchlib: what the Python benchmarks share (a private tensord, percentiles, tables).

Every benchmark in python/bench/ runs as ``/usr/bin/python3 python/bench/X.py [--quick]``:
it starts its own tensord on a socket in a fresh /tmp directory (the binary is
$TENSORD_BIN, else <repo>/build/daemon/tensord), points $TENSORD_SOCKET at it so
that every process it forks finds that daemon and no other, and stops it at the
end, checking that the daemon left nothing in /dev/shm. The tensord package is
taken from $PYTHONPATH, else from <repo>/build/python (or $TENSORD_BUILD/python).

Tables follow tests/bench/*.c: percentiles by nearest rank (with fewer than 100
samples p99 is the maximum), sizes as "4 KiB", ratios to the baseline measured in
the same run, and a closing "targets (reported, not enforced)" section.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def build_dir() -> str:
    """Returns the build tree: $TENSORD_BUILD, else <repo>/build."""
    return os.environ.get("TENSORD_BUILD") or os.path.join(REPO, "build")


def add_package_path() -> None:
    """Makes ``import tensord`` find the build tree's package when PYTHONPATH does not.

    Forked children inherit sys.path; the path also goes into $PYTHONPATH so that
    spawned ones (torch's shm manager, spawn contexts) see the same package.
    """
    path = os.path.join(build_dir(), "python")
    if os.path.isdir(path) and path not in sys.path:
        try:
            import tensord  # noqa: F401  (already importable: leave it)
        except ImportError:
            sys.path.insert(0, path)
            old = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = path + (os.pathsep + old if old else "")


def import_tensord() -> tuple[Any, Any, str | None]:
    """Returns (tensord, tensord.torch, None), or (None, None, why) when they do not import."""
    add_package_path()
    try:
        import tensord
    except Exception as e:  # ImportError, or a broken build's OSError
        return None, None, f"import tensord: {type(e).__name__}: {e}"
    try:
        import tensord.torch as tdt
    except Exception as e:
        return tensord, None, f"import tensord.torch: {type(e).__name__}: {e}"
    return tensord, tdt, None


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the options every benchmark takes (--quick); adds .scale.

    scale multiplies every time budget: 1 in full mode, 0.2 with --quick, times
    $TD_BENCH_SCALE (as for the C benchmarks) when that is set.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="a short run (smaller sizes and budgets; < 40 s)")
    args = p.parse_args(argv)
    scale = 0.2 if args.quick else 1.0
    try:
        env = float(os.environ.get("TD_BENCH_SCALE", "1"))
    except ValueError:
        env = 1.0
    args.scale = scale * (env if env > 0 else 1.0)
    return args


def pct(samples: Sequence[float], p: float) -> float:
    """Returns the p-th percentile by nearest rank (as bench_pct in tests/bench/bench.c); nan if empty."""
    if not samples:
        return math.nan
    s = sorted(samples)
    rank = max(1, min(len(s), math.ceil(p / 100.0 * len(s) - 1e-9)))
    return s[rank - 1]


def median(samples: Sequence[float]) -> float:
    """Returns the median (mean of the two middle samples when even); nan if empty."""
    if not samples:
        return math.nan
    s = sorted(samples)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def size_str(n: int) -> str:
    """Formats n bytes as "4 KiB", "64 MiB" (as bench_size), else e.g. "500.1 MB"."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    u = 0
    v = n
    while u < 4 and v >= 1024 and v % 1024 == 0:
        v //= 1024
        u += 1
    if u == 0 and n >= 1024:
        return f"{n / 1e6:.1f} MB"
    return f"{v} {units[u]}"


def ratio_str(a: float, b: float) -> str:
    """Formats a / b as "1.23", or "-" when either is missing."""
    if b is None or a is None or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}"


def cpu_pair() -> tuple[int, int]:
    """Returns (producer CPU, consumer CPU): the first two CPUs this process may use.

    (-1, -1) when it may use only one: then nothing is pinned.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return -1, -1
    return cpus[0], cpus[1]


def pin(cpu: int) -> None:
    """Pins the calling process to cpu; nothing when cpu < 0."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})


def pss_bytes(pid: int) -> int:
    """Returns the Pss of process pid from /proc/PID/smaps_rollup, in bytes."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")


def meminfo(key: str) -> int:
    """Returns "Key: N kB" of /proc/meminfo in bytes, or -1."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def shm_total() -> int:
    """Returns the size of /dev/shm in bytes."""
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize



class Child:
    """A child process answering commands over a pipe: target(conn, *args)
    runs in it (forked, or spawned with start="spawn"); call() sends a
    command tuple and returns the child's ("ok", result) result or raises
    with its ("error", traceback)."""

    def __init__(self, target, *args, start: str = "fork") -> None:
        import multiprocessing

        ctx = multiprocessing.get_context(start)
        self.conn, end = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(end, *args))
        self.proc.start()
        end.close()
        self.pid = self.proc.pid

    def reply(self, timeout: float = 600):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"child {self.pid} did not answer in {timeout:.0f} s")
        status, res = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"child {self.pid} failed:\n{res}")
        return res

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.reply()

    def close(self, timeout: float = 60) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("quit",))
                self.reply(timeout)
            except (OSError, EOFError, RuntimeError):
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

class Daemon:
    """A private tensord on a temporary socket, for one benchmark run.

    ``with Daemon() as d:`` starts it (``--socket PATH --log-level warn
    --capacity`` all of /dev/shm, as tests/bench/run.sh does), sets
    $TENSORD_SOCKET to d.socket, and at the end stops it with SIGTERM (SIGKILL after
    10 s), removes any segment it left in /dev/shm and records that as a failure
    (d.failed), and prints its log of warnings and errors on stderr.
    """

    def __init__(self) -> None:
        self.binary = os.environ.get("TENSORD_BIN") or os.path.join(
            build_dir(), "daemon", "tensord")
        self.dir = ""
        self.socket = ""
        self.proc: subprocess.Popen | None = None
        self.prefixes: list[str] = []
        self.failed = False
        self.version = "?"

    def __enter__(self) -> "Daemon":
        if not os.access(self.binary, os.X_OK):
            raise SystemExit(f"{os.path.basename(sys.argv[0])}: {self.binary} not built "
                             "(cmake --build build, or set TENSORD_BIN)")
        self.dir = tempfile.mkdtemp(prefix="tensord-bench.")
        self.socket = os.path.join(self.dir, "tensord.sock")
        self.log = open(os.path.join(self.dir, "tensord.log"), "w+")
        args = [self.binary, "--socket", self.socket, "--log-level", "warn",
                "--capacity", f"{shm_total() // 1024}K"]
        try:
            out = subprocess.run([self.binary, "--version"], capture_output=True,
                                 text=True, timeout=10).stdout.split()
            self.version = out[1] if len(out) > 1 else "?"
        except (OSError, subprocess.SubprocessError):
            pass
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                self._stop()
                raise SystemExit(f"tensord exited with {self.proc.returncode} at start")
            if os.path.exists(self.socket) and self._accepts():
                break
            if time.monotonic() > deadline:
                self._stop()
                raise SystemExit("tensord did not start in 10 s")
            time.sleep(0.02)
        # The daemon names its segment prefixes in <socket>.instance (daemon/server/start.c).
        try:
            with open(self.socket + ".instance") as f:
                self.prefixes = [ln.strip().lstrip("/") for ln in f if ln.strip()]
        except OSError:
            self.prefixes = []
        os.environ["TENSORD_SOCKET"] = self.socket
        return self

    def _accepts(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def header(self) -> str:
        """Returns the line a benchmark prints first: daemon, CPUs, /dev/shm, versions."""
        import numpy
        import torch
        return (f"tensord {self.version} (pid {self.proc.pid if self.proc else '?'}) on "
                f"{self.socket}; {os.cpu_count()} CPU(s), /dev/shm "
                f"{shm_total() / 2**30:.0f}G; python {sys.version.split()[0]}, "
                f"torch {torch.__version__}, numpy {numpy.__version__}")

    def leftovers(self) -> list[str]:
        """Returns the names in /dev/shm that carry one of this daemon's prefixes."""
        names: list[str] = []
        for p in self.prefixes:
            names += glob.glob(os.path.join("/dev/shm", glob.escape(p) + "*"))
        return sorted(set(names))

    def _stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                print("tensord ignored SIGTERM for 10 s; killing it", file=sys.stderr)
                p.kill()
                p.wait()
                self.failed = True
        left = self.leftovers()
        if left:
            print(f"tensord left {len(left)} segment(s) in /dev/shm; removing them",
                  file=sys.stderr)
            for n in left:
                try:
                    os.unlink(n)
                except OSError:
                    pass
            self.failed = True
        if p is not None and p.returncode not in (0, None, -signal.SIGTERM):
            print(f"tensord exited with {p.returncode}", file=sys.stderr)
            self.failed = True
        if self.dir:
            self.log.flush()
            self.log.seek(0)
            text = self.log.read()
            self.log.close()
            if text.strip():
                print("---- tensord's log (warnings and errors) ----", file=sys.stderr)
                print(text, end="" if text.endswith("\n") else "\n", file=sys.stderr)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def __exit__(self, *exc: object) -> None:
        self._stop()
        if os.environ.get("TENSORD_SOCKET") == self.socket:
            del os.environ["TENSORD_SOCKET"]


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                align: str | None = None, indent: int = 2) -> None:
    """Prints rows under header in columns; align: one char per column, "<" or ">" (default: first two left)."""
    n = len(header)
    if align is None:
        align = "<<" + ">" * (n - 2)
    widths = [len(h) for h in header]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    pad = " " * indent
    for r in [header, *rows]:
        cells = [(c.ljust(widths[i]) if align[i] == "<" else c.rjust(widths[i]))
                 for i, c in enumerate(r)]
        print(pad + "  ".join(cells).rstrip())
