"""examples/serve end to end: a private tensord, the FastAPI app under
gunicorn with 4 uvicorn workers on a free 127.0.0.1 port, and checks that
every answer equals a reference computed in this process from the same file,
that the workers hold one copy of the weights between them (against a run
where each reads the file privately), that a SIGKILLed worker comes back
and re-attaches, and that a new version swaps in under load with no error
and no mix, the old one freed once no worker holds it.

Run by ctest as python-serve (python/CMakeLists.txt); by hand, from build/python:
    PYTHONPATH=$PWD TENSORD_BIN=../daemon/tensord TENSORCTL_BIN=../client/tensorctl \\
        /usr/bin/python3 -m pytest -q -s -p no:cacheprovider ../../examples/serve/test_serve.py
(-s prints the memory table.)
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("gunicorn")

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(TOP, "python", "tests"))

import tensord  # noqa: E402
import make_weights  # noqa: E402
from conftest import Daemon, _die_with_parent, nothing_left, wait_until  # noqa: E402
from model import load_private, predict  # noqa: E402

NAME = "tinylm"
WORKERS = 4
TOPK = 5
# Short prompts (1 to 4 tokens): a forward pass costs ~10-30 ms of one CPU,
# and the machine running this may have two, shared.
PROMPTS = 48
BOOT_S = 180  # four workers importing torch on a loaded 2-vCPU machine


def tensorctl_bin() -> str:
    return os.environ.get("TENSORCTL_BIN") or os.path.join(
        TOP, "build", "client", "tensorctl")


# --------------------------------------------------------------------------
# The weights, and the answers they must give.

class Files:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="tensord-serve.")
        self.v1 = os.path.join(self.dir, "v1.safetensors")
        self.v2 = os.path.join(self.dir, "v2.safetensors")
        self.nbytes = make_weights.make(self.v1, seed=1)
        make_weights.make(self.v2, seed=2)


@pytest.fixture(scope="module")
def files():
    f = Files()
    try:
        yield f
    finally:
        shutil.rmtree(f.dir, ignore_errors=True)


def _prompts(vocab: int) -> List[List[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(PROMPTS):
        n = 1 + i % 4
        out.append(torch.randint(vocab, (n,), generator=g).tolist())
    return out


class Reference:
    """The answers of v1 and v2 for each prompt, computed here with plain
    torch from the files the server loads. Prompts whose top-k logits lie
    within 1e-4 of each other in either version are left out, so that the
    order of the top k cannot depend on rounding."""

    def __init__(self, files: Files) -> None:
        torch.set_num_threads(1)  # as the workers compute
        models = {1: load_private(files.v1), 2: load_private(files.v2)}
        self.prompts: List[List[int]] = []
        self.answers: Dict[int, list] = {1: [], 2: []}
        for p in _prompts(models[1].cfg["vocab"]):
            tops = {}
            for v, m in models.items():
                vals = m.head(m.hidden(torch.tensor([p]))[0, -1]).detach()
                vals = vals.topk(TOPK + 1).values
                if (vals[:-1] - vals[1:]).min() < 1e-4:
                    break
                tops[v] = predict(m, p, TOPK)
            else:
                self.prompts.append(p)
                for v in models:
                    self.answers[v].append(tops[v])
        self.answers[0] = self.answers[1]  # SERVE_PRIVATE=1 reads v1's file
        assert len(self.prompts) >= PROMPTS // 2

    def check(self, i: int, answer: dict, versions=(1, 2)) -> int:
        """Asserts answer is version v's answer to prompt i for a v in
        versions; returns v. v2's weights differ from v1's everywhere, so
        an answer that mixed them would match neither."""
        v = answer["version"]
        assert v in versions, answer
        token, top = self.answers[v][i]
        assert answer["next_token"] == token, (i, answer, top)
        got = [(e["token"], e["logit"]) for e in answer["top_k"]]
        assert [t for t, _ in got] == [t for t, _ in top], (i, answer, top)
        for (_, a), (_, b) in zip(got, top):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (i, answer, top)
        return v


@pytest.fixture(scope="module")
def ref(files) -> Reference:
    return Reference(files)


# --------------------------------------------------------------------------
# tensord, and the server under gunicorn.

@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    try:
        yield d
    finally:
        try:
            with tensord.connect(d.sock) as c:
                try:
                    c.unload_model(NAME)
                except tensord.NotFound:
                    pass
                wait_until(lambda: nothing_left(c), "no storage and no key left")
        finally:
            d.stop()  # asserts that no segment is left in /dev/shm


class Server:
    """gunicorn -k uvicorn.workers.UvicornWorker -w 4 app:app on a socket
    this process bound to a free port of 127.0.0.1 (passed as fd://N, so no
    other process can take the port between choosing and binding it)."""

    def __init__(self, env: dict) -> None:
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(256)
        self.port = lsock.getsockname()[1]
        self.url = "http://127.0.0.1:%d" % self.port
        self.logpath = tempfile.mktemp(prefix="tensord-serve.", suffix=".log")
        fd = lsock.fileno()
        full = dict(os.environ)
        full.update(env)
        with open(self.logpath, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn",
                 "-k", "uvicorn.workers.UvicornWorker", "-w", str(WORKERS),
                 "--bind", "fd://%d" % fd, "--chdir", HERE,
                 "--timeout", "120", "--graceful-timeout", "20",
                 "app:app"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(fd,), env=full, preexec_fn=_die_with_parent,
            )
        lsock.close()  # gunicorn has its own
        try:
            self._wait_ready()
        except BaseException:
            self.stop(check=False)
            raise

    def log(self) -> str:
        try:
            with open(self.logpath, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + BOOT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("gunicorn exited with %d:\n%s"
                                   % (self.proc.returncode, self.log()))
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not answer within %d s:\n%s"
                           % (BOOT_S, self.log()))

    def workers(self) -> List[int]:
        """The master's children: its workers."""
        p = self.proc.pid
        try:
            with open("/proc/%d/task/%d/children" % (p, p)) as f:
                return sorted(int(x) for x in f.read().split())
        except FileNotFoundError:
            return []

    def stop(self, check: bool = True) -> None:
        """SIGTERM to the master, which stops its workers gracefully."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                if check:
                    raise AssertionError("gunicorn did not stop within 60 s "
                                         "of SIGTERM:\n" + self.log())
        log = self.log()
        os.unlink(self.logpath)
        if check:
            assert self.proc.returncode == 0, (
                "gunicorn exited with %d:\n%s" % (self.proc.returncode, log))


@pytest.fixture(scope="module")
def server(daemon, files, ref):
    s = Server({"SERVE_MODEL": files.v1, "SERVE_NAME": NAME,
                "SERVE_SOCKET": daemon.sock, "SERVE_TOPK": str(TOPK)})
    try:
        yield s
    finally:
        s.stop()


# --------------------------------------------------------------------------
# Requests.

_http = None


@pytest.fixture(scope="module", autouse=True)
def _close_http():
    yield
    global _http
    if _http is not None:
        _http.close()
        _http = None


def http():
    """One client for every thread, which keeps no connection alive: a
    pooled connection to a worker that was killed would fail, and a new
    connection goes to whichever worker accepts first. (One client: making
    one per request costs more CPU than the request.)"""
    global _http
    if _http is None:
        _http = httpx.Client(timeout=120, limits=httpx.Limits(
            max_connections=64, max_keepalive_connections=0))
    return _http


def ask(url: str, tokens: List[int]) -> dict:
    """One POST /predict on a connection of its own."""
    r = http().post(url + "/predict", json={"tokens": tokens},
                    headers={"Connection": "close"})
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


def burst(server: Server, ref: Reference, n: int, threads: int = 32,
          versions=(1,)) -> List[dict]:
    """n requests from threads threads at once; every answer checked."""
    order = [i % len(ref.prompts) for i in range(n)]
    random.Random(n).shuffle(order)
    with ThreadPoolExecutor(threads) as ex:
        answers = list(ex.map(lambda i: (i, ask(server.url, ref.prompts[i])),
                              order))
    for i, a in answers:
        ref.check(i, a, versions)
    return [a for _, a in answers]


def serve_every_worker(server: Server, ref: Reference, versions=(1,),
                       timeout: float = BOOT_S) -> set:
    """Bursts until each of the master's workers has answered; returns the
    pids that answered."""
    seen: set = set()
    deadline = time.monotonic() + timeout
    while True:
        seen |= {a["pid"] for a in burst(server, ref, 64, versions=versions)}
        workers = set(server.workers())
        if len(workers) == WORKERS and workers <= seen:
            return seen
        assert time.monotonic() < deadline, (
            "workers %s never answered (these did: %s)" % (workers - seen, seen))


# --------------------------------------------------------------------------
# Memory.

def pss(pid: int, inst: Optional[str]) -> dict:
    """pid's PSS in bytes: its whole (smaps_rollup: "total", "anon",
    "file"), and that of its mappings of the daemon's segments (smaps:
    "segments", and "segments_private_dirty", what copy-on-write copied)."""
    out = {"total": 0, "anon": 0, "file": 0, "segments": 0,
           "segments_private_dirty": 0}
    rollup = {"Pss:": "total", "Pss_Anon:": "anon", "Pss_File:": "file"}
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for line in f:
            field = line.split(None, 1)[0]
            if field in rollup:
                out[rollup[field]] = int(line.split()[1]) * 1024
    if inst is None:
        return out
    prefix = "/dev/shm/tensord.%s." % inst
    ours = False
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping's first line
                fields = line.split()
                ours = len(fields) >= 6 and fields[5].startswith(prefix)
            elif ours and head == "Pss:":
                out["segments"] += int(line.split()[1]) * 1024
            elif ours and head == "Private_Dirty:":
                out["segments_private_dirty"] += int(line.split()[1]) * 1024
    return out


def segments_mapped(pid: int, inst: str) -> set:
    """The daemon's segments pid maps (their /dev/shm names)."""
    prefix = "/dev/shm/tensord.%s." % inst
    names = set()
    with open("/proc/%d/maps" % pid) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(prefix):
                names.add(fields[5])
    return names


