#!/usr/bin/env python3
"""One process publishes a model's weights; K=3 server processes serve it.

The publisher packs the state dict into one tensord storage under one key.
Each server maps it with one lookup (read-only, copy-on-write: a stray write
in a server changes only that server's private copy), builds the model on
the meta device (its structure, without weights of its own) and runs it on
the shared tensors with functional_call: K servers, one copy of the weights
in memory. (Net() on the CPU would allocate and initialise a copy of the
weights in each server, which functional_call never reads, and
model.load_state_dict(weights) would copy the shared tensors into it:
docs/python.md has the numbers.) Then the publisher publishes new weights
under the same key; servers that load again get all new tensors (never a
mix), while whatever still holds the old version keeps it intact.

Run against a daemon (tensord --socket PATH) with TENSORD_SOCKET=PATH:
    PYTHONPATH=build/python /usr/bin/python3 docs/examples/shared_weights.py
"""

import warnings

import torch
import torch.multiprocessing as mp
from torch.nn.utils.stateless import functional_call

import tensord
import tensord.torch as tdt

K = 3
KEY = "examples/shared_weights"


class Net(torch.nn.Module):
    """A small language-model-shaped net with tied input/output embeddings."""

    def __init__(self, vocab: int = 1000, width: int = 64, device=None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width, device=device)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width, device=device),
            torch.nn.GELU(),
            torch.nn.Linear(4 * width, width, device=device),
        )
        self.norm = torch.nn.LayerNorm(width, device=device)
        self.out = torch.nn.Linear(width, vocab, bias=False, device=device)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.mlp(self.emb(tokens))))


def storage_of(x: torch.Tensor) -> int:
    """The id of the tensord storage x's bytes lie in (-1: not in tensord)."""
    hit = tensord._tensord.find(x.data_ptr())
    if hit is None:
        return -1
    sid = hit[0].storage_id
    hit[0].release()
    return sid


def server_model(**sizes) -> Net:
    """The servers' Net: on the meta device, it has every parameter's shape
    and dtype and allocates none of them (torch.nn.utils.skip_init(Net,
    device="meta") does the same for a module that takes device=)."""
    return Net(device="meta", **sizes).eval()


def run(model: Net, weights, tokens: torch.Tensor) -> torch.Tensor:
    """model's forward pass on weights (names to tensors), not its own."""
    # torch 1.13's functional_call needs both names of a tied weight (it does
    # not follow the tie), and warns about getting both.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "functional_call was passed multiple values")
        with torch.no_grad():
            return functional_call(model, weights, (tokens,))


def serve(rank, tokens, expected, loaded, updated, results) -> None:
    client = tensord.connect()
    model = server_model()
    answers = []
    for version, event in ((1, loaded), (2, None)):
        weights = tdt.load_state_dict(client, KEY)  # one lookup, no copy
        logits = run(model, weights, tokens)
        answers.append(torch.allclose(logits, expected[version - 1], atol=1e-5))
        sid = storage_of(weights["emb.weight"])
        tied = weights["emb.weight"].data_ptr() == weights["out.weight"].data_ptr()
        results.put((rank, version, sid, tied))
        if event is not None:
            event.set()
            updated.wait(60)
    results.put((rank, "done", all(answers), None))
    client.close()


def main() -> None:
    client = tensord.connect()
    tdt.install(client)  # the servers' arguments travel through tensord too
    torch.manual_seed(0)
    model = Net().eval()
    tokens = torch.randint(0, 1000, (4, 16))
    v1 = tdt.publish_state_dict(client, KEY, model.state_dict())
    with torch.no_grad():
        expected = [model(tokens)]
        for p in model.parameters():  # "training" makes version 2
            p.add_(0.01 * torch.randn_like(p))
        expected.append(model(tokens))

    # Servers are processes of their own, not forks of this one: forked from
    # a clean server process that imported torch once for all of them.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensord.torch"])
    loaded = [ctx.Event() for _ in range(K)]
    updated = ctx.Event()
    results = ctx.Queue()
    servers = [
        ctx.Process(
            target=serve, args=(r, tokens, expected, loaded[r], updated, results)
        )
        for r in range(K)
    ]
    for s in servers:
        s.start()
    for e in loaded:
        e.wait(120)
    v2 = tdt.publish_state_dict(client, KEY, model.state_dict())  # atomic swap
    print("published version 1 as storage %d, version 2 as storage %d" % (v1, v2))
    updated.set()

    seen = {}
    for _ in range(3 * K):
        rank, what, a, b = results.get(timeout=120)
        seen.setdefault(rank, {})[what] = (a, b)
    for s in servers:
        s.join(60)
    ok = True
    for rank in range(K):
        r = seen[rank]
        good = (
            r[1] == (v1, True)
            and r[2] == (v2, True)
            and r["done"][0]
            and servers[rank].exitcode == 0
        )
        ok &= good
        print(
            "server %d: %s (version 1 from storage %d, version 2 from storage %d,"
            " tied weights tied, answers match the publisher's: %s)"
            % (rank, "ok" if good else "FAILED", r[1][0], r[2][0], r["done"][0])
        )
    client.unpublish(KEY)
    tdt.uninstall()
    client.close()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
