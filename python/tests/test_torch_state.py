"""publish_state_dict / load_state_dict: one packed storage per state dict."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import tensord
import tensord.torch as tdt
from tensord import _tensord

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def storage_ptr(t):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().data_ptr()
    return t.storage().untyped().data_ptr()




class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.norm = torch.nn.BatchNorm1d(6)  # int64 num_batches_tracked
        self.out = torch.nn.Linear(6, 10, bias=False)
        self.out.weight = self.emb.weight  # tied


def sample_state(seed=0):
    torch.manual_seed(seed)
    sd = Tied().state_dict()
    big = torch.randn(7, 9, dtype=torch.float64)
    sd["strided"] = big[2:, 1::2]  # offset and steps into a larger storage
    sd["strided_t"] = big.t()  # the same storage, another view: tied to it
    sd["scalar"] = torch.tensor(3.5 + seed)
    sd["empty"] = torch.empty(0, 3)
    sd["mask"] = torch.rand(5) > 0.5
    sd["half"] = torch.randn(4, 2).to(torch.bfloat16)
    sd["cplx"] = torch.randn(3, dtype=torch.complex64)
    sd["bytes_of_big"] = big.view(torch.uint8)[1]  # another dtype, same storage
    return sd


def test_round_trip_exact_and_tied(clean):
    c = clean
    sd = sample_state()
    sid = tdt.publish_state_dict(c, "models/a", sd)
    (s,) = c.ls()  # one packed storage, under one key
    assert s["id"] == sid and s["keys"] == ["models/a"]
    got = tdt.load_state_dict(c, "models/a")
    assert list(got) == list(sd)
    for name, want in sd.items():
        g = got[name]
        assert g.dtype == want.dtype, name
        assert g.shape == want.shape, name
        assert g.stride() == want.stride(), name
        assert g.storage_offset() == want.storage_offset(), name
        assert torch.equal(g, want), name
        hit = _tensord.find(storage_ptr(g)) if g.numel() else None
        if hit is not None:
            assert hit[0].storage_id == sid
            hit[0].release()
    # Tied stays tied, and only what was tied.
    assert storage_ptr(got["emb.weight"]) == storage_ptr(got["out.weight"])
    assert storage_ptr(got["strided"]) == storage_ptr(got["strided_t"])
    assert storage_ptr(got["strided"]) == storage_ptr(got["bytes_of_big"])
    assert storage_ptr(got["emb.weight"]) != storage_ptr(got["norm.weight"])
    assert storage_ptr(got["norm.weight"]) != storage_ptr(got["norm.bias"])
    c.unpublish("models/a")
    assert len(c.ls()) == 1  # the loaded tensors hold it
    del got


def test_packed_layout(clean):
    c = clean
    sd = {"a": torch.arange(3, dtype=torch.int16), "b": torch.ones(2, 2)}
    tdt.publish_state_dict(c, "models/layout", sd)
    t = c.lookup("models/layout", timeout=0, readonly=True)
    raw = bytes(memoryview(t))
    assert raw[:8] == b"TDSTATE1"
    n = int.from_bytes(raw[8:16], "little")
    m = json.loads(raw[16 : 16 + n])
    assert m["tensors"]["a"] == {
        "dtype": "int16", "shape": [3], "stride": [1], "storage_offset": 0,
        "region": 0,
    }
    assert [r["nbytes"] for r in m["regions"]] == [6, 16]
    for r in m["regions"]:
        assert r["offset"] % 64 == 0 and r["offset"] >= 16 + n
    o = m["regions"][1]["offset"]
    assert raw[o : o + 16] == torch.ones(4).numpy().tobytes()
    t.release()
    c.unpublish("models/layout")


def tensorctl(sock, *args, check=True):
    ctl = os.environ.get("TENSORCTL_BIN") or os.path.join(
        REPO, "build", "client", "tensorctl"
    )
    return subprocess.run(
        [ctl, "--socket", sock, *args], capture_output=True, text=True,
        check=check, timeout=30,
    )


def test_tensorctl_lists_and_shows_a_published_state_dict(clean, daemon):
    """tensorctl info and show read publish_state_dict's blob: every tensor
    with its dtype, shape and bytes, and each one's values as torch has
    them."""
    c = clean
    sd = sample_state()
    tdt.publish_state_dict(c, "models/ctl", sd)
    info = json.loads(tensorctl(daemon, "--json", "info", "models/ctl").stdout)
    (view,) = info["views"]
    listed = {t["name"]: t for t in view["state_dict"]["tensors"]}
    assert list(listed) == list(sd)  # all of them, in order
    for name, want in sd.items():
        t = listed[name]
        assert t["dtype"] == str(want.dtype)[len("torch."):], name
        assert t["shape"] == list(want.shape), name
        assert t["stride"] == list(want.stride()), name
        assert t["storage_offset"] == want.storage_offset(), name
        assert t["nbytes"] == want.numel() * want.element_size(), name
    text = tensorctl(daemon, "info", "models/ctl").stdout
    assert "state dict: %d tensors in " % len(sd) in text
    assert re.search(r"^    emb\.weight +float32 +\[10, 6\] +240 B$", text, re.M), text
    for name in ("emb.weight", "strided", "strided_t", "scalar", "mask", "half",
                 "bytes_of_big", "norm.num_batches_tracked"):
        want = sd[name]
        out = tensorctl(daemon, "--json", "show", "models/ctl", name).stdout
        got = json.loads(out)
        assert got["tensor"] == name
        assert got["view"]["shape"] == list(want.shape), name
        assert got["view"]["stride"] == list(want.stride()), name
        # The shortest decimals that read back as the same values in the
        # tensor's own dtype.
        first = torch.tensor(got["first"], dtype=want.dtype)
        assert torch.equal(first, want.reshape(-1)[:3]), (name, got["first"])
        assert got["total"] == want.numel(), name
    # An INDEX after the TENSOR, as Python's.
    out = json.loads(
        tensorctl(daemon, "--json", "show", "models/ctl", "strided", "[1, 2:]").stdout
    )
    want = sd["strided"][1, 2:]
    assert torch.equal(torch.tensor(out["first"], dtype=want.dtype), want[:3])
    bad = tensorctl(daemon, "show", "models/ctl", "nope", check=False)
    assert bad.returncode == 1
    assert "no tensor 'nope' (tensorctl show models/ctl lists its" in bad.stderr
    c.unpublish("models/ctl")


def test_readonly_load_writes_stay_private(clean):
    c = clean
    sd = {"w": torch.randn(256, 64)}
    tdt.publish_state_dict(c, "models/ro", sd)
    a = tdt.load_state_dict(c, "models/ro")
    a["w"].mul_(0)  # no crash: copy-on-write
    assert float(a["w"].abs().sum()) == 0
    w = tdt.load_state_dict(c, "models/ro", readonly=False)
    assert torch.equal(w["w"], sd["w"])  # the shared pages are untouched
    w["w"][0, 0] = 123.0  # writable load: writes reach the shared pages
    del a
    b = tdt.load_state_dict(c, "models/ro")
    assert float(b["w"][0, 0]) == 123.0
    c.unpublish("models/ro")
    del w, b


def test_update_is_atomic_for_readers(clean):
    c = clean
    v1, v2 = sample_state(1), sample_state(2)
    tdt.publish_state_dict(c, "models/live", v1)
    old = tdt.load_state_dict(c, "models/live")
    tdt.publish_state_dict(c, "models/live", v2)
    assert len(c.ls()) == 2  # v1 lives on in its reader, v2 under the key
    new = tdt.load_state_dict(c, "models/live")
    for name in v1:
        assert torch.equal(old[name], v1[name]), name
        assert torch.equal(new[name], v2[name]), name
    del old
    assert len(c.ls()) == 1  # v1 went with its last reader
    c.unpublish("models/live")
    del new


def test_errors(clean):
    c = clean
    with pytest.raises(tensord.NotFound):
        tdt.load_state_dict(c, "models/none")
    t = c.empty((64,), "uint8")
    c.publish("models/junk", t)
    with pytest.raises(ValueError, match="state dict"):
        tdt.load_state_dict(c, "models/junk")
    with pytest.raises(TypeError, match="'step'"):
        tdt.publish_state_dict(c, "models/bad", {"w": torch.ones(2), "step": 3})
    with pytest.raises(tensord.NotFound):
        c.lookup("models/bad", timeout=0)  # nothing published on failure
    c.unpublish("models/junk")
    t.release()


def run_example(daemon, name, timeout=120):
    env = dict(os.environ, TENSORD_SOCKET=daemon)
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "docs", "examples", name)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert p.returncode == 0, "%s failed:\n%s%s" % (name, p.stdout, p.stderr)
    return p.stdout


def test_example_dataloader(clean, daemon):
    out = run_example(daemon, "dataloader.py")
    assert "accuracy" in out


def test_example_shared_weights(clean, daemon):
    out = run_example(daemon, "shared_weights.py")
    lines = [l for l in out.splitlines() if l.startswith("server ")]
    assert len(lines) == 3 and all("ok" in l for l in lines), out


def test_publish_a_module_or_say_what_is_wanted(clean):
    c = clean
    torch.manual_seed(0)
    m = Tied()
    tdt.publish_state_dict(c, "models/module", m)  # its state_dict()
    got = tdt.load_state_dict(c, "models/module")
    want = m.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert storage_ptr(got["emb.weight"]) == storage_ptr(got["out.weight"])
    for bad in ([torch.ones(2)], torch.ones(2), "weights"):
        with pytest.raises(TypeError, match="a state dict .* or an nn.Module"):
            tdt.publish_state_dict(c, "models/bad", bad)
    c.unpublish("models/module")
    del got


def test_is_shared_is_false_and_share_memory_moves_out(clean):
    """What docs/python.md says of is_shared(): torch answers True only for a
    storage its own allocator mapped (one it can hand on by fd or file name);
    a tensord storage reaches torch through DLPack, so False. And torch's
    share_memory_() on such a tensor moves its bytes into torch's own shared
    memory: the tensor no longer aliases the tensord storage."""
    c = clean
    tdt.publish_state_dict(c, "models/shared", {"w": torch.arange(6.0)})
    w = tdt.load_state_dict(c, "models/shared", readonly=False)["w"]
    assert not w.is_shared()  # torch's answer
    hit = _tensord.find(w.data_ptr())  # tensord's: yes, in a storage
    assert hit is not None
    base, off = hit
    before = w.data_ptr()
    w.share_memory_()
    assert w.is_shared() and w.data_ptr() != before  # moved out
    assert _tensord.find(w.data_ptr()) is None
    w.fill_(-1)  # no longer reaches the tensord storage
    assert base.numpy()[off : off + 24].view("float32").tolist() == [
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    base.release()
    c.unpublish("models/shared")


def pss_bytes(pid):
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Pss in /proc/%d/smaps_rollup" % pid)


@pytest.mark.parametrize("how", ["meta", "load_state_dict"])
def test_k_servers_hold_one_copy_of_the_weights(clean, daemon, how):
    """docs/examples/shared_weights.py's servers, at tens of MB: K processes
    that attach the published state dict and build the Net on the meta
    device hold one copy of the weights between them (the sum of what their
    Pss grew by, from /proc/PID/smaps_rollup, under 1.5 copies); a Net built
    on the CPU that load_state_dict()s the weights holds a copy per process
    (the pitfall docs/python.md shows), more than K copies."""
    import torch.multiprocessing as mp
    from _children import _shared_weights_example, serve_weights

    c = clean
    K = 3
    sizes = {"vocab": 20000, "width": 512}
    ex = _shared_weights_example()
    torch.manual_seed(0)
    model = ex.Net(**sizes).eval()
    sd = model.state_dict()
    nbytes = sum(
        {storage_ptr(t): t.numel() * t.element_size() for t in sd.values()}.values()
    )
    assert 40e6 < nbytes < 60e6  # tens of MB
    tdt.publish_state_dict(c, "models/served", sd)
    del sd
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensord.torch"])
    conns, procs = [], []
    try:
        for _ in range(K):
            a, b = ctx.Pipe()
            p = ctx.Process(target=serve_weights,
                            args=(b, daemon, "models/served", sizes, how))
            p.start()
            b.close()
            conns.append(a)
            procs.append(p)
        for a in conns:
            assert a.poll(120) and a.recv() == "ready"
        base = [pss_bytes(p.pid) for p in procs]
        for a in conns:
            a.send("go")
        for a in conns:
            assert a.poll(120)
            tokens, logits = a.recv()
            with torch.no_grad():
                assert torch.allclose(logits, model(tokens), atol=1e-5)
        held = [pss_bytes(p.pid) for p in procs]
        for a in conns:
            a.send("quit")
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    grown = sum(held) - sum(base)
    print("%s: %d servers grew by %.1f MB of Pss, %.2f copies of %.1f MB"
          % (how, K, grown / 1e6, grown / nbytes, nbytes / 1e6))
    if how == "meta":
        assert grown < 1.5 * nbytes, (grown, nbytes)
    else:
        assert grown > K * nbytes, (grown, nbytes)
    c.unpublish("models/served")