MEASURED: Dict[str, dict] = {}


def measure(server: Server, inst: Optional[str]) -> dict:
    """The workers' PSS, each and summed."""
    per = {pid: pss(pid, inst) for pid in server.workers()}
    out = {k: sum(p[k] for p in per.values())
           for k in ("total", "anon", "file", "segments")}
    out["workers"] = per
    return out


def table(files: Files) -> str:
    """What was measured, as docs/serving.md shows it."""
    mb = 1e6
    w = files.nbytes
    rows = ["weights %.1f MB, %d workers; PSS in MB, summed over the workers"
            % (w / mb, WORKERS),
            "%-9s %8s %11s %10s %8s %8s %12s" % (
                "workers", "total", "per worker", "segments", "anon", "file",
                "anon/weights")]
    for kind in ("private", "attached"):
        m = MEASURED.get(kind)
        if m is not None:
            rows.append("%-9s %8.1f %11.1f %10.1f %8.1f %8.1f %12.2f" % (
                kind, m["total"] / mb, m["total"] / mb / WORKERS,
                m["segments"] / mb, m["anon"] / mb, m["file"] / mb,
                m["anon"] / w))
    return "\n".join(rows)


# --------------------------------------------------------------------------
# The tests, in order: each leaves the server serving.

def test_private_workers_hold_a_copy_each(files, ref):
    """The baseline, first (before the attached server starts, so that both
    runs share the libraries' pages with the same other processes):
    SERVE_PRIVATE=1, each worker reads v1's file with plain torch, no
    tensord, and holds a copy of the weights of its own."""
    s = Server({"SERVE_MODEL": files.v1, "SERVE_PRIVATE": "1",
                "SERVE_TOPK": str(TOPK)})
    try:
        serve_every_worker(s, ref, versions=(0,))  # 0: private, v1's file
        m = measure(s, None)
    finally:
        s.stop()
    MEASURED["private"] = m
    print("\n" + table(files))
    for pid, p in m["workers"].items():
        assert p["anon"] >= files.nbytes, (pid, p)


