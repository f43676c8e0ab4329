"""Every Client method, its errors, and the context managers."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import tensord

from conftest import TOP, Daemon, wait_storages


def tensorctl_json(sock, *args):
    ctl = os.environ.get("TENSORCTL_BIN") or os.path.join(
        TOP, "build", "client", "tensorctl"
    )
    out = subprocess.run(
        [ctl, "--socket", sock, "--json", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return json.loads(out.stdout)


def test_connect_path_ping_close(daemon):
    c = tensord.connect(daemon)
    assert isinstance(c, tensord.Client)
    assert c.path == daemon and not c.closed
    assert 0 < c.ping() < 1.0
    assert daemon in repr(c)
    c.close()
    assert c.closed and "closed" in repr(c)
    c.close()  # idempotent
    with pytest.raises(tensord.Closed) as e:
        c.ping()
    assert e.value.code == -107 and e.value.name == "ENOTCONN"
    assert "closed" in str(e.value)


def test_connect_name(daemon):
    with tensord.connect(daemon, name="train.py worker 1") as c:
        assert c.name == "train.py worker 1"
        t = c.empty(4)
        (mine,) = [s for s in c.ls() if s["id"] == t.storage_id]
        assert mine["holders"] == [
            {"pid": os.getpid(), "uid": os.getuid(), "refs": 1,
             "name": "train.py worker 1"}
        ]
        t.release()
        # A forked child reconnects under the same name.
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(w, c.name.encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            assert f.read() == b"train.py worker 1"
        assert os.waitpid(pid, 0)[1] == 0
    # Cut at 63 bytes, each byte outside printable ASCII as '?'.
    with tensord.Client(daemon, "tab\there \u00e9" + "x" * 80) as c:
        assert c.name == ("tab?here ??" + "x" * 80)[:63]
    with pytest.raises(ValueError):
        tensord.connect(daemon, name="nul\0inside")
    with pytest.raises(TypeError):
        tensord.connect(daemon, name=b"bytes")
    with tensord.connect(daemon, name="") as c:  # "": the default
        assert c.name and c.name != ""


def test_default_name_is_the_program(daemon, tmp_path):
    """Without a name a client is its script (not python3), or the module of
    -m; $TENSORD_CLIENT_NAME overrides the default, not a given name."""
    prog = (
        "import sys, tensord\n"
        "print(tensord.connect(sys.argv[1]).name)\n"
        "print(tensord.connect(sys.argv[1], name='given').name)\n"
    )
    (tmp_path / "train.py").write_text(prog)
    (tmp_path / "mymod.py").write_text(prog)
    env = dict(os.environ)
    env.pop("TENSORD_CLIENT_NAME", None)

    def names(*args, **extra):
        out = subprocess.run(
            [sys.executable, *args, daemon], capture_output=True, text=True,
            check=True, timeout=60, cwd=str(tmp_path), env={**env, **extra},
        )
        return out.stdout.split()

    assert names("-u", str(tmp_path / "train.py")) == ["train.py", "given"]
    assert names("-m", "mymod") == ["mymod", "given"]
    out = names("train.py", TENSORD_CLIENT_NAME="job-7")
    assert out == ["job-7", "given"]


def test_client_context_manager(daemon):
    with tensord.connect(daemon) as c:
        t = c.empty(4)
        assert not c.closed
    assert c.closed
    # The Tensor outlives its client's connection: still mapped.
    t.numpy()[:] = 3
    assert t.numpy().tolist() == [3, 3, 3, 3]
    t.release()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_connect_refused_is_an_error(tmp_path):
    with pytest.raises(tensord.Error) as e:
        tensord.connect(str(tmp_path / "nobody.sock"))
    assert str(tmp_path / "nobody.sock") in e.value.message
    assert e.value.code < 0


def test_closed_client_refuses_every_call(daemon):
    c = tensord.connect(daemon)
    t = c.empty(2)
    c.close()
    calls = [
        lambda: c.empty(1),
        lambda: c.share(b"x"),
        lambda: c.open(t.storage_id),
        lambda: c.publish("k", t),
        lambda: c.unpublish("k"),
        lambda: c.lookup("k", timeout=0),
        lambda: c.ls(),
        lambda: c.stat(),
        lambda: c.scope_open(),
        lambda: c.scope_close(1),
        lambda: c.ping(),
    ]
    for call in calls:
        with pytest.raises(tensord.Closed):
            call()
    t.release()


def test_empty_shapes_dtypes_and_zeroes(client):
    t = client.empty((2, 3, 4), dtype="int16")
    assert t.shape == (2, 3, 4) and t.strides == (12, 4, 1) and t.offset == 0
    assert t.dtype == "int16" and t.itemsize == 2 and t.ndim == 3
    assert t.numel == 24 and t.nbytes == 48 and t.storage_nbytes == 48
    assert not t.readonly and t.key is None and t.client is client
    assert (t.numpy() == 0).all()
    s = client.empty(5)  # int shape, float32 by default
    assert s.shape == (5,) and s.dtype == "float32"
    z = client.empty(())  # 0-d
    assert z.shape == () and z.numel == 1 and z.numpy().shape == ()
    e = client.empty((3, 0))  # no bytes: a 1-byte storage, an empty view
    assert e.nbytes == 0 and e.storage_nbytes == 1 and e.numpy().shape == (3, 0)
    u = client.empty(1 << 16, "uint8", uninit=True)
    assert u.nbytes == 1 << 16
    m = client.empty(4, mode=0o640)
    (info,) = [s for s in client.ls() if s["id"] == m.storage_id]
    assert info["mode"] == "0640"
    for x in (t, s, z, e, u, m):
        x.release()


@pytest.mark.parametrize(
    "spelling",
    ["float16", "half", "f2", "<f2", np.float16, np.dtype("float16"), "torch.float16"],
)
def test_dtype_spellings(client, spelling):
    t = client.empty(2, spelling)
    assert t.dtype == "float16"
    assert tensord.dtype_name(spelling) == "float16"
    assert tensord.dtype_size(spelling) == 2
    t.release()


def test_dtype_spellings_torch(client):
    torch = pytest.importorskip("torch")
    for d, name in [(torch.bfloat16, "bfloat16"), (torch.float, "float32"),
                    (torch.bool, "bool"), (torch.complex64, "complex64")]:
        with client.empty(1, d) as t:
            assert t.dtype == name


@pytest.mark.parametrize("bad", ["float", "nonsense", "", object(), 3, ">f4"])
def test_bad_dtype_is_type_error(client, bad):
    with pytest.raises(TypeError, match="dtype"):
        client.empty(2, bad)
    with pytest.raises(TypeError):
        tensord.dtype_size(bad)


def test_absurd_shapes(client):
    with pytest.raises(ValueError):
        client.empty((1 << 40, 1 << 40))  # elements overflow int64 bytes
    with pytest.raises(ValueError):
        client.empty(-1)
    with pytest.raises(ValueError):
        client.empty(1 << 70)
    with pytest.raises(ValueError):
        client.empty((1,) * 17)
    with pytest.raises(TypeError):
        client.empty("abc")
    # Fits the arithmetic, not the machine: the daemon refuses it.
    with pytest.raises(tensord.OutOfMemory) as e:
        client.empty(1 << 50, "uint8")
    assert e.value.code in (-12, -28)
    assert str(1 << 50) in e.value.message or "bytes" in e.value.message


def test_share_copies_once(client):
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    t = client.share(a)
    assert t.shape == (3, 4) and t.dtype == "int32" and t.strides == (4, 1)
    assert t.key is None
    assert (t.numpy() == a).all()
    assert t.data_ptr != a.ctypes.data  # a copy...
    a[0, 0] = 99
    assert t.numpy()[0, 0] == 0  # ...taken once
    # Non-contiguous sources are copied contiguous.
    s = client.share(a[:, ::2].T)
    assert s.shape == (2, 3) and s.strides == (3, 1)
    assert (s.numpy() == a[:, ::2].T).all()
    # bytes, memoryview, a tensord.Tensor, __array_interface__ objects.
    b = client.share(b"\x01\x02\x03")
    assert b.dtype == "uint8" and bytes(memoryview(b)) == b"\x01\x02\x03"
    m = client.share(memoryview(a).cast("B"))
    assert m.nbytes == a.nbytes
    tt = client.share(t[1:, 1::2])
    assert tt.storage_id != t.storage_id and (tt.numpy() == t.numpy()[1:, 1::2]).all()

    class Iface:
        __array_interface__ = a.__array_interface__

    i = client.share(Iface())
    assert (i.numpy() == a).all()
    for x in (t, s, b, m, tt, i):
        x.release()


def test_share_with_key_publishes(client):
    t = client.share(np.ones(3, np.float64), key="shared")
    assert t.key == "shared"
    u = client.lookup("shared", timeout=0)
    assert u.storage_id == t.storage_id and u.key == "shared"
    client.unpublish("shared")


def test_share_refuses_what_it_cannot_copy(client):
    with pytest.raises(TypeError, match="object"):
        client.share(object())
    with pytest.raises(TypeError):
        client.share(np.array(["a", "b"]))
    with pytest.raises(TypeError):
        client.share(np.array([1, 2], dtype="datetime64[s]"))
    with pytest.raises(ValueError, match="negative stride"):
        client.share(np.arange(4)[::-1])
    with pytest.raises(tensord.Error):
        client.share(b"abc", key="")


def test_open_by_id(client):
    t = client.share(np.arange(8, dtype=np.uint8))
    o = client.open(t.storage_id)
    assert o.shape == (8,) and o.dtype == "uint8" and not o.readonly
    assert o.numpy().tolist() == list(range(8))
    r = client.open(t.storage_id, readonly=True)
    assert r.readonly and not r.numpy().flags.writeable
    with pytest.raises(tensord.NotFound):
        client.open(1 << 60)
    for x in (t, o, r):
        x.release()


def test_publish_unpublish_lookup(client):
    t = client.empty((2, 2), "int64")
    t.numpy()[:] = [[1, 2], [3, 4]]
    client.publish("k", t[1])  # a view is published as such
    assert t.key is None
    u = client.lookup("k")
    assert u.shape == (2,) and u.offset == 2 and u.numpy().tolist() == [3, 4]
    client.publish("k", t)  # replaces
    assert client.lookup("k", timeout=0).shape == (2, 2)
    client.unpublish("k")
    with pytest.raises(tensord.NotFound) as e:
        client.unpublish("k")
    assert e.value.message == "key 'k': not published"
    with pytest.raises(TypeError):
        client.publish("k", np.zeros(2))
    with pytest.raises(ValueError, match="NUL"):
        client.publish("a\0b", t)
    with pytest.raises(tensord.Error) as e:
        client.publish("x" * 300, t)
    assert e.value.name == "EINVAL"
    t.release()
    u.release()
    with pytest.raises(ValueError, match="released"):
        client.publish("k", t)


def test_publish_tensor_of_another_client(daemon, client):
    with tensord.connect(daemon) as other:
        t = other.share(np.arange(3, dtype=np.int8))
        client.publish("foreign", t)  # no copy: the same storage
        u = client.lookup("foreign", timeout=0)
        assert u.storage_id == t.storage_id
        t.release()
    client.unpublish("foreign")


def test_publish_tensor_of_another_daemon_is_refused():
    """Storage ids are per daemon: a tensor of daemon A published through a
    client of daemon B must not publish B's storage that has the same id."""
    a, b = Daemon(), Daemon()
    try:
        with tensord.connect(a.sock) as ca, tensord.connect(b.sock) as cb:
            ta = ca.share(b"bytes of A")
            tb = cb.share(b"bytes of B")
            assert ta.storage_id == tb.storage_id  # both daemons' first
            assert ta.instance != tb.instance
            with pytest.raises(tensord.Error) as e:
                cb.publish("k", ta)
            assert e.value.name == "EINVAL"
            assert "%016x" % ca.instance in str(e.value), str(e.value)
            assert "%016x" % cb.instance in str(e.value), str(e.value)
            assert "share()" in str(e.value)
            with pytest.raises(tensord.NotFound):
                cb.lookup("k", timeout=0)  # nothing was published
            assert ta.key is None
            # What the message suggests: a copy, in B.
            cb.share(ta, key="k").release()
            with cb.lookup("k", timeout=0) as got:
                assert bytes(memoryview(got)) == b"bytes of A"
                assert got.storage_id != tb.storage_id
            cb.unpublish("k")
            ta.release()
            tb.release()
    finally:
        a.stop()
        b.stop()


