"""tensord.watch: the daemon's events in Python, without polling."""

import os
import select
import signal
import threading
import time

import pytest

import tensord


def test_events_of_keys_under_the_prefix(client):
    c = client
    with c.watch("w/") as w:
        assert w.prefix == "w/" and w.path == c.path and not w.closed
        assert w.next(timeout=0) is None
        t = c.share(b"abcd")
        c.publish("other", t)  # not under the prefix
        c.publish("w/a", t)
        u = c.lookup("w/a", timeout=0)
        c.unpublish("w/a")
        evs = [w.next(timeout=5) for _ in range(3)]
        assert [e.type for e in evs] == ["publish", "lookup", "unpublish"]
        e = evs[0]
        assert isinstance(e, tensord.WatchEvent)
        assert (e.key, e.id, e.nbytes, e.device) == ("w/a", t.storage_id, 4, "cpu")
        assert e.pid == os.getpid() and e.uid == os.getuid()
        assert e.name == c.name and e.dropped == 0 and e.type_id == 2
        assert e.unix_ms > 0 and e.code == 0 and e.message == ""
        assert w.next(timeout=0.05) is None
        t.release()
        u.release()
        c.unpublish("other")
    assert w.closed
    with pytest.raises(tensord.Closed, match="closed"):
        w.next(timeout=0)
    with pytest.raises(tensord.Closed):
        w.fileno()
    w.close()  # idempotent


def test_fileno_is_readable_when_events_came(client):
    c = client
    w = tensord.watch("fd/", c.path)
    try:
        fd = w.fileno()
        assert select.select([fd], [], [], 0)[0] == []
        t = c.share(b"x")
        c.publish("fd/1", t)
        c.publish("fd/2", t)
        assert select.select([fd], [], [], 5)[0] == [fd]
        got = []
        while True:  # drain: both may have come in one read
            e = w.next(timeout=0)
            if e is None:
                break
            got.append(e.key)
        while len(got) < 2:
            got.append(w.next(timeout=5).key)
        assert got == ["fd/1", "fd/2"]
        t.release()
        c.unpublish("fd/1")
        c.unpublish("fd/2")
    finally:
        w.close()


def test_a_short_timeout_ends_even_when_a_millisecond_passes(client):
    """next(timeout=0) and next(timeout=0.001) return None when nothing
    came, also when the clock's millisecond ticks inside the call (which a
    loaded machine makes likely; once that waited forever). A thread makes
    the calls; if one blocks, close() ends it and the test fails."""
    w = client.watch("quiet/")
    out = {"n": 0}

    def reader():
        try:
            for i in range(3000):
                assert w.next(timeout=0 if i % 2 else 0.001) is None
                out["n"] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            out["e"] = e

    th = threading.Thread(target=reader)
    th.start()
    th.join(30)
    w.close()
    th.join(5)
    assert "e" not in out and out["n"] == 3000, (out, "a short next() hung")


def test_close_from_another_thread_wakes_a_blocked_next(client):
    w = client.watch("none/")
    out = {}

    def reader():
        t0 = time.monotonic()
        try:
            w.next()
        except tensord.Closed as e:
            out["e"] = e
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    time.sleep(0.2)
    # The reader waits without the GIL: this thread runs meanwhile.
    n = 0
    t_end = time.monotonic() + 0.1
    while time.monotonic() < t_end:
        n += 1
    assert n > 1000
    w.close()
    th.join(5)
    assert not th.is_alive()
    assert isinstance(out["e"], tensord.Closed) and out["s"] < 2


def test_iteration_ends_at_close(client):
    c = client
    w = c.watch("it/")
    t = c.share(b"x")
    c.publish("it/a", t)
    seen = []
    for e in w:
        seen.append(e.key)
        w.close()
    assert seen == ["it/a"]
    t.release()
    c.unpublish("it/a")


def test_a_signal_handler_interrupts_next(client):
    class Alarm(Exception):
        pass

    def on_alarm(sig, frame):
        raise Alarm()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with client.watch("sig/") as w:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            t0 = time.monotonic()
            with pytest.raises(Alarm):
                w.next(timeout=30)
            assert time.monotonic() - t0 < 5
            assert w.next(timeout=0) is None  # usable after
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_two_threads_cannot_read_one_watch(client):
    w = client.watch("busy/")
    out = {}

    def reader():
        while True:
            try:
                w.next()
            except tensord.Closed as e:
                out["e"] = e
                return
            except tensord.Error as e:
                if "another thread" not in str(e):  # the main thread's probe
                    out["e"] = e
                    return
                time.sleep(0.001)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        # Until the reader is inside next(), a probe finds no event.
        deadline = time.monotonic() + 30
        while True:
            try:
                assert w.next(timeout=0) is None
            except tensord.Error as e:
                assert "another thread" in str(e)
                break
            assert time.monotonic() < deadline, "the reader never began next()"
            time.sleep(0.01)
    finally:
        w.close()
        th.join(10)
    assert not th.is_alive()
    assert isinstance(out["e"], tensord.Closed), out


def test_a_forked_child_cannot_read_its_parents_watch(client):
    c = client
    w = c.watch("fork/")
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                w.next(timeout=0)
                msg = b"no error"
            except tensord.Closed as e:
                msg = str(e).encode()
            w.close()  # the child's copy only
            os.write(wr, msg)
        finally:
            os._exit(0)
    os.close(wr)
    _, status = os.waitpid(pid, 0)
    msg = os.read(r, 1000).decode()
    os.close(r)
    assert status == 0
    assert "fork()" in msg
    # The child's close() woke nothing here: with no event yet, next() times
    # out (it used to see the child's wake-up on the shared pipe as a close).
    assert w.next(timeout=0.2) is None
    t = c.share(b"x")
    c.publish("fork/a", t)  # the parent's watch still works
    assert w.next(timeout=5).key == "fork/a"
    t.release()
    c.unpublish("fork/a")
    w.close()


def test_bad_arguments(client):
    with pytest.raises(ValueError, match="timeout"):
        with client.watch() as w:
            w.next(timeout=-1)
    with pytest.raises(ValueError, match="NUL"):
        tensord.watch("a\0b", client.path)
    with pytest.raises(tensord.Error, match="prefix of 300 bytes"):
        tensord.watch("k" * 300, client.path)
    with pytest.raises(tensord.Error):
        tensord.watch("", "/nonexistent/tensord.sock")


def test_next_raises_closed_when_tensord_goes():
    from conftest import Daemon

    d = Daemon()
    w = None
    try:
        w = tensord.watch("", d.sock)
    finally:
        d.stop()
    with pytest.raises(tensord.Closed, match="closed the connection"):
        for _ in range(100):  # events before the end, if any
            assert w.next(timeout=5) is not None
    w.close()
