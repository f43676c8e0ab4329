"""CUDA storages from Python, over the TEST DOUBLE of the CUDA driver
(tests/cuda/): ctest names it in $TDCUDA_DOUBLE, and this module points
TENSORD_CUDA_DRIVER at it for its daemon and for this process. The double's
device memory is host memory: these tests prove the binding's bookkeeping
and error paths, not that anything runs on a GPU. Debian's torch is CPU-only,
so only torch()'s refusal is tested."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
from typing import Iterator

import pytest

import tensord

from conftest import Daemon, wait_storages

DOUBLE = os.environ.get("TDCUDA_DOUBLE")
pytestmark = pytest.mark.skipif(
    not DOUBLE, reason="no CUDA driver double (TENSORD_CUDA off, or not ctest)"
)

kDLCUDA = 2


@pytest.fixture(scope="module")
def tensord_daemon() -> Iterator[Daemon]:
    """A tensord for this module, and this process, on the double."""
    old = os.environ.get("TENSORD_CUDA_DRIVER")
    os.environ["TENSORD_CUDA_DRIVER"] = DOUBLE or ""
    d = Daemon()
    try:
        yield d
    finally:
        d.stop()
        if old is None:
            del os.environ["TENSORD_CUDA_DRIVER"]
        else:
            os.environ["TENSORD_CUDA_DRIVER"] = old


def test_empty_on_a_gpu(client: tensord.Client) -> None:
    t = client.empty((4, 5), "float32", device="cuda:1")
    assert t.device == "cuda:1"
    assert t.__dlpack_device__() == (kDLCUDA, 1)
    assert t.shape == (4, 5) and t.nbytes == 80
    (s,) = client.ls()
    assert s["device"] == "cuda" and s["device_uuid"].startswith("GPU-")
    (g,) = [d for d in client.stat()["devices"] if d["uuid"] == s["device_uuid"]]
    assert g["device"] == "cuda:1" and g["storages"] == 1
    assert g["bytes_used"] == 2 << 20  # one granule of the double
    t.release()
    assert client.empty(3).device == "cpu"


def test_cuda_alone_is_device_zero(client: tensord.Client) -> None:
    assert client.empty(8, "uint8", device="cuda").device == "cuda:0"


def test_bad_device_names(client: tensord.Client) -> None:
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0"):
        with pytest.raises(ValueError, match="device"):
            client.empty(3, device=bad)


def test_no_such_gpu(client: tensord.Client) -> None:
    with pytest.raises(tensord.Error, match="cuda:7"):
        client.empty(3, device="cuda:7")


def test_cpu_only_paths_refuse_device_memory(client: tensord.Client) -> None:
    t = client.empty((2, 3), "int32", device="cuda:0")
    with pytest.raises(TypeError, match="cuda:0"):
        t.numpy()
    with pytest.raises(TypeError, match="cuda:0"):
        t.__array_interface__
    with pytest.raises(BufferError, match="cuda:0"):
        memoryview(t)
    with pytest.raises(ValueError, match="stream"):
        t.__dlpack__(stream="default")
    t.__dlpack__(stream=None)  # a capsule, dropped unused
    t.__dlpack__(stream=1)


def test_torch_of_a_gpu_tensor_fails_cleanly_on_cpu_torch(
    client: tensord.Client, daemon: str
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the double's memory is not a GPU's")
    t = client.empty(16, "float32", device="cuda:0")
    # torch's own refusal, as its from_dlpack gives it for a kDLCUDA capsule.
    with pytest.raises(RuntimeError, match="not compiled with CUDA"):
        t.torch()
    t.release()
    gc.collect()
    # The capsule torch refused let go of its reference too.
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_lookup_from_another_client_maps_the_same_memory(
    client: tensord.Client, daemon: str
) -> None:
    t = client.empty(64, "uint8", device="cuda:1")
    client.publish("g", t)
    with tensord.connect(daemon) as other:
        u = other.lookup("g", timeout=0)
        assert u.device == "cuda:1" and u.storage_id == t.storage_id
        # Device pointers are addresses here only because of the double.
        assert u.data_ptr == t.data_ptr
        u.release()
    client.unpublish("g")


def test_share_copies_a_gpu_tensor_to_the_cpu(client: tensord.Client) -> None:
    t = client.empty(6, "int32", device="cuda:0")
    # Writable from here only because the double's device memory is ours.
    src = (ctypes.c_int32 * 6)(*range(10, 16))
    ctypes.memmove(t.data_ptr, src, 24)
    u = client.share(t[1:5])
    assert u.device == "cpu"
    assert u.numpy().tolist() == [11, 12, 13, 14]


def _write_safetensors(path, tensors) -> bytes:
    """Writes {name: (dtype, shape, bytes)} as a .safetensors file at path
    (in order, no gaps, the header padded to 8 bytes); returns the file's
    bytes."""
    import json

    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    blob = len(h).to_bytes(8, "little") + h + data
    with open(path, "wb") as f:
        f.write(blob)
    return blob


def test_load_model_onto_a_gpu_and_read_it_back(
    client: tensord.Client, daemon: str, tmp_path
) -> None:
    raw_w = bytes(range(256)) * 64  # 16 KiB
    raw_b = bytes(range(7, 7 + 32))
    blob = _write_safetensors(
        tmp_path / "g.safetensors",
        {"w": ("F32", (64, 64), raw_w), "b": ("U8", (32,), raw_b)},
    )
    r = client.load_model(str(tmp_path / "g.safetensors"), "g",
                          device="cuda:1")
    assert r["shards"] == 1 and r["bytes"] == len(blob)
    again = client.load_model(str(tmp_path / "g.safetensors"), "g",
                              device="cuda:1")
    assert again["unchanged"] and again["version"] == r["version"]
    (s,) = [s for s in client.ls() if s["device"] == "cuda"]
    assert s["nbytes"] == len(blob)
    with tensord.connect(daemon) as other:
        version, manifest, items = other.open_model("g", timeout=0)
        assert '"device":"cuda"' in manifest
        got = dict(items)
        assert got["w"].device == "cuda:1" and got["b"].device == "cuda:1"
        assert bytes(other.share(got["w"]).numpy().tobytes()) == raw_w
        assert bytes(other.share(got["b"]).numpy().tobytes()) == raw_b
        for _, t in items:
            t.release()
    with pytest.raises(ValueError, match="device"):
        client.load_model(str(tmp_path / "g.safetensors"), "g", device="tpu")
    with pytest.raises(tensord.Error, match="cuda:9"):
        client.load_model(str(tmp_path / "g.safetensors"), "h",
                          device="cuda:9")
    client.unload_model("g")
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_load_safetensors_onto_a_gpu_on_cpu_torch(
    client: tensord.Client, daemon: str, tmp_path
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the double's memory is not a GPU's")
    import tensord.torch as tdt

    _write_safetensors(tmp_path / "t.safetensors",
                       {"x": ("F32", (4,), bytes(16))})
    # Loaded onto the double's GPU; CPU torch cannot take CUDA tensors.
    with pytest.raises(Exception):
        tdt.load_safetensors(tmp_path / "t.safetensors", device="cuda:0",
                             client=client)
    (s,) = [s for s in client.ls() if s["device"] == "cuda"]
    assert s["nbytes"] > 16
    with pytest.raises(ValueError, match="device"):
        tdt.load_safetensors(tmp_path / "t.safetensors", device="meta",
                             client=client)
    client.unload_model("t")
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


def _app_driver():
    """The driver libtensord loaded (the double), for what only an
    application does: a current context, and events made and recorded."""
    lib = ctypes.CDLL(DOUBLE)
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert lib.cuCtxPushCurrent_v2(ctx) == 0
    return lib


CU_EVENT_DISABLE_TIMING, CU_EVENT_INTERPROCESS = 2, 4

_WAITER = r"""
import sys, tensord
c = tensord.connect(sys.argv[1])
t = c.lookup(sys.argv[2], timeout=0)
try:
    t.wait()          # the host blocks until the producer's work is done
    t.wait(stream=1)  # a stream: CU_STREAM_LEGACY