def test_concurrent_requests_match_the_reference(server, ref):
    answers = burst(server, ref, 256, threads=32)
    assert {a["version"] for a in answers} == {1}
    serve_every_worker(server, ref)


def test_the_workers_hold_one_copy_of_the_weights(server, ref, daemon, files):
    serve_every_worker(server, ref)  # each has read every weight
    m = measure(server, "%016x" % daemon.instance)
    MEASURED["attached"] = m
    print("\n" + table(files))
    w = files.nbytes
    # PSS divides a shared page among its mappers: the workers' mappings of
    # the segments sum to one copy. Copy-on-write copied nothing.
    assert 0.9 * w <= m["segments"] <= 1.1 * w, table(files)
    for pid, p in m["workers"].items():
        assert p["segments_private_dirty"] < 1 << 20, (pid, p)
    # So their total PSS is at most 1.1 copies more than the rest, which is
    # their own (interpreter, torch, threads, activations) and holds no
    # copy: private workers' anonymous memory is four copies more than
    # theirs (3.78 measured; tensord's client and the follower's thread are
    # the difference).
    private = MEASURED.get("private")
    if private is None:
        pytest.skip("no private run to compare with (run the whole module)")
    assert private["anon"] - m["anon"] >= 3 * w, table(files)


def test_a_killed_worker_is_restarted_and_reattaches(server, ref, daemon):
    before = server.workers()
    assert len(before) == WORKERS
    victim = before[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: victim not in server.workers()
               and len(server.workers()) == WORKERS,
               "gunicorn replaces the killed worker %d" % victim, timeout=BOOT_S)
    new = set(server.workers()) - set(before)
    assert len(new) == 1, (before, server.workers())
    (newpid,) = new
    # Requests while it boots go to the others, and none fails.
    burst(server, ref, 200)
    deadline = time.monotonic() + BOOT_S
    while newpid not in {a["pid"] for a in burst(server, ref, 64)}:
        assert time.monotonic() < deadline, "the new worker never answered"
    # It attached the model tensord had; the dead one holds nothing.
    inst = "%016x" % daemon.instance
    assert segments_mapped(newpid, inst)
    with tensord.connect(daemon.sock) as c:
        holders = {h["pid"] for s in c.ls() for h in s["holders"]}
    assert newpid in holders and victim not in holders, holders


