"""Processes and threads: fork, spawn, Ctrl-C, several threads on a Client."""

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np

import tensord

import _children
from conftest import wait_storages


def run_in_child(fn):
    """Forks; the child runs fn() and exits 0 if it returned, 1 if it raised
    (printing why). Returns the child's exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException as e:  # report anything, never return to pytest
            print(f"child: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_forked_child_uses_the_parents_client(daemon, client):
    t = client.share(np.arange(6, dtype=np.int64), key="parent")
    sid = t.storage_id

    def child():
        # The inherited Tensor: readable (and, here, shared) at once.
        assert t.numpy().tolist() == list(range(6))
        # The first call reconnects transparently.
        u = client.lookup("parent", timeout=1)
        assert u.storage_id == sid and u.numpy().tolist() == list(range(6))
        v = client.share(np.full(3, 7, np.int16))
        client.publish("from-child", v)
        client.publish("inherited", t[2:])  # the parent's handle: reopened
        u.numpy()[0] = 100  # read-write lookup: the parent sees it
        assert client.stat()["clients"] >= 2

    assert run_in_child(child) == 0
    c = client.lookup("from-child", timeout=1)
    assert c.numpy().tolist() == [7, 7, 7]
    i = client.lookup("inherited", timeout=0)
    assert i.storage_id == sid and i.offset == 2
    assert t.numpy()[0] == 100
    # The parent's connection was left alone.
    assert client.ping() > 0
    for k in ("parent", "from-child", "inherited"):
        client.unpublish(k)
    for x in (t, c, i):
        x.release()


def test_forked_child_releases_inherited_tensors(daemon, client):
    t = client.empty(4)
    sid = t.storage_id

    def child():
        a = t.numpy()
        t.release()  # the child's copy: the parent's reference stays
        del a

    assert run_in_child(child) == 0
    assert not t.released
    ls = wait_storages(daemon, lambda ls: any(s["id"] == sid for s in ls))
    assert any(s["id"] == sid for s in ls)
    t.numpy()[:] = 1
    t.release()


def test_spawned_child_connects_by_path(daemon, client):
    t = client.share(np.arange(8, dtype=np.int32), key="spawn-in")
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_children.spawn_child, args=(daemon, "spawn-in", "spawn-out"))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert t.numpy().tolist() == [10 * i for i in range(8)]  # its writes
    o = client.lookup("spawn-out", timeout=0)
    assert bytes(o.numpy()) == b"from the spawned child"
    client.unpublish("spawn-in")
    client.unpublish("spawn-out")
    t.release()
    o.release()


def test_ctrl_c_interrupts_a_forever_lookup(daemon):
    script = textwrap.dedent(
        """
        import sys, time, tensord
        c = tensord.connect(sys.argv[1])
        print("waiting", time.monotonic(), flush=True)
        try:
            c.lookup("never published")
        except KeyboardInterrupt:
            print("KeyboardInterrupt", time.monotonic(), flush=True)
            sys.exit(42)
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script, daemon],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("waiting"), line + p.stderr.read()
        time.sleep(0.2 + random.random() * 0.05)  # well inside the lookup
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=5)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    took = time.monotonic() - sent
    assert p.returncode == 42, out + err
    word, when = out.split()
    assert word == "KeyboardInterrupt"
    print(f"SIGINT -> KeyboardInterrupt in {1000 * (float(when) - sent):.1f} ms "
          f"(process gone after {1000 * took:.1f} ms)")
    assert took < 2.0


def test_four_threads_share_one_client(client):
    errors = []
    rounds = 60

    def worker(n):
        try:
            for i in range(rounds):
                t = client.empty(16, "int32")
                t.numpy()[:] = n * 1000 + i
                client.publish(f"thr-{n}-{i}", t)
                t.release()
                # The next thread's key of this round: waits for it.
                peer = (n + 1) % 4
                u = client.lookup(f"thr-{peer}-{i}", timeout=5)
                assert (u.numpy() == peer * 1000 + i).all()
                u.release()
                client.ping()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors
    for n in range(4):
        for i in range(rounds):
            client.unpublish(f"thr-{n}-{i}")


def test_close_wakes_a_waiting_thread(daemon):
    c = tensord.connect(daemon)
    got = []

    def waiter():
        try:
            c.lookup("never")
        except BaseException as e:
            got.append(e)

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    time.sleep(0.15)
    c.close()
    th.join(2)
    assert not th.is_alive()
    assert len(got) == 1 and isinstance(got[0], tensord.Closed), got


def test_waits_release_the_gil(client):
    """A thread blocked in a forever lookup lets this one run Python: were
    the GIL held while waiting, the publish below could never run."""
    got = []

    def waiter():
        got.append(client.lookup("gil"))

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    time.sleep(0.1)  # the waiter is inside lookup
    squares = sum(i * i for i in range(10000))  # Python, on this thread
    t = client.share(np.array([squares]), key="gil")
    th.join(5)
    assert not th.is_alive() and got[0].storage_id == t.storage_id
    client.unpublish("gil")
    t.release()
    got[0].release()
