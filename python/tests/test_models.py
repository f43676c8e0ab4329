"""Models from safetensors checkpoints in Python: save_safetensors,
load_safetensors (once per machine), attach and follow by model name, and
Client.load_model / open_model / unload_model."""

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tensord
import tensord.torch as tdt
from _attach_children import Net, positions, reference
from conftest import nothing_left

HERE = os.path.dirname(os.path.abspath(__file__))


def mixed():
    """One tensor of each dtype torch and safetensors share, odd shapes."""
    g = torch.Generator().manual_seed(3)
    return {
        "f64": torch.randn(3, 5, dtype=torch.float64, generator=g),
        "f32": torch.randn(7, generator=g),
        "f16": torch.randn(2, 3, 4, generator=g).half(),
        "bf16": torch.randn(9, generator=g).bfloat16(),
        "i64": torch.arange(-4, 6, dtype=torch.int64),
        "i32": torch.arange(5, dtype=torch.int32) * -3,
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def save_net(path, seed=0):
    sd = reference(seed).state_dict()
    del sd["head.weight"]  # the tie, stored once as checkpoints do
    tdt.save_safetensors(sd, path, metadata={"format": "pt", "seed": str(seed)})


def test_save_then_load_gives_the_same_tensors(clean, tmp_path):
    c = clean
    want = mixed()
    path = tmp_path / "mixed.safetensors"
    tdt.save_safetensors(want, path, metadata={"format": "pt"})
    w = tdt.load_safetensors(path, client=c)
    assert isinstance(w, tdt.Weights)
    assert w.name == "mixed" and w.version == 1
    assert w.metadata == {"format": "pt"}
    assert list(w) == list(want)  # the checkpoint's order
    for k, t in want.items():
        assert w[k].dtype == t.dtype and w[k].shape == t.shape, k
        assert torch.equal(w[k], t), k
    # One shard: every tensor lies in its one storage, read-only keys exist.
    assert len(w.storage_ids) == 1
    keys = {k for s in c.ls() for k in s["keys"]}
    assert {"mixed", "mixed/f32", "mixed@1/mixed.safetensors"} <= keys
    del w
    c.unload_model("mixed")


def test_a_second_call_attaches_and_force_reloads(clean, tmp_path):
    c = clean
    path = tmp_path / "net.safetensors"
    save_net(path)
    w1 = tdt.load_safetensors(path, name="net", client=c)
    w2 = tdt.load_safetensors(path, name="net", client=c)
    assert w2.version == 1 and w2.storage_ids == w1.storage_ids
    assert w2["lin.weight"].data_ptr() == w1["lin.weight"].data_ptr()
    w3 = tdt.load_safetensors(path, name="net", client=c, force=True)
    assert w3.version == 2 and w3.storage_ids != w1.storage_ids
    # The old version lives while w1 holds it.
    assert torch.equal(w1["lin.weight"], w3["lin.weight"])
    del w1, w2, w3
    c.unload_model("net")


def test_writes_stay_private(clean, daemon, tmp_path):
    """The tensors are copy-on-write: a write changes this process's pages
    only; another process attaches the file's bytes."""
    c = clean
    path = tmp_path / "net.safetensors"
    save_net(path)
    a = tdt.load_safetensors(path, client=c)
    before = a["lin.bias"].clone()
    a["lin.bias"].add_(1.0)
    assert torch.equal(a["lin.bias"], before + 1.0)
    out = run_child(
        f"""
        w = tdt.load_safetensors({str(path)!r})
        print(json.dumps(w["lin.bias"].tolist()))
        """,
        env={"TENSORD_SOCKET": daemon},
    )
    assert json.loads(out) == pytest.approx(before.tolist())
    del a
    c.unload_model("net")


def run_child(body, env=None):
    code = "import json, tensord, tensord.torch as tdt, torch\n" + textwrap.dedent(
        body
    )
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=e,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_k_processes_at_once_load_once(clean, daemon, tmp_path):
    """K = 4 processes call load_safetensors at once: one loads, the others
    wait for it and attach; all four get version 1 (a second load would
    have made version 2) and the same storage and bytes."""
    c = clean
    path = tmp_path / "net.safetensors"
    save_net(path, seed=4)
    body = f"""
        import os, time
        go = {str(tmp_path / "go")!r}
        while not os.path.exists(go):
            time.sleep(0.001)
        w = tdt.load_safetensors({str(path)!r}, name="k4")
        print(json.dumps({{"version": w.version, "ids": list(w.storage_ids),
                          "sum": float(sum(t.double().sum() for t in w.values()))}}))
    """
    code = "import json, tensord, tensord.torch as tdt, torch\n" + textwrap.dedent(
        body
    )
    env = dict(os.environ, TENSORD_SOCKET=daemon)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env,
        )
        for _ in range(4)
    ]
    (tmp_path / "go").touch()
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, e
        outs.append(json.loads(o))
    assert [o["version"] for o in outs] == [1, 1, 1, 1]
    assert all(o["ids"] == outs[0]["ids"] for o in outs)
    want = float(sum(t.double().sum() for k, t in reference(4).state_dict().items()
                     if k != "head.weight"))
    assert all(o["sum"] == pytest.approx(want) for o in outs)
    c.unload_model("k4")


