"""The module test_attach.py and test_watch.py bind, and what their child
processes run (spawned, so importable)."""

import gc
import weakref

import torch

import tensord


class Net(torch.nn.Module):
    """Transformer-ish: an embedding with a tied output head, a Linear, a
    LayerNorm, a persistent buffer and a non-persistent one (computed by the
    constructor, in no state dict)."""

    def __init__(self, vocab: int = 40, width: int = 16, device=None):
        super().__init__()
        f = {"device": device}
        self.emb = torch.nn.Embedding(vocab, width, **f)
        self.lin = torch.nn.Linear(width, width, **f)
        self.norm = torch.nn.LayerNorm(width, **f)
        self.head = torch.nn.Linear(width, vocab, bias=False, **f)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((width,), 0.5, device=device))
        self.register_buffer("pos", positions(width, device), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) * self.scale + self.pos
        x = self.norm(torch.relu(self.lin(x)) + x)
        return self.head(x)


def all_parameters(m: torch.nn.Module) -> list:
    """(name, Parameter) under every name, tied ones too (torch 1.13's
    named_parameters has no remove_duplicate=False)."""
    return [
        (pre + ("." if pre else "") + n, p)
        for pre, mod in m.named_modules(remove_duplicate=False)
        for n, p in mod._parameters.items()
        if p is not None
    ]


def positions(width: int, device=None) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, width, device=device)


def reference(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().eval()


def _in_storage(t: torch.Tensor, sid: int) -> bool:
    """t's bytes lie in tensord storage sid (this process's mapping)."""
    hit = tensord.find(t.data_ptr())
    if hit is None:
        return False
    base, off = hit
    try:
        return base.storage_id == sid and off + t.numel() * t.element_size() <= len(
            base
        )
    finally:
        base.release()


def attach_child(conn, sock: str, key: str, tokens: torch.Tensor) -> None:
    """Attaches the state dict under key three ways (a module built with
    meta_device(), one built on the CPU whose weights must go, one by key)
    and sends back what the parent checks; then writes through a parameter
    (copy-on-write: the parent must not see it)."""
    import tensord.torch as tdt

    out = {}
    with tensord.connect(sock) as c:
        weights = tdt.load_state_dict(c, key)
        sid = weights.version

        # Built on meta: its non-persistent buffer is on meta too.
        with tdt.meta_device():
            meta = Net()
        out["meta_devices"] = sorted({t.device.type for t in meta.state_dict().values()})
        try:
            tdt.attach(meta, weights)
            out["meta_error"] = None
        except tdt.AttachError as e:
            out["meta_error"] = str(e)
        out["meta_untouched"] = meta.emb.weight.is_meta
        report = tdt.attach(meta, dict(weights, pos=positions(meta.pos.numel())))
        out["meta_report"] = tuple(report)
        with torch.no_grad():
            out["meta_logits"] = meta(tokens)
        named = all_parameters(meta)
        out["names"] = [n for n, _ in named]
        out["all_parameters"] = all(
            type(p) is torch.nn.Parameter for _, p in named
        )
        out["requires_grad"] = [p.requires_grad for _, p in named]
        out["in_storage"] = {
            n: _in_storage(t, sid)
            for n, t in list(named) + list(meta.named_buffers())
        }
        out["tied"] = meta.head.weight is meta.emb.weight
        out["ptr_is_weights"] = {
            n: p.data_ptr() == weights[n].data_ptr() for n, p in named
            if n in weights
        }

        # Built on the CPU: binding frees its own weights.
        torch.manual_seed(123)
        cpu = Net().eval()
        refs = [weakref.ref(t) for t in cpu.parameters()] + [
            weakref.ref(cpu.scale)
        ]
        tdt.attach(cpu, weights)
        gc.collect()
        out["cpu_freed"] = [r() is None for r in refs]
        out["cpu_pos_kept"] = not _in_storage(cpu.pos, sid)
        with torch.no_grad():
            out["cpu_logits"] = cpu(tokens)
        out["cpu_tied"] = cpu.head.weight is cpu.emb.weight

        # By key (the state dict looked up through the client).
        by_key = Net().eval()
        tdt.attach(by_key, key, client=c)
        out["key_in_storage"] = _in_storage(by_key.lin.weight, sid)
        with torch.no_grad():
            out["key_logits"] = by_key(tokens)

        # A write through a bound parameter stays in this process.
        with torch.no_grad():
            meta.lin.weight.add_(100.0)
        out["written"] = float(meta.lin.weight[0, 0])
        conn.send(out)
        assert conn.recv() == "done"
        del meta, cpu, by_key, weights
