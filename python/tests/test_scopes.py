"""Scopes: keys in flight that go when their scope ends."""

import time

import pytest

import tensord

from conftest import wait_storages


def test_scope_close_drops_its_keys(daemon, client):
    token = client.scope_open()
    assert isinstance(token, int) and token > 0
    t = client.share(b"in flight")
    sid = t.storage_id
    client.publish("s1", t, scope=token)
    client.publish("s2", t[2:], scope=token)
    assert t.key == "s1"
    t.release()
    u = client.lookup("s1", timeout=0)  # an ordinary key while it lasts
    assert bytes(u.numpy()) == b"in flight"
    u.release()
    assert client.scope_close(token) == 2
    with pytest.raises(tensord.NotFound):
        client.lookup("s1", timeout=0)
    with pytest.raises(tensord.NotFound):
        client.lookup("s2", timeout=0)
    assert all(s["id"] != sid for s in wait_storages(daemon, lambda ls: not ls))
    with pytest.raises(tensord.NotFound):
        client.scope_close(token)  # ended already


def test_scoped_publish_does_not_replace(client):
    token = client.scope_open()
    t = client.share(b"a", key="taken")
    with pytest.raises(tensord.Exists) as e:
        client.publish("taken", t, scope=token)
    assert e.value.name == "EEXIST"
    assert client.scope_close(token) == 0
    client.unpublish("taken")
    t.release()


def test_scope_ends_with_its_owner(daemon, client):
    owner = tensord.connect(daemon)
    token = owner.scope_open()
    t = client.share(b"for the owner")
    client.publish("owned", t, scope=token)  # another client publishes into it
    t.release()
    assert client.lookup("owned", timeout=0).storage_id > 0
    owner.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            client.lookup("owned", timeout=0).release()
        except tensord.NotFound:
            break
        time.sleep(0.01)
    with pytest.raises(tensord.NotFound):
        client.lookup("owned", timeout=0)
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_scope_errors(client):
    t = client.empty(1)
    with pytest.raises(ValueError):
        client.publish("k", t, scope=0)
    with pytest.raises(tensord.NotFound):
        client.publish("k", t, scope=12345)
    with pytest.raises(OverflowError):
        client.publish("k", t, scope=-1)
    t.release()
