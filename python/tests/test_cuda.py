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
    with pytest.raises(Exception):
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
    t.wait(stream=1)  # a stream (any value: the double has no streams)
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
    # The handle names the producer's event: once destroyed, a waiter is
    # told, naming the driver call.
    assert lib.cuEventDestroy_v2(ev) == 0
    r = waiter()
    assert r.returncode == 3 and "cuIpcOpenEventHandle" in r.stdout, (
        r.stdout + r.stderr)
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