def test_publish_readonly_is_permission_denied(client):
    t = client.share(b"abcd", key="ro")
    r = client.lookup("ro", readonly=True)
    with pytest.raises(tensord.PermissionDenied) as e:
        client.publish("ro2", r)
    assert e.value.name == "EACCES" and "read-only" in str(e.value)
    client.unpublish("ro")
    t.release()


def test_lookup_errors_and_timeouts(client):
    with pytest.raises(tensord.NotFound) as e:
        client.lookup("missing", timeout=0)
    assert e.value.code == -2 and e.value.name == "ENOENT"
    assert e.value.message == "key 'missing': not published"
    assert str(e.value) == e.value.message
    with pytest.raises(tensord.Timeout) as e:
        client.lookup("missing", timeout=0.12)
    assert e.value.name == "ETIMEDOUT"
    assert re.fullmatch(r"key 'missing': not published \(waited \d+ ms\)", str(e.value))
    waited = int(re.search(r"(\d+) ms", str(e.value)).group(1))
    assert waited >= 120
    with pytest.raises(ValueError):
        client.lookup("missing", timeout=-1)
    with pytest.raises(TypeError):
        client.lookup(5)
    assert isinstance(tensord.Timeout("x"), tensord.Error)


def test_lookup_take(client):
    client.share(b"xy", key="once").release()
    t = client.lookup("once", take=True)
    assert bytes(memoryview(t)) == b"xy"
    with pytest.raises(tensord.NotFound):
        client.lookup("once", timeout=0)
    t.release()