except tensord.Error as e:
    print("FAILED", e)
    sys.exit(3)
print("WAITED")
"""


def test_publish_with_an_event_and_wait_in_another_process(
    client: tensord.Client, daemon: str
) -> None:
    import subprocess
    import sys

    t = client.empty(64, "uint8", device="cuda:0")
    lib = _app_driver()
    ev = ctypes.c_void_p()
    assert lib.cuEventCreate(
        ctypes.byref(ev), CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) == 0
    assert lib.cuEventRecord(ev, None) == 0

    class Event:  # what torch.cuda.Event offers: the handle as .cuda_event
        cuda_event = ev.value

    client.publish("ev", t, event=Event())
    env = dict(os.environ, TENSORD_CUDA_DRIVER=DOUBLE or "")

    def waiter():
        return subprocess.run(
            [sys.executable, "-c", _WAITER, daemon, "ev"], env=env,
            capture_output=True, text=True, timeout=60)

    r = waiter()
    assert r.returncode == 0 and "WAITED" in r.stdout, r.stdout + r.stderr
    # A key without an event has nothing to wait for, in this process too.
    client.publish("plain", t)
    with tensord.connect(daemon) as other:
        u = other.lookup("plain", timeout=0)
        u.wait()
        u.wait(stream=7)
        with pytest.raises(TypeError, match="stream"):
            u.wait(stream="default")
        u.release()
    # The handle names the producer's event: using it once destroyed is
    # undefined on a driver, and the double aborts the waiter, naming the
    # call (tests/cuda/README.md).
    assert lib.cuEventDestroy_v2(ev) == 0
    r = waiter()
    assert (r.returncode == -signal.SIGABRT
            and "cuIpcOpenEventHandle" in r.stderr
            and "destroyed it" in r.stderr), r.stdout + r.stderr
    with pytest.raises(TypeError, match="event"):
        client.publish("ev", t, event="nope")
    # A non-interprocess event is refused, naming the flag it needs.
    plain = ctypes.c_void_p()
    assert lib.cuEventCreate(ctypes.byref(plain), CU_EVENT_DISABLE_TIMING) == 0
    with pytest.raises(tensord.Error, match="CU_EVENT_INTERPROCESS"):
        client.publish("ev2", t, event=plain.value)
    assert lib.cuEventDestroy_v2(plain) == 0
    client.unpublish("ev")
    client.unpublish("plain")
    t.release()
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


_DLPACK_CONSUMER = r"""
import ctypes, sys, tensord
lib = ctypes.CDLL(sys.argv[3])  # the driver libtensord loaded: the double
assert lib.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert lib.cuCtxPushCurrent_v2(ctx) == 0
s = ctypes.c_void_p()
assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0  # CU_STREAM_NON_BLOCKING
print("STREAM", s.value)
t = tensord.connect(sys.argv[1]).lookup(sys.argv[2], timeout=0)
for stream in (None, 1, 2, s.value, -1):
    t.__dlpack__(stream=stream)  # a capsule, dropped unused
