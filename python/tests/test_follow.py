"""tensord.torch.follow: new versions of published weights, as they come."""

import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import tensord
import tensord.torch as tdt
from _attach_children import Net, positions, reference
from conftest import wait_storages, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))


def publish_from_another_process(sock, key, seed):
    """Publishes reference(seed)'s state dict under key from a new process;
    returns the storage id it published."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import tensord, tensord.torch as tdt\n"
        "from _attach_children import reference\n"
        "with tensord.connect(%r) as c:\n"
        "    print(tdt.publish_state_dict(c, %r, reference(%d)))\n"
        % (HERE, sock, key, seed)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


def build(weights):
    """What serves one version: a module built on meta, bound to it."""
    with tdt.meta_device():
        model = Net()
    tdt.attach(model, dict(weights, pos=positions(16)))
    return model.eval()


def test_a_version_published_by_another_process_is_followed(clean, daemon):
    """v1 published; a follower serves it; another process publishes v2:
    the callback gets v2 within a bounded wait, requests that took v1 keep
    it, and v1's storage goes once they let go; close() joins."""
    c = clean
    v1 = tdt.publish_state_dict(c, "fol/net", reference(0))
    seen = []

    def cb(weights):
        seen.append((weights.version, threading.current_thread().name))
        return build(weights)

    f = tdt.follow("fol/net", cb, client=c)
    assert (f.generation, f.version, f.weights.version) == (1, v1, v1)
    assert seen == [(v1, threading.current_thread().name)]  # the caller's
    assert f.alive and f.error is None
    tokens = torch.randint(0, 40, (2, 6))
    request = f.current  # a request in flight holds v1
    t0 = time.monotonic()
    v2 = publish_from_another_process(daemon, "fol/net", 1)
    assert f.wait(2, timeout=20), "no switch to v2 within 20 s"
    latency = time.monotonic() - t0
    assert f.version == v2 != v1 and f.generation == 2
    assert seen[1] == (v2, "tensord follow fol/net")
    with torch.no_grad():
        assert torch.equal(f.current(tokens), reference(1)(tokens))
        assert torch.equal(request(tokens), reference(0)(tokens))
    print("v2 followed %.3f s after the publisher started" % latency)
    # v1 lives while the request holds it, and goes after.
    assert v1 in {s["id"] for s in c.ls()}
    del request
    gc.collect()
    left = wait_storages(c.path, lambda ls: v1 not in {s["id"] for s in ls})
    assert v1 not in {s["id"] for s in left}
    assert {s["id"] for s in left} == {v2}
    th = f._thread
    f.close()
    assert not th.is_alive() and not f.alive
    assert f.current is None and f.weights is None
    f.close()  # idempotent
    c.unpublish("fol/net")  # the last holder of v2: the clean fixture checks


def test_an_idle_follower_sends_nothing(clean):
    """Event-driven: while nothing is published, the follower makes no
    lookup (seen by a watch of our own) and its thread waits in next()."""
    c = clean
    tdt.publish_state_dict(c, "fol/idle", reference(0))
    with tdt.follow("fol/idle", client=c) as f, c.watch("fol/idle") as spy:
        time.sleep(1.0)
        events = []
        while True:
            e = spy.next(timeout=0)
            if e is None:
                break
            events.append(e)
        assert events == []
        assert f.alive and f.generation == 1
        # One publish: exactly one lookup.
        v2 = tdt.publish_state_dict(c, "fol/idle", reference(1))
        assert f.wait(2, timeout=10) and f.version == v2
        time.sleep(0.3)
        kinds = []
        while True:
            e = spy.next(timeout=0)
            if e is None:
                break
            kinds.append(e.type)
        assert kinds == ["publish", "lookup"]
        assert f.current is f.weights  # no callback: the weights
        assert torch.equal(f.current["lin.weight"], reference(1).lin.weight)
    c.unpublish("fol/idle")


def test_a_burst_ends_on_the_latest_version(clean):
    c = clean
    tdt.publish_state_dict(c, "fol/burst", reference(0))
    with tdt.follow("fol/burst", client=c) as f:
        ids = [tdt.publish_state_dict(c, "fol/burst", reference(s))
               for s in range(1, 6)]
        wait_until(lambda: f.version == ids[-1], "the follower at the last version")
        assert 2 <= f.generation <= 6
    c.unpublish("fol/burst")


def test_a_failing_callback_keeps_the_version_in_use(clean):
    c = clean
    v1 = tdt.publish_state_dict(c, "fol/err", reference(0))
    fail = {"on": False}

    def cb(weights):
        if fail["on"]:
            raise RuntimeError("cannot serve version %d" % weights.version)
        return weights.version

    with tdt.follow("fol/err", cb, client=c) as f:
        fail["on"] = True
        v2 = tdt.publish_state_dict(c, "fol/err", reference(1))
        wait_until(lambda: f.error is not None, "the callback's error kept")
        assert "cannot serve version %d" % v2 in str(f.error)
        assert (f.version, f.current, f.generation) == (v1, v1, 1)
        fail["on"] = False
        v3 = tdt.publish_state_dict(c, "fol/err", reference(2))
        assert f.wait(2, timeout=10)
        assert (f.version, f.current) == (v3, v3)
    c.unpublish("fol/err")


def test_unpublished_then_published_again(clean):
    c = clean
    tdt.publish_state_dict(c, "fol/gap", reference(0))
    with tdt.follow("fol/gap", client=c) as f:
        c.unpublish("fol/gap")
        time.sleep(0.2)
        assert f.generation == 1 and f.error is None  # keeps what it has
        v2 = tdt.publish_state_dict(c, "fol/gap", reference(1))
        assert f.wait(2, timeout=10) and f.version == v2
    c.unpublish("fol/gap")


def test_first_version_missing_or_not_weights(clean):
    c = clean
    with pytest.raises(tensord.NotFound):
        tdt.follow("fol/none", client=c)
    t0 = time.monotonic()
    with pytest.raises(tensord.Timeout):
        tdt.follow("fol/none", client=c, timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    junk = c.share(b"not a state dict")
    c.publish("fol/junk", junk)
    junk.release()
    with pytest.raises(ValueError, match="does not hold a state dict"):
        tdt.follow("fol/junk", client=c)
    c.unpublish("fol/junk")
    with pytest.raises(TypeError):
        tdt.follow(3, client=c)


def test_close_from_the_callback_does_not_deadlock(clean):
    c = clean
    tdt.publish_state_dict(c, "fol/self", reference(0))
    box = {}

    def cb(w):
        if "f" in box:
            box["f"].close()
        return w

    f = box["f"] = tdt.follow("fol/self", cb, client=c)
    tdt.publish_state_dict(c, "fol/self", reference(1))
    f._thread.join(10)
    assert not f.alive
    f.close()
    assert f.current is None
    c.unpublish("fol/self")