def test_ls_matches_tensorctl(daemon, client):
    t = client.share(np.zeros(10, np.float32), key="listed")
    ours = client.ls()
    theirs = tensorctl_json(daemon, "ls")["storages"]
    assert [s["id"] for s in ours] == [s["id"] for s in theirs]
    (mine,) = [s for s in ours if s["id"] == t.storage_id]
    (ctl,) = [s for s in theirs if s["id"] == t.storage_id]
    assert set(mine) == set(ctl)
    for k in ("id", "device", "nbytes", "owner_pid", "owner_uid", "owner_gid",
              "mode", "created_unix_ms", "keys", "nkeys"):
        assert mine[k] == ctl[k], k
    assert mine["keys"] == ["listed"] and mine["nbytes"] == 40
    assert mine["holders"][0]["pid"] == os.getpid()
    assert mine["holders"] == ctl["holders"]  # names included
    assert mine["holders"][0]["name"]  # the process's name, from its Hello
    assert mine["refs"] == 2  # the Tensor's handle and the key
    client.unpublish("listed")
    t.release()


def test_stat_matches_tensorctl(daemon, client):
    st = client.stat()
    ctl = tensorctl_json(daemon, "stat")
    assert set(st) == set(ctl) | {"instance"}
    assert set(st["pool"]) == set(ctl["pool"])
    assert st["socket"] == ctl["socket"] == daemon
    assert st["pid"] == ctl["pid"] and st["version"] == ctl["version"]
    assert isinstance(st["instance"], int) and st["instance"] > 0
    assert ctl["instance"] == "%016x" % st["instance"]
    assert st["prefixes"] == ctl["prefixes"]
    assert st["prefixes"][0] == "/tensord.%016x." % st["instance"]
    assert st["daemon_rss_bytes"] > 0