try:
    t.__dlpack__(stream=0x1234)  # no stream of this process
except tensord.Error as e:
    print("REFUSED", e)
"""


def test_dlpack_makes_the_consumers_stream_wait_on_the_keys_event(
    client: tensord.Client, daemon: str, tmp_path
) -> None:
    """__dlpack__(stream=S) of a key published with an event queues
    cuStreamWaitEvent on S (the array API's numbering: None and 1 the
    legacy default stream, 2 the per-thread one), not on -1; the double
    logs each wait to $TDCUDA_EVENT_LOG."""
    import subprocess
    import sys

    t = client.empty(64, "uint8", device="cuda:0")
    lib = _app_driver()
    ev = ctypes.c_void_p()
    assert lib.cuEventCreate(
        ctypes.byref(ev), CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) == 0
    assert lib.cuEventRecord(ev, None) == 0
    client.publish("dl", t, event=ev.value)
    log = tmp_path / "events"
    env = dict(os.environ, TENSORD_CUDA_DRIVER=DOUBLE or "",
               TDCUDA_EVENT_LOG=str(log))
    r = subprocess.run(
        [sys.executable, "-c", _DLPACK_CONSUMER, daemon, "dl", DOUBLE or ""],
        env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    (stream,) = [int(l.split()[1]) for l in r.stdout.splitlines()
                 if l.startswith("STREAM ")]
    waits = log.read_text().splitlines() if log.exists() else []
    assert waits == ["wait 0x1", "wait 0x1", "wait 0x2",
                     f"wait {stream:#x}"], r.stdout + r.stderr
    # A value that is no stream reaches the driver, which refuses it.
    assert "REFUSED" in r.stdout and "cuStreamWaitEvent" in r.stdout, (
        r.stdout + r.stderr)
    client.unpublish("dl")
    assert lib.cuEventDestroy_v2(ev) == 0
    t.release()
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_a_process_waits_on_the_event_it_published_itself(
    client: tensord.Client, daemon: str, tmp_path, monkeypatch
) -> None:
    """The driver opens no process's own event handle: a lookup in the
    publishing process (any client of it) waits on the event itself, so
    wait(), __dlpack__(stream=) and torch() work there too."""
    t = client.empty(64, "uint8", device="cuda:0")
    lib = _app_driver()
    ev = ctypes.c_void_p()
    assert lib.cuEventCreate(
        ctypes.byref(ev), CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) == 0
    assert lib.cuEventRecord(ev, None) == 0
    client.publish("own", t, event=ev.value)
    log = tmp_path / "events"
    monkeypatch.setenv("TDCUDA_EVENT_LOG", str(log))
    with tensord.connect(daemon) as other:
        u = other.lookup("own", timeout=0)
        u.wait()
        u.wait(stream=1)
        u.__dlpack__(stream=2)
        u.release()
    monkeypatch.delenv("TDCUDA_EVENT_LOG")
    assert log.read_text().splitlines() == ["sync", "wait 0x1", "wait 0x2"]
    client.unpublish("own")
    assert lib.cuEventDestroy_v2(ev) == 0
    t.release()
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_dlpack_refuses_what_is_no_stream(client: tensord.Client) -> None:
    t = client.empty(8, "float32", device="cuda:0")
    for bad in (0, -2, 2**64, -(2**70)):
        with pytest.raises(ValueError, match=f"stream {bad} is not"):
            t.__dlpack__(stream=bad)
    for bad in ("default", 1.5):
        with pytest.raises(ValueError, match="None or an int"):
            t.__dlpack__(stream=bad)
    # Without an event there is nothing to wait for: any stream will do.
    for ok in (None, 1, 2, -1, 2**64 - 1):
        t.__dlpack__(stream=ok)
    c = client.empty(8, "float32")
    for bad in (1, -1):
        with pytest.raises(ValueError, match="None for a CPU tensor"):
            c.__dlpack__(stream=bad)
    c.__dlpack__(stream=None)
    t.release()
    c.release()


# ---- publish_state_dict with regions on a GPU (the double's) ----
#
# torch here is CPU-only, so tensord Tensors on the double's GPUs stand in
# for torch CUDA tensors: publish_state_dict takes either, and the regions
# are read back through the extension (a lookup, then share() to the host).


def _gpu_tensor(client, data: bytes, device: str, dtype="uint8", shape=None):
    t = client.empty((len(data),), "uint8", device=device)
    buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
    ctypes.memmove(t.data_ptr, buf, len(data))  # the double: host memory
    if dtype != "uint8":
        t = t.view_dtype(dtype)
    if shape is not None:
        t = t.view(*shape)
    return t


def _region_keys(client, prefix: str) -> dict:
    """{region key: storage dict} of every published region of prefix."""
    out = {}
    for s in client.ls():
        for k in s["keys"]:
            if k.startswith(prefix + "@"):
                out[k] = s
    return out


_READER = r"""
import sys, tensord, tensord.torch as tdt
c = tensord.connect(sys.argv[1])
t = c.lookup(sys.argv[2], timeout=0, readonly=True)
m = tdt._read_manifest(t)
g = tdt._gpu_regions(c, m, sys.argv[2])
for i in sorted(g):
    print(i, g[i].device, g[i].storage_id,
          bytes(c.share(g[i][: m["regions"][i]["nbytes"]]).numpy()).hex())