def test_a_new_version_swaps_in_while_requests_flow(server, ref, daemon, files):
    with tensord.connect(daemon.sock) as c:
        # (ls() lists 32 keys a storage at most: look the shard key up.)
        t = c.lookup("%s@1/%s" % (NAME, os.path.basename(files.v1)),
                     readonly=True, lazy=True)
        v1 = {t.storage_id}
        t.release()
    inst = "%016x" % daemon.instance
    answers: List[tuple] = []
    errors: List[BaseException] = []
    stop = threading.Event()
    lock = threading.Lock()

    def flow(seed: int) -> None:
        rnd = random.Random(seed)
        while not stop.is_set():
            i = rnd.randrange(len(ref.prompts))
            try:
                a = ask(server.url, ref.prompts[i])
            except BaseException as e:  # noqa: B036 - reported below
                with lock:
                    errors.append(e)
                return
            with lock:
                answers.append((i, a))

    threads = [threading.Thread(target=flow, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(answers) >= 40 or errors, "40 answers of v1",
                   timeout=BOOT_S)
        r = subprocess.run(
            [tensorctl_bin(), "--socket", daemon.sock, "load", files.v2,
             "--as", NAME, "--force"],
            capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "version 2" in r.stdout, r.stdout
        # Flow on until every worker has answered from v2.
        def all_on_v2() -> bool:
            with lock:
                on2 = {a["pid"] for _, a in answers if a["version"] == 2}
            return bool(errors) or set(server.workers()) <= on2
        wait_until(all_on_v2, "every worker answers from v2", timeout=BOOT_S)
        n = len(answers)
        wait_until(lambda: len(answers) >= n + 40 or errors,
                   "40 answers more", timeout=BOOT_S)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    versions = [ref.check(i, a, versions=(1, 2)) for i, a in answers]
    assert versions[0] == 1 and versions[-1] == 2
    assert set(versions) == {1, 2}
    # v1 is freed once no worker holds it: no storage, no mapping left.
    def v1_gone() -> bool:
        with tensord.connect(daemon.sock) as c:
            return not v1 & {s["id"] for s in c.ls()}
    wait_until(v1_gone, "v1's storages %s freed" % sorted(v1), timeout=30)
    for pid in server.workers():
        for name in segments_mapped(pid, inst):
            sid = int(name.rsplit(".", 1)[1].split("-")[0])
            assert sid not in v1, (pid, name)
    burst(server, ref, 64, versions=(2,))


def test_a_worker_restarted_after_the_swap_serves_the_new_version(
        server, ref, daemon):
    before = server.workers()
    victim = before[-1]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: victim not in server.workers()
               and len(server.workers()) == WORKERS,
               "gunicorn replaces the killed worker %d" % victim, timeout=BOOT_S)
    (newpid,) = set(server.workers()) - set(before)
    deadline = time.monotonic() + BOOT_S
    while newpid not in {a["pid"] for a in burst(server, ref, 64, versions=(2,))}:
        assert time.monotonic() < deadline, "the new worker never answered"
    # It attached v2; it did not load SERVE_MODEL (v1's file) over it.
    with tensord.connect(daemon.sock) as c:
        version, _, items = c.open_model(NAME)
        for _, t in items:
            t.release()
    assert version == 2
