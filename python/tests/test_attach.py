"""tensord.torch.attach: a module bound to shared tensors, without a copy."""

import gc
import weakref

import pytest
import torch

import tensord
import tensord.torch as tdt
from _attach_children import Net, attach_child, positions, reference


def published(c, key="att/net", seed=0):
    model = reference(seed)
    tdt.publish_state_dict(c, key, model)
    return model


def in_storage(t, sid):
    hit = tensord.find(t.data_ptr())
    if hit is None:
        return False
    try:
        return hit[0].storage_id == sid
    finally:
        hit[0].release()


def test_a_spawned_process_runs_the_module_on_the_shared_pages(clean, daemon):
    """The parent publishes Net's state dict; a spawned process attaches it
    to a module built with meta_device(), to one built on the CPU and by
    key: same logits as the parent's module, every parameter and persistent
    buffer in the published storage (no copy), the tie kept, Parameters
    with requires_grad False, the CPU module's own weights freed, and a
    write through a parameter private to the writer."""
    import torch.multiprocessing as mp

    c = clean
    model = published(c)
    torch.manual_seed(5)
    tokens = torch.randint(0, 40, (3, 7))
    with torch.no_grad():
        want = model(tokens)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=attach_child, args=(b, daemon, "att/net", tokens))
    p.start()
    b.close()
    try:
        assert a.poll(120), "the child did not answer within 120 s"
        got = a.recv()
        # Built on meta: everything, the non-persistent buffer too.
        assert got["meta_devices"] == ["meta"]
        err = got["meta_error"]
        assert err is not None and "'pos'" in err and "non-persistent" in err
        assert "meta" in err
        assert got["meta_untouched"]  # refused: nothing was bound
        assert got["meta_report"] == ([], [], [])
        assert torch.equal(got["meta_logits"], want)
        assert got["names"] == [
            "emb.weight", "lin.weight", "lin.bias", "norm.weight",
            "norm.bias", "head.weight",
        ]
        assert got["all_parameters"]
        assert got["requires_grad"] == [False] * 6
        assert got["in_storage"] == {
            "emb.weight": True, "lin.weight": True, "lin.bias": True,
            "norm.weight": True, "norm.bias": True, "head.weight": True,
            "scale": True, "pos": False,  # pos: the child's own, passed in
        }
        assert got["ptr_is_weights"] == {n: True for n in got["ptr_is_weights"]}
        assert got["tied"]
        # Built on the CPU: its weights went, its computed pos stayed.
        assert got["cpu_freed"] == [True] * len(got["cpu_freed"])
        assert len(got["cpu_freed"]) == 6  # 5 Parameters (one tied) + scale
        assert got["cpu_pos_kept"]
        assert got["cpu_tied"]
        assert torch.equal(got["cpu_logits"], want)
        # By key.
        assert got["key_in_storage"]
        assert torch.equal(got["key_logits"], want)
        # The child's write is its own.
        w0 = float(model.lin.weight[0, 0])
        assert got["written"] == pytest.approx(w0 + 100.0)
        fresh = tdt.load_state_dict(c, "att/net")
        assert torch.equal(fresh["lin.weight"], model.lin.weight.detach())
        del fresh
        a.send("done")
        p.join(60)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    c.unpublish("att/net")


def test_binds_parameters_and_buffers_without_a_copy(clean):
    c = clean
    ref = published(c)
    w = tdt.load_state_dict(c, "att/net")
    model = Net().eval()
    report = tdt.attach(model, w)
    assert report == ([], [], []) and repr(report) == "<All keys matched successfully>"
    for n, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and not p.requires_grad, n
        assert p.data_ptr() == w[n].data_ptr(), n
        assert in_storage(p, w.version), n
    assert model.scale is w["scale"]
    assert model.head.weight is model.emb.weight
    tokens = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))
    del w, model
    c.unpublish("att/net")


@pytest.mark.parametrize("stored", ["emb.weight", "head.weight"])
def test_a_tie_stored_once_binds_both_names(clean, stored):
    """A checkpoint that keeps one name of a tie (HF leaves lm_head.weight
    out): both names get the one Parameter, and nothing is missing."""
    c = clean
    published(c)
    w = dict(tdt.load_state_dict(c, "att/net"))
    dropped = "head.weight" if stored == "emb.weight" else "emb.weight"
    del w[dropped]
    model = Net()
    assert tdt.attach(model, w) == ([], [], [])
    assert model.head.weight is model.emb.weight
    assert model.emb.weight.data_ptr() == w[stored].data_ptr()
    del w, model
    c.unpublish("att/net")


def test_shared_submodule_is_bound_under_each_name(clean):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.b = self.a  # one module, two names

    c = clean
    src = Two()
    tdt.publish_state_dict(c, "att/two", src)
    w = tdt.load_state_dict(c, "att/two")
    assert sorted(w) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    m = Two()
    assert tdt.attach(m, w) == ([], [], [])
    assert m.a is m.b and m.a.weight.data_ptr() == w["a.weight"].data_ptr()
    del w, m
    c.unpublish("att/two")