try:
    tdt.load_state_dict(c, sys.argv[2])
except RuntimeError as e:
    print("REFUSED", e)
"""


def _read_in_another_process(daemon: str, prefix: str) -> "tuple[dict, str]":
    import subprocess
    import sys

    env = dict(os.environ, TENSORD_CUDA_DRIVER=DOUBLE or "")
    r = subprocess.run([sys.executable, "-c", _READER, daemon, prefix],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    regions, refused = {}, ""
    for line in r.stdout.splitlines():
        if line.startswith("REFUSED"):
            refused = line
            continue
        i, dev, sid, hx = line.split(" ")
        regions[int(i)] = (dev, int(sid), bytes.fromhex(hx))
    return regions, refused


def test_state_dict_on_a_gpu_keeps_each_region_there(
    client: tensord.Client, daemon: str
) -> None:
    torch = pytest.importorskip("torch")
    import tensord.torch as tdt

    raw_a = bytes(range(80))
    raw_b = bytes(range(100, 132))
    a = _gpu_tensor(client, raw_a, "cuda:0", "float32", (4, 5))
    b = _gpu_tensor(client, raw_b, "cuda:1", "int32", (8,))
    c = torch.arange(6, dtype=torch.int64)
    sd = {"a": a, "a_t": a.transpose(0, 1), "b": b, "c": c}
    v = tdt.publish_state_dict(client, "sd", sd)
    keys = _region_keys(client, "sd")
    # One storage per GPU region, on its GPU; the CPU tensor in the packed
    # storage, as before.
    assert sorted(keys) == ["sd@%d/r0" % v, "sd@%d/r1" % v]
    assert keys["sd@%d/r0" % v]["device"] == "cuda"
    assert keys["sd@%d/r0" % v]["nbytes"] == 80
    assert keys["sd@%d/r1" % v]["nbytes"] == 32
    assert keys["sd@%d/r0" % v]["id"] != keys["sd@%d/r1" % v]["id"]
    t = client.lookup("sd", timeout=0)
    m = tdt._read_manifest(t)
    t.release()
    r0, r1, r2 = m["regions"]
    assert r0 == {"device": "cuda", "key": "sd@%d/r0" % v,
                  "storage_id": keys["sd@%d/r0" % v]["id"], "nbytes": 80}
    assert r1["device"] == "cuda" and "offset" not in r1
    assert "device" not in r2 and r2["nbytes"] == 48
    assert m["tensors"]["a_t"] == {"dtype": "float32", "shape": [5, 4],
                                   "stride": [1, 5], "storage_offset": 0,
                                   "region": 0}
    regions, refused = _read_in_another_process(daemon, "sd")
    assert regions == {
        0: ("cuda:0", keys["sd@%d/r0" % v]["id"], raw_a),
        1: ("cuda:1", keys["sd@%d/r1" % v]["id"], raw_b),
    }
    # CPU torch cannot hold the CUDA tensors: a clear refusal, naming why.
    assert "has no CUDA" in refused and "sd@%d/r0" % v in refused
    with pytest.raises(RuntimeError, match="has no CUDA"):
        tdt.load_state_dict(client, "sd")
    # tensorctl reads CPU regions only, and says so.
    import subprocess

    ctl = os.environ.get("TENSORCTL_BIN")
    if ctl:
        r = subprocess.run([ctl, "--socket", daemon, "show", "sd"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "GPU" in r.stderr, r.stdout + r.stderr
    a.release()
    b.release()
    del sd, a, b
    client.unpublish("sd")
    for k in keys:
        client.unpublish(k)
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


class _Recorder:
    """A client that passes every call on, and can fail or die at one."""

    def __init__(self, client, fail_at=None, exc=None, on_switch=None):
        self.c = client
        self.calls = []
        self.fail_at = fail_at  # (method, nth call of it)
        self.exc = exc or tensord.Error
        self.on_switch = on_switch

    def __getattr__(self, name):
        f = getattr(self.c, name)
        if not callable(f):
            return f

        def call(*args, **kw):
            self.calls.append(name)
            if self.fail_at == (name, self.calls.count(name)):
                raise self.exc("injected failure at %s #%d" % self.fail_at)
            if name == "publish" and "@" not in args[0] and self.on_switch:
                self.on_switch()
            return f(*args, **kw)

        return call


def test_republish_switches_at_once_and_old_regions_go_when_released(
    client: tensord.Client, daemon: str
) -> None:
    pytest.importorskip("torch")
    import tensord.torch as tdt

    a = _gpu_tensor(client, bytes(64), "cuda:0")
    v1 = tdt.publish_state_dict(client, "rs", {"w": a})
    old = dict(_region_keys(client, "rs"))
    # A reader of version 1 holds its region.
    with tensord.connect(daemon) as reader:
        t = reader.lookup("rs", timeout=0, readonly=True)
        held = tdt._gpu_regions(reader, tdt._read_manifest(t), "rs")
        seen = []

        def at_switch():  # the old version is whole until the switch
            seen.append(sorted(_region_keys(client, "rs")))

        b = _gpu_tensor(client, bytes(range(64)), "cuda:0")
        v2 = tdt.publish_state_dict(_Recorder(client, on_switch=at_switch),
                                    "rs", {"w": b})
        assert v2 > v1
        assert seen == [sorted(list(old) + ["rs@%d/r0" % v2])]
        # After it, only the new version's keys.
        assert sorted(_region_keys(client, "rs")) == ["rs@%d/r0" % v2]
        # The stale manifest names a region that is gone: the reader starts
        # again (load_state_dict and follow() do, a bounded number of times).
        with pytest.raises(tdt._VersionChanged):
            tdt._gpu_regions(reader, tdt._read_manifest(t), "rs")
        t.release()
        # Version 1's storage lives while the reader holds it.
        ids = {s["id"] for s in client.ls()}
        (g,) = held.values()
        gid = g.storage_id
        assert gid in ids
        assert bytes(reader.share(g).numpy()) == bytes(64)
        g.release()
    a.release()
    b.release()
    assert gid not in {s["id"] for s in wait_storages(
        daemon, lambda ls: gid not in {s["id"] for s in ls})}
    client.unpublish("rs")
    client.unpublish("rs@%d/r0" % v2)
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_a_failure_before_the_switch_leaves_nothing(
    client: tensord.Client, daemon: str
) -> None:
    pytest.importorskip("torch")
    import tensord.torch as tdt

    a = _gpu_tensor(client, bytes(range(32)), "cuda:0")
    b = _gpu_tensor(client, bytes(range(16)), "cuda:1")
    v1 = tdt.publish_state_dict(client, "ff", {"a": a})
    before = sorted((s["id"], tuple(s["keys"])) for s in client.ls())
    for fail_at in (("empty", 2), ("empty", 3), ("publish", 2), ("publish", 3)):
        with pytest.raises(tensord.Error, match="injected"):
            tdt.publish_state_dict(_Recorder(client, fail_at), "ff",
                                   {"a": a, "b": b})
        gc.collect()
        assert wait_storages(
            daemon,
            lambda ls: sorted((s["id"], tuple(s["keys"])) for s in ls) == before,
        ) is not None
        assert sorted((s["id"], tuple(s["keys"])) for s in client.ls()) == before
    t = client.lookup("ff", timeout=0)
    assert t.storage_id == v1
    t.release()
    a.release()
    b.release()
    client.unpublish("ff")
    client.unpublish("ff@%d/r0" % v1)
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


_DYING = r"""
import os, sys, tensord, tensord.torch as tdt
c = tensord.connect(sys.argv[1])
t = c.empty((4096,), "uint8", device="cuda:0")
class Dies:
    def __getattr__(self, name):
        f = getattr(c, name)
        def call(*a, **kw):
            if name == "publish" and a[0] == "dd":
                os._exit(9)  # dies after its regions, before the switch
            return f(*a, **kw)
        return call