def test_attach_by_model_name_and_by_weights(clean, tmp_path):
    c = clean
    path = tmp_path / "net.safetensors"
    save_net(path, seed=2)
    tdt.load_safetensors(path, name="m", client=c)
    want = reference(2)
    tokens = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        ref = want(tokens)
    by_name = Net()  # built on the CPU: the binding frees its own weights
    tdt.attach(by_name, "m", client=c)
    w = tdt.load_safetensors(path, name="m", client=c)
    with tdt.meta_device():
        by_dict = Net()
    by_dict.pos = positions(16)  # non-persistent: in no checkpoint
    tdt.attach(by_dict, w)
    for m in (by_name, by_dict):
        with torch.no_grad():
            assert torch.allclose(m.eval()(tokens), ref)
        assert m.head.weight is m.emb.weight  # the tie, kept
        assert not any(p.requires_grad for p in m.parameters())
    assert by_dict.lin.weight.data_ptr() == w["lin.weight"].data_ptr()
    with pytest.raises(tdt.AttachError, match="lin.weight"):
        small = Net(width=8)
        tdt.attach(small, w)
    del by_name, by_dict, w
    c.unload_model("m")


def test_follow_a_model_sees_each_load(clean, tmp_path):
    c = clean
    path = tmp_path / "net.safetensors"
    save_net(path, seed=0)
    c.load_model(str(path), "f")
    seen = []
    with tdt.follow("f", lambda w: seen.append(w.version) or w.version,
                    client=c) as f:
        assert f.version == 1 and f.current == 1
        save_net(path, seed=1)  # a new file: size or mtime differ
        os.utime(path, ns=(1, 10**18))
        r = c.load_model(str(path), "f")
        assert r["version"] == 2 and not r["unchanged"]
        assert f.wait(2, timeout=30), f.error
        assert f.version == 2
        assert torch.equal(f.weights["lin.weight"],
                           reference(1).state_dict()["lin.weight"])
    assert seen == [1, 2]
    c.unload_model("f")


def test_client_model_calls(clean, tmp_path):
    c = clean
    path = tmp_path / "calls.safetensors"
    tdt.save_safetensors({"a": torch.ones(4)}, path)
    r = c.load_model(path)  # an os.PathLike; the name from the stem
    assert r["name"] == "calls" and r["version"] == 1 and r["tensors"] == 1
    assert r["bytes"] == os.path.getsize(path) and r["shards"] == 1
    assert not r["unchanged"] and r["seconds"] >= 0
    assert c.load_model(str(path))["unchanged"]
    version, manifest, items = c.open_model("calls", timeout=0)
    assert version == 1 and json.loads(manifest)["name"] == "calls"
    assert [n for n, _ in items] == ["a"]
    assert items[0][1].key == "calls/a"
    for _, t in items:
        t.release()
    c.unload_model("calls")
    with pytest.raises(tensord.NotFound):
        c.open_model("calls", timeout=0)
    with pytest.raises(tensord.Timeout, match="waited"):
        c.open_model("calls", timeout=0.1)
    with pytest.raises(tensord.NotFound):
        c.unload_model("calls")


def test_bad_checkpoints_leave_nothing(clean, tmp_path):
    c = clean
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4],
                               "data_offsets": [0, 12]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 12)
    with pytest.raises(tensord.Error, match=r"bad.safetensors.*'w'.*data_offsets"):
        tdt.load_safetensors(bad, client=c)
    unknown = tmp_path / "unk.safetensors"
    header = json.dumps({"x": {"dtype": "Q9", "shape": [1],
                               "data_offsets": [0, 1]}}).encode()
    unknown.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(tensord.Error, match=r"'x'.*Q9"):
        tdt.load_safetensors(unknown, client=c)
    with pytest.raises(tensord.NotFound):
        tdt.load_safetensors(tmp_path / "missing.safetensors", client=c)
    assert nothing_left(c)
    # No driver here (a GPU host would refuse the checkpoint instead).
    with pytest.raises(tensord.Error):
        tdt.load_safetensors(bad, device="cuda:0", client=c)
    with pytest.raises(ValueError, match="device"):
        tdt.load_safetensors(bad, device="meta", client=c)
    with pytest.raises(ValueError, match="timeout"):
        c.load_model(str(bad), wait=-1)
    with pytest.raises(TypeError):
        tdt.save_safetensors({"c": torch.zeros(2, dtype=torch.complex64)},
                             tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="metadata"):
        tdt.save_safetensors({"a": torch.zeros(1)}, tmp_path / "m.safetensors",
                             metadata={"n": 1})
    assert not (tmp_path / "c.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_a_dtype_torch_lacks_names_the_tensor(clean, tmp_path):
    c = clean
    p = tmp_path / "f8.safetensors"
    header = json.dumps({"q": {"dtype": "F8_E4M3", "shape": [2],
                               "data_offsets": [0, 2]}}).encode()
    header += b" " * (-len(header) % 8)
    p.write_bytes(len(header).to_bytes(8, "little") + header + b"\1\2")
    with pytest.raises(TypeError, match="model 'f8': tensor 'q'"):
        tdt.load_safetensors(p, client=c)
    gc.collect()
    c.unload_model("f8")