def test_strict_refuses_missing_unexpected_and_mismatched_naming_each(clean):
    c = clean
    published(c)
    w = dict(tdt.load_state_dict(c, "att/net"))
    del w["lin.bias"]
    w["extra.weight"] = torch.zeros(2, 2)
    w["norm.weight"] = torch.zeros(17)  # shape
    w["scale"] = torch.zeros(16, dtype=torch.float64)  # dtype
    model = Net()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(tdt.AttachError) as ei:
        tdt.attach(model, w)
    msg = str(ei.value)
    assert "the weights do not fit Net" in msg
    assert "missing" in msg and "'lin.bias' (16,) float32" in msg
    assert "unexpected" in msg and "'extra.weight' (2, 2) float32" in msg
    assert ("'norm.weight': the module has (16,) float32, the weights (17,) "
            "float32") in msg
    assert ("'scale': the module has (16,) float32, the weights (16,) "
            "float64") in msg
    r = ei.value.report
    assert r.missing_keys == ["lin.bias"]
    assert r.unexpected_keys == ["extra.weight"]
    assert [m.name for m in r.mismatched_keys] == ["norm.weight", "scale"]
    # Nothing was bound.
    assert {n: p for n, p in model.named_parameters()} == before
    del w, model
    c.unpublish("att/net")


def test_strict_false_binds_what_fits_and_reports_the_rest(clean):
    c = clean
    published(c)
    w = dict(tdt.load_state_dict(c, "att/net"))
    del w["lin.bias"]
    w["extra"] = torch.zeros(1)
    w["norm.weight"] = torch.zeros(4, dtype=torch.float16)
    model = Net()
    own_bias, own_norm = model.lin.bias, model.norm.weight
    r = tdt.attach(model, w, strict=False)
    assert isinstance(r, tdt.IncompatibleKeys)
    assert r.missing_keys == ["lin.bias"]
    assert r.unexpected_keys == ["extra"]
    (m,) = r.mismatched_keys
    assert m == ("norm.weight", (16,), torch.float32, (4,), torch.float16)
    assert str(m) == (
        "'norm.weight': the module has (16,) float32, the weights (4,) float16"
    )
    assert model.lin.bias is own_bias and model.norm.weight is own_norm
    assert model.lin.weight.data_ptr() == w["lin.weight"].data_ptr()
    assert model.head.weight is model.emb.weight
    assert model.emb.weight.data_ptr() == w["emb.weight"].data_ptr()
    del w, model
    c.unpublish("att/net")


def test_meta_module_needs_its_non_persistent_buffer(clean):
    """Built with device="meta" (the layers' own argument): the computed
    buffer 'pos' is on meta and no state dict has it: refused naming it,
    strict or not; passed in the weights, it is bound."""
    c = clean
    ref = published(c)
    w = tdt.load_state_dict(c, "att/net")
    model = Net(device="meta")
    for strict in (True, False):
        with pytest.raises(tdt.AttachError, match=r"non-persistent buffer 'pos' is on the meta device"):
            tdt.attach(model, w, strict=strict)
    assert model.lin.weight.is_meta
    tdt.attach(model, dict(w, pos=positions(16)))
    tokens = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))
    del w, model
    c.unpublish("att/net")


def test_skip_init_module_is_bound(clean):
    """torch.nn.utils.skip_init: weights allocated, never initialised; the
    binding frees them. Its non-persistent buffers are uninitialised memory
    too (skip_init builds on meta, then to_empty()), which attach cannot
    tell: they must come with the weights."""
    c = clean
    ref = published(c)
    w = tdt.load_state_dict(c, "att/net")
    model = torch.nn.utils.skip_init(Net)
    own = weakref.ref(model.lin.weight)
    tdt.attach(model, dict(w, pos=positions(16)))
    gc.collect()
    assert own() is None
    tokens = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))
    del w, model
    c.unpublish("att/net")


def test_meta_device_builds_on_meta_without_memory():
    with tdt.meta_device():
        m = torch.nn.TransformerEncoderLayer(32, 4)
        t = torch.zeros(3)
        explicit = torch.zeros(3, device="cpu")
    assert {p.device.type for p in m.parameters()} == {"meta"}
    assert t.is_meta and not explicit.is_meta
    assert not torch.zeros(1).is_meta  # only inside


def test_bad_arguments_say_what(clean):
    with pytest.raises(TypeError, match="nn.Module"):
        tdt.attach(object(), {})
    with pytest.raises(TypeError, match="mapping"):
        tdt.attach(Net(), [1, 2])
    with pytest.raises(TypeError, match=r"weights\['lin.weight'\] is a list"):
        tdt.attach(Net(), {"lin.weight": [1.0]})
    with pytest.raises(tensord.NotFound):
        tdt.attach(Net(), "att/none", client=clean)


def test_version_of(clean):
    c = clean
    published(c)
    w = tdt.load_state_dict(c, "att/net")
    assert isinstance(w, dict) and w.name == "att/net"
    assert tdt.version_of(w) == w.version == c.lookup("att/net", timeout=0).storage_id
    assert w.storage_ids == (w.version,)
    assert tdt.version_of({}) is None
    del w
    gc.collect()
    c.unpublish("att/net")