def test_tensor_not_constructible_nor_picklable(client):
    import pickle

    with pytest.raises(TypeError):
        tensord.Tensor()
    with client.empty(2) as t:
        with pytest.raises(TypeError, match="pickle"):
            pickle.dumps(t)


def test_keys_are_at_most_key_max_bytes_of_utf8(client):
    """docs/python.md: a key is 1 to 255 bytes of UTF-8 (bytes, not
    characters), refused before anything reaches the daemon."""
    assert tensord.KEY_MAX == 255
    t = client.share(b"k")
    client.publish("k" * 255, t)
    with client.lookup("k" * 255, timeout=0) as u:
        assert u.key == "k" * 255
    client.unpublish("k" * 255)
    for bad in ("k" * 256, "\u00e9" * 128):  # 256 bytes: 256 or 128 characters
        with pytest.raises(tensord.Error) as e:
            client.publish(bad, t)
        assert e.value.name == "EINVAL"
        assert "key of 256 bytes is longer than 255" in str(e.value)
        with pytest.raises(tensord.Error, match="longer than 255"):
            client.lookup(bad, timeout=0)
    with pytest.raises(tensord.Error, match="empty key"):
        client.publish("", t)
    with pytest.raises(ValueError, match="NUL"):
        client.publish("a\0b", t)
    t.release()


def test_docstrings_name_every_keyword():
    assert "lazy=False" in tensord.Client.lookup.__doc__
    assert "lazy=False" in tensord.Client.open.__doc__
    assert "KEY_MAX" in tensord.Client.lookup.__doc__
