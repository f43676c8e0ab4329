"""TinyLM, the small transformer examples/serve serves, and a plain-torch
loader for its checkpoint (the private baseline and the tests' reference).

Everything the model keeps is a parameter in the checkpoint: the causal mask
is computed in forward, so a module built on the meta device and attached to
the checkpoint's tensors (tensord.torch.attach) has nothing left to fill in.
The output head is tied to the token embedding; checkpoints store it once,
as ``tok.weight``.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn

# ~85 MB of float32: big enough that four private copies are plain to see.
DEFAULT_CONFIG = {
    "vocab": 16384,
    "d_model": 512,
    "n_heads": 8,
    "n_layers": 4,
    "d_ff": 2048,
    "max_seq": 512,
}


def config_from(metadata: Mapping[str, str]) -> dict:
    """The model's config from a checkpoint's __metadata__ (the JSON string
    make_weights.py stores under "config")."""
    try:
        cfg = json.loads(metadata["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            "the checkpoint's __metadata__ has no valid 'config' (%s): "
            "was it written by make_weights.py?" % e
        ) from None
    missing = set(DEFAULT_CONFIG) - set(cfg)
    if missing:
        raise ValueError("config %r lacks %s" % (cfg, sorted(missing)))
    return cfg


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: dict, device=None) -> None:
        super().__init__()
        d, ff = cfg["d_model"], cfg["d_ff"]
        if d % cfg["n_heads"]:
            raise ValueError("d_model %d is not a multiple of n_heads %d"
                             % (d, cfg["n_heads"]))
        self.n_heads = cfg["n_heads"]
        self.ln1 = nn.LayerNorm(d, device=device)
        self.qkv = nn.Linear(d, 3 * d, device=device)
        self.proj = nn.Linear(d, d, device=device)
        self.ln2 = nn.LayerNorm(d, device=device)
        self.fc1 = nn.Linear(d, ff, device=device)
        self.fc2 = nn.Linear(ff, d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, hd = self.n_heads, d // self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, h, hd).transpose(1, 2)
        k = k.view(b, t, h, hd).transpose(1, 2)
        v = v.view(b, t, h, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        # Computed here, not a buffer: nothing outside the checkpoint.
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Token and position embeddings, n_layers blocks, a final LayerNorm
    and an output head tied to the token embedding."""

    def __init__(self, cfg: dict, device=None) -> None:
        super().__init__()
        self.cfg = dict(cfg)
        self.tok = nn.Embedding(cfg["vocab"], cfg["d_model"], device=device)
        self.pos = nn.Embedding(cfg["max_seq"], cfg["d_model"], device=device)
        self.blocks = nn.ModuleList(
            Block(cfg, device=device) for _ in range(cfg["n_layers"])
        )
        self.ln_f = nn.LayerNorm(cfg["d_model"], device=device)
        self.head = nn.Linear(cfg["d_model"], cfg["vocab"], bias=False,
                              device=device)
        self.head.weight = self.tok.weight  # tied: stored once, as tok.weight

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states, (batch, seq, d_model), of token ids
        (batch, seq)."""
        t = ids.shape[-1]
        pos = torch.arange(t, device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for every position."""
        return self.head(self.hidden(ids))


def check_tokens(cfg: dict, tokens: List[int]) -> None:
    """Raises ValueError unless tokens is 1..max_seq ids below vocab."""
    if not 1 <= len(tokens) <= cfg["max_seq"]:
        raise ValueError("%d tokens: 1 to %d are served"
                         % (len(tokens), cfg["max_seq"]))
    bad = [t for t in tokens if not 0 <= t < cfg["vocab"]]
    if bad:
        raise ValueError("token ids %s are outside [0, %d)"
                         % (bad[:5], cfg["vocab"]))


@torch.no_grad()
def predict(model: TinyLM, tokens: List[int], k: int = 5) -> Tuple[int, List[Tuple[int, float]]]:
    """The next token after tokens and the k highest logits as (token,
    logit) pairs, best first. The head runs on the last position only."""
    ids = torch.tensor([tokens], dtype=torch.long)
    last = model.hidden(ids)[0, -1]
    logits = model.head(last)
    values, indices = logits.topk(k)
    top = [(int(i), float(v)) for i, v in zip(indices, values)]
    return top[0][0], top


def init_weights(cfg: dict, seed: int) -> TinyLM:
    """A TinyLM with seeded weights (GPT-2's scale: N(0, 0.02))."""
    g = torch.Generator().manual_seed(seed)
    model = TinyLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def checkpoint(model: TinyLM) -> Dict[str, torch.Tensor]:
    """model's state dict as a checkpoint holds it: the tied head left out."""
    sd = model.state_dict()
    del sd["head.weight"]
    return sd


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64}


def read_safetensors(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """A .safetensors file read into private memory with plain torch (the
    baseline tensord saves: every process holds a copy). Returns the tensors
    and the __metadata__."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        dtype = _DTYPES[e["dtype"]]
        count = (end - begin) // torch.empty(0, dtype=dtype).element_size()
        t = torch.frombuffer(data, dtype=dtype, count=count, offset=begin)
        out[name] = t.view(e["shape"])
    return out, meta


def load_private(path: str) -> TinyLM:
    """TinyLM built and loaded the plain torch way: the module's own
    weights, load_state_dict copying the file's tensors into them."""
    sd, meta = read_safetensors(path)
    cfg = config_from(meta)
    model = TinyLM(cfg)
    sd["head.weight"] = sd["tok.weight"]
    model.load_state_dict(sd)
    return model.eval()
