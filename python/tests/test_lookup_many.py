"""lookup_many: many keys in one round trip (td_lookup_many)."""

import threading
import time

import numpy as np
import pytest

import tensord


def _publish(client, n, prefix="m"):
    keys = ["%s/%04d" % (prefix, i) for i in range(n)]
    for i, k in enumerate(keys):
        t = client.empty((4,), "int32")
        t.numpy()[:] = i
        client.publish(k, t)
        t.release()
    return keys


def _drop(client, keys):
    for k in keys:
        client.unpublish(k)


def test_a_thousand_keys_in_order(client):
    keys = _publish(client, 1000)
    got = client.lookup_many(keys, timeout=0, readonly=True)
    assert len(got) == 1000
    for i, (k, t) in enumerate(zip(keys, got)):
        assert t.key == k
        assert t.shape == (4,) and (t.numpy() == i).all()
        assert not t.numpy().flags.writeable
    for t in got:
        t.release()
    _drop(client, keys)


def test_views_of_one_storage(client):
    t = client.share(np.arange(100, dtype=np.float32))
    keys = ["v/%d" % i for i in range(100)]
    for i, k in enumerate(keys):
        client.publish(k, t[i : i + 1])
    got = client.lookup_many(keys, timeout=0)
    assert {g.storage_id for g in got} == {t.storage_id}
    assert [float(g.numpy()[0]) for g in got] == list(range(100))
    for g in got:
        g.release()
    t.release()
    _drop(client, keys)


def test_missing_keys_raise_or_return(client):
    keys = _publish(client, 3)
    ask = [keys[0], "nope/1", keys[2]]
    with pytest.raises(tensord.NotFound) as e:
        client.lookup_many(ask, timeout=0)
    assert "nope/1" in str(e.value) and "1 of 3 keys failed" in str(e.value)
    got = client.lookup_many(ask, timeout=0, return_exceptions=True)
    assert isinstance(got[1], tensord.NotFound) and got[1].name == "ENOENT"
    assert (got[0].numpy() == 0).all() and (got[2].numpy() == 2).all()
    got[0].release()
    got[2].release()
    _drop(client, keys)


def test_waits_for_late_keys(daemon, client):
    keys = _publish(client, 2)

    def late():
        time.sleep(0.2)
        with tensord.connect(daemon) as p:
            t = p.share(b"late", key="late/1")
            t.release()

    th = threading.Thread(target=late)
    th.start()
    got = client.lookup_many([keys[0], "late/1", keys[1]], timeout=10)
    th.join()
    assert bytes(got[1].numpy()) == b"late"
    for g in got:
        g.release()
    with pytest.raises(tensord.Timeout):
        client.lookup_many(["never/1"], timeout=0.1)
    client.unpublish("late/1")
    _drop(client, keys)


def test_bad_arguments(client):
    assert client.lookup_many([]) == []
    with pytest.raises(TypeError):
        client.lookup_many("abc")
    with pytest.raises(TypeError):
        client.lookup_many(["a", 3])
    with pytest.raises(ValueError):
        client.lookup_many(["a"] * 65537)
    with pytest.raises(ValueError):
        client.lookup_many(["a"], timeout=-1)