tdt.publish_state_dict(Dies(), "dd", {"x": t, "y": t[:16]})
"""


def test_a_dead_publishers_orphans_are_swept_by_the_next_publish(
    client: tensord.Client, daemon: str
) -> None:
    pytest.importorskip("torch")
    import subprocess
    import sys

    import tensord.torch as tdt

    env = dict(os.environ, TENSORD_CUDA_DRIVER=DOUBLE or "")
    r = subprocess.run([sys.executable, "-c", _DYING, daemon], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 9, r.stdout + r.stderr
    (orphan,) = _region_keys(client, "dd")
    with pytest.raises(tensord.NotFound):
        client.lookup("dd", timeout=0)
    a = _gpu_tensor(client, bytes(8), "cuda:0")
    v = tdt.publish_state_dict(client, "dd", {"x": a})
    assert sorted(_region_keys(client, "dd")) == ["dd@%d/r0" % v]
    assert orphan != "dd@%d/r0" % v
    a.release()
    client.unpublish("dd")
    client.unpublish("dd@%d/r0" % v)
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_a_prefix_too_long_for_region_keys(
    client: tensord.Client, daemon: str
) -> None:
    pytest.importorskip("torch")
    import tensord.torch as tdt

    a = client.empty(4, "uint8", device="cuda:0")
    with pytest.raises(ValueError, match="region"):
        tdt.publish_state_dict(client, "p" * 250, {"a": a})
    a.release()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_copy_between_tensors_on_a_gpu(client: tensord.Client) -> None:
    src = _gpu_tensor(client, bytes(range(24)), "cuda:0", "int32", (2, 3))
    dst = client.empty((3, 2), "int32", device="cuda:0")
    assert dst.copy_(src.transpose(0, 1)) is dst
    host = client.share(dst).numpy().tolist()
    want = client.share(src).numpy().T.tolist()
    assert host == want
    with pytest.raises(ValueError, match="destination size 3, source size 2"):
        dst.copy_(src)
    with pytest.raises(TypeError, match="tensord Tensor"):
        dst.copy_(b"abc")
    ro = client.empty(4, "uint8", device="cuda:0")
    client.publish("ro", ro)
    r = client.lookup("ro", timeout=0, readonly=True)
    with pytest.raises(ValueError):
        r.copy_(ro)
    client.unpublish("ro")
    for t in (src, dst, ro, r):
        t.release()


def test_load_state_dict_with_gpu_regions_starts_again_when_replaced(
    client: tensord.Client, daemon: str, monkeypatch
) -> None:
    """The reader's logic over GPU regions, with torch's CUDA conversion
    replaced by a host copy (torch here has no CUDA): entries over their
    regions, tied ones still tied, and a version replaced between the
    lookup of the manifest and of its regions makes it start again."""
    torch = pytest.importorskip("torch")
    import tensord.torch as tdt

    monkeypatch.setattr(
        tdt, "_cuda_torch", lambda t, prefix, key: client.share(t).torch())
    raw = bytes(range(48))
    a = _gpu_tensor(client, raw, "cuda:0", "int32", (3, 4))
    v1 = tdt.publish_state_dict(client, "ld", {"a": a, "at": a.transpose(0, 1)})
    b = _gpu_tensor(client, raw[::-1], "cuda:1", "int32", (3, 4))
    v2 = None

    class Racing:  # a new version lands right after the first lookup
        lookups = 0

        def __getattr__(self, name):
            return getattr(client, name)

        def lookup(self, key, **kw):
            nonlocal v2
            t = client.lookup(key, **kw)
            if key == "ld":
                Racing.lookups += 1
                if Racing.lookups == 1:
                    v2 = tdt.publish_state_dict(
                        client, "ld", {"a": b, "at": b.transpose(0, 1)})
            return t

    w = tdt.load_state_dict(Racing(), "ld")
    assert Racing.lookups == 2 and v2 > v1
    assert w.version == v2 and len(w.storage_ids) == 2
    want = torch.frombuffer(bytearray(raw[::-1]), dtype=torch.int32).view(3, 4)
    assert torch.equal(w["a"], want) and torch.equal(w["at"], want.t())
    assert w["at"].data_ptr() == w["a"].data_ptr()
    # A state dict that keeps changing: the reader gives up, saying so.
    monkeypatch.setattr(tdt, "_RETRIES", 2)

    class Always(Racing):
        def lookup(self, key, **kw):
            t = client.lookup(key, **kw)
            if key == "ld":
                tdt.publish_state_dict(client, "ld", {"a": b})
            return t

    with pytest.raises(RuntimeError, match="replaced it 2 times"):
        tdt.load_state_dict(Always(), "ld")
    del w
    a.release()
    b.release()
    client.unpublish("ld")
    for k in _region_keys(client, "ld"):
        client.unpublish(k)
    gc.collect()
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_a_child_forked_after_cuda_use_gets_eforked(
    client: tensord.Client, daemon: str
) -> None:
    """The driver allows a child of fork() nothing once its parent has used
    CUDA: libtensord says so (tensord.Error EFORKED, naming both pids)
    instead of failing in the driver; the inherited tensor's release is
    quiet. Use spawn (multiprocessing's 'spawn' context) for CUDA peers."""
    t = client.empty(64, "uint8", device="cuda:0")
    client.publish("forked", t)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with tensord.connect(daemon) as c:
                try:
                    c.lookup("forked", timeout=0)
                except tensord.Error as e:
                    code = 0 if (
                        e.name == "EFORKED"
                        and f"pid {os.getpid()}" in e.message
                        and f"pid {parent}" in e.message
                    ) else 3
                    if code:
                        print(f"child: {e.name}: {e.message}", flush=True)
            t.release()
        except BaseException as e:  # never return into pytest
            print(f"child: {type(e).__name__}: {e}", flush=True)
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    client.unpublish("forked")
    t.release()
