"""tensord.Channel: a FIFO of storages between real processes, slots and
plain storages, the ends' errors, a producer killed with a slot on loan."""

import gc
import multiprocessing
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

import tensord

import _chan_children
from conftest import nothing_left, wait_until


@pytest.fixture
def clean(client):
    """The client fixture, and after the test: no channel, no storage and no
    key left of it."""
    yield client
    gc.collect()
    wait_until(lambda: not client.channels(), "no channel left")
    wait_until(lambda: nothing_left(client), "no storage and no key left")


def fork(fn, *args):
    """Forks; the child runs fn(*args) and exits 0 if it returned, 1 if it
    raised (saying why on stderr). Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException as e:  # never return into pytest
            print(f"child: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    return pid


def wait_child(pid):
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def slot_producer(sock, name, n, first=0, barrier=None):
    """Sends n slots, slot i filled with first + i, through numpy; with a
    barrier, once every producer has opened its end (a receiver sees
    BrokenPipe as soon as all senders that came have left)."""
    with tensord.connect(sock) as c, c.channel(name, side="send", timeout=5) as ch:
        if barrier is not None:
            barrier.wait(10)
        for i in range(first, first + n):
            s = ch.loan(timeout=5)
            s.numpy()[:] = i % 251
            ch.send(s, timeout=5)


def test_slots_between_forked_processes(clean, daemon):
    c = clean
    ch = c.channel("frames", capacity=4, slots=3, slot_bytes=4096, side="recv")
    assert (ch.slots, ch.slot_bytes, ch.capacity, ch.side) == (3, 4096, 4, "recv")
    opened = multiprocessing.get_context("fork").Barrier(3)
    pids = [
        fork(slot_producer, daemon, "frames", 40, k * 100, opened) for k in range(2)
    ]
    opened.wait(10)
    got = {0: [], 1: []}
    for _ in range(80):
        t = ch.recv(timeout=10)
        assert t.shape == (4096,) and t.dtype == "uint8"
        assert t.readonly  # a slot, on an end that only receives
        a = t.numpy()
        assert (a == a[0]).all()
        got[int(a[0]) // 100].append(int(a[0]))
        del a
        t.release()  # the slot is free again: the producers go on
    # Each producer's entries in the order it sent them.
    assert got == {k: [k * 100 + i for i in range(40)] for k in (0, 1)}
    assert [wait_child(p) for p in pids] == [0, 0]
    # Both senders have left and the ring is empty.
    with pytest.raises(tensord.BrokenPipe) as e:
        ch.recv(timeout=5)
    assert isinstance(e.value, tensord.Closed)
    assert isinstance(e.value, BrokenPipeError)
    assert e.value.name == "EPIPE"
    st = ch.stat()
    assert (st["sent"], st["received"], st["depth"]) == (80, 80, 0)
    assert st["slots_free"] == 3
    ch.close()
    assert ch.closed


def storage_producer(sock, name):
    """Sends storages that are not slots: a Tensor, a strided view of one, a
    torch tensor and a numpy array over tensord storages."""
    with tensord.connect(sock) as c, c.channel(name, side="send", timeout=5) as ch:
        t = c.share(np.arange(12, dtype=np.float32).reshape(3, 4))
        ch.send(t.transpose(0, 1))  # the view travels as it is
        assert t.numpy()[2, 3] == 11  # t's own view stays valid
        x = c.empty((2, 5), "int64").torch()
        x.copy_(torch.arange(10).view(2, 5))
        ch.send(x[1, 1:4])
        a = c.empty((6,), "int16").numpy()
        a[:] = np.arange(6) * 3
        ch.send(a[::2])
        b = c.empty((2,), "bool").torch()
        b[0], b[1] = True, False
        ch.send(b)


def test_storages_between_forked_processes(clean, daemon):
    c = clean
    ch = c.channel("plain", capacity=8, side="recv")
    assert ch.slots == 0
    pid = fork(storage_producer, daemon, "plain")
    t = ch.recv(timeout=10)
    assert (t.shape, t.strides, t.dtype) == ((4, 3), (1, 4), "float32")
    assert not t.readonly
    assert t.numpy().tolist() == np.arange(12).reshape(3, 4).T.tolist()
    u = ch.recv(timeout=10)
    assert (u.dtype, u.offset, u.shape) == ("int64", 6, (3,))
    assert u.torch().tolist() == [6, 7, 8]
    v = ch.recv(timeout=10)
    assert (v.dtype, v.strides) == ("int16", (2,))
    assert v.numpy().tolist() == [0, 6, 12]
    w = ch.recv(timeout=10)
    assert w.dtype == "bool" and w.torch().tolist() == [True, False]
    assert wait_child(pid) == 0
    with pytest.raises(tensord.BrokenPipe):
        ch.recv(timeout=5)
    assert c.channels()[0]["in_flight"] == 0
    for x in (t, u, v, w):
        x.release()
    ch.close()


def test_spawned_producer(clean, daemon):
    c = clean
    ch = c.channel("spawned", slots=2, slot_bytes=1 << 16, side="recv")
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_chan_children.produce, args=(daemon, "spawned", 5))
    p.start()
    for i in range(5):
        with ch.recv(timeout=30) as t:
            assert t.torch().view(torch.int32)[:3].tolist() == [i, i + 1, i + 2]
    p.join(30)
    assert p.exitcode == 0
    ch.close()


def test_send_hands_the_reference_over(clean):
    c = clean
    ch = c.channel("self", slots=2, slot_bytes=256)
    s = ch.loan(timeout=0)
    x = s.torch()
    x[:] = 7
    view = s[16:32]
    ch.send(x[:64].view(torch.int32))  # a torch view of the slot
    # Nothing of the slot is reachable from this side any more.
    assert s.released is False
    for use in (lambda: s.numpy(), lambda: view.torch(), lambda: s[0]):
        with pytest.raises(ValueError, match="sent through a channel"):
            use()
    with pytest.raises(BufferError):
        memoryview(view)
    assert tensord.find(x.data_ptr()) is None
    r = ch.recv(timeout=0)
    assert (r.dtype, r.shape) == ("int32", (16,))
    assert not r.readonly  # this end sends too: read-write
    assert r.numpy().tolist() == [0x07070707] * 16
    del x
    # A received slot can be sent on again (an end of both sides).
    ch.send(r)
    assert r.released
    r2 = ch.recv(timeout=0)
    assert r2.numpy()[0] == 0x07070707
    r2.release()
    # The slot came back: both are free again.
    assert ch.stat()["slots_free"] == 2
    ch.close()


def test_send_refuses_what_is_not_in_tensord(clean):
    c = clean
    ch = c.channel("refuse", capacity=2, slots=1, slot_bytes=64)
    with pytest.raises(TypeError, match="no tensord storage"):
        ch.send(np.zeros(4))
    with pytest.raises(TypeError, match="no tensord storage"):
        ch.send(torch.zeros(4))
    with pytest.raises(TypeError):
        ch.send("bytes")
    other = c.channel("other", slots=1, slot_bytes=64)
    s = other.loan(timeout=0)
    with pytest.raises(tensord.Error, match="another channel"):
        ch.send(s)
    other.send(s)  # nothing changed: it is still ours to send
    other.recv(timeout=0).release()
    # A failed send leaves a plain storage with its sender, too.
    t = c.empty(4)
    ch.send(t)
    ch.send(c.empty(2))
    with pytest.raises(tensord.Timeout):
        ch.send(t2 := c.empty(3), timeout=0.05)  # the ring (2 entries) is full
    assert not t2.released and t2.numpy().shape == (3,)
    t2.release()
    ch.recv(timeout=0).release()
    ch.recv(timeout=0).release()
    ch.close()
    other.close()


def test_timeouts(clean):
    c = clean
    with pytest.raises(tensord.NotFound):
        c.channel("nowhere", timeout=0)
    t0 = time.monotonic()
    with pytest.raises(tensord.Timeout, match="not created"):
        c.channel("nowhere", timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    ch = c.channel("slow", slots=1, slot_bytes=64)
    with pytest.raises(tensord.Timeout):
        ch.recv(timeout=0)
    t0 = time.monotonic()
    with pytest.raises(tensord.Timeout, match="nothing came"):
        ch.recv(timeout=0.15)
    assert time.monotonic() - t0 >= 0.15
    s = ch.loan(timeout=0)
    t0 = time.monotonic()
    with pytest.raises(tensord.Timeout, match="no slot came free"):
        ch.loan(timeout=0.1)
    assert time.monotonic() - t0 >= 0.1
    s.release()  # given back: it can be loaned again
    ch.loan(timeout=0).release()
    with pytest.raises(ValueError, match="timeout"):
        ch.recv(timeout=-1)
    with pytest.raises(tensord.Exists):
        c.channel("slow", capacity=4)
    ch.close()


def test_wrong_side(clean):
    c = clean
    rx = c.channel("sides", slots=1, slot_bytes=64, side="recv")
    tx = c.channel("sides", side="send")
    assert (rx.side, tx.side, tx.slots) == ("recv", "send", 1)
    with pytest.raises(tensord.PermissionDenied, match="does not send"):
        rx.loan(timeout=0)
    with pytest.raises(tensord.PermissionDenied, match="does not send"):
        rx.send(c.empty(1))
    with pytest.raises(tensord.PermissionDenied, match="does not receive"):
        tx.recv(timeout=0)
    ends = {e["side"] for e in c.channels()[0]["ends"]}
    assert ends == {"send", "recv"}
    with pytest.raises(ValueError, match="side"):
        c.channel("sides", side="sideways")
    # The receivers leave: a sender learns it.
    s = tx.loan(timeout=0)
    rx.close()  # tensord hears of it soon after (a one-way message)
    wait_until(lambda: tx.stat()["receivers"] == 0, "the receiver gone")
    with pytest.raises(tensord.BrokenPipe):
        tx.send(s)
    with pytest.raises(tensord.BrokenPipe):
        tx.loan(timeout=0)
    s.release()
    tx.close()
    with pytest.raises(tensord.Closed, match="closed"):
        tx.recv(timeout=0)


def killed_producer(sock, name, ready_fd):
    """Sends one slot, loans another and keeps it; says so and waits."""
    c = tensord.connect(sock)
    ch = c.channel(name, side="send", timeout=5)
    s = ch.loan(timeout=5)
    s.numpy()[:] = 42
    ch.send(s)
    kept = ch.loan(timeout=5)  # noqa: F841 (dies with it on loan)
    os.write(ready_fd, b"x")
    time.sleep(60)


def test_producer_killed_with_a_slot_on_loan(clean, daemon):
    c = clean
    ch = c.channel("killed", slots=2, slot_bytes=4096, side="recv")
    r, w = os.pipe()
    pid = fork(killed_producer, daemon, "killed", w)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    st = ch.stat()
    assert (st["slots_loaned"], st["slots_queued"]) == (1, 1)
    os.kill(pid, signal.SIGKILL)
    assert wait_child(pid) == -signal.SIGKILL
    # tensord gives the dead end's loan back to the ring.
    wait_until(lambda: ch.stat()["slots_loaned"] == 0, "the loaned slot back")
    assert ch.stat()["slots_free"] == 1
    t = ch.recv(timeout=5)  # what it sent before it died is still there
    assert (t.numpy() == 42).all()
    t.release()
    assert ch.stat()["slots_free"] == 2
    with pytest.raises(tensord.BrokenPipe):
        ch.recv(timeout=5)
    ch.close()


def test_received_stay_valid_after_close(clean, daemon):
    c = clean
    ch = c.channel("late", capacity=8, slots=2, slot_bytes=4096, side="recv")
    pid = fork(slot_producer, daemon, "late", 2, 5)
    assert wait_child(pid) == 0
    plain = c.channel("late-plain", capacity=2)
    plain.send(c.share(np.arange(5, dtype=np.int64)))
    got = [ch.recv(timeout=5), ch.recv(timeout=5), plain.recv(timeout=0)]
    arrays = [got[0].numpy(), got[1].torch()]
    ch.close()
    plain.close()
    assert ch.closed and plain.closed
    with pytest.raises(tensord.Closed):
        ch.recv(timeout=0)
    # Handles out keep their end: the bytes stay readable until released.
    assert (arrays[0] == 5).all() and bool((arrays[1] == 6).all())
    assert got[2].numpy().tolist() == list(range(5))
    assert len(c.channels()) == 1  # "late" lives on in the slots held
    for t in got:
        t.release()
    assert (arrays[0] == 5).all()  # numpy's own reference
    del arrays
    gc.collect()
    wait_until(lambda: not c.channels(), "the channel gone with its slots")


def test_close_wakes_a_waiting_thread(clean):
    c = clean
    ch = c.channel("wake", slots=1, slot_bytes=64)
    errors = []

    def wait():
        try:
            ch.recv()  # forever
        except tensord.Error as e:
            errors.append(e)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    ch.close()
    th.join(5)
    assert not th.is_alive() and time.monotonic() - t0 < 2
    assert isinstance(errors[0], tensord.Closed)


def test_threads_share_a_channel(clean):
    c = clean
    ch = c.channel("threads", capacity=16, slots=8, slot_bytes=64)
    n = 200
    seen = []

    def produce(k):
        for i in range(n):
            s = ch.loan(timeout=10)
            s.view_dtype("int32").numpy()[0] = k * n + i
            ch.send(s[:4], timeout=10)

    def consume():
        for _ in range(n):
            t = ch.recv(timeout=10)
            seen.append(int(t.numpy().view(np.int32)[0]))
            t.release()

    ths = [threading.Thread(target=produce, args=(k,)) for k in range(2)]
    ths += [threading.Thread(target=consume) for _ in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    assert sorted(seen) == list(range(2 * n))
    assert ch.stat()["slots_free"] == 8
    ch.close()


def test_fork_needs_its_own_end(clean, daemon):
    c = clean
    ch = c.channel("inherited", slots=1, slot_bytes=64)

    def child():
        try:
            ch.loan(timeout=0)
        except tensord.Error as e:
            assert e.name == "EFORKED", e
        else:
            raise AssertionError("a forked child used its parent's end")
        # Its own end works (on its own connection).
        with tensord.connect(daemon) as c2, c2.channel("inherited") as mine:
            mine.send(mine.loan(timeout=5))

    assert wait_child(fork(child)) == 0
    ch.recv(timeout=5).release()
    ch.close()


def test_channel_cannot_be_pickled(clean):
    import pickle

    with clean.channel("pickle", capacity=2) as ch:
        with pytest.raises(TypeError, match="by its name"):
            pickle.dumps(ch)
