"""Writes a seeded TinyLM checkpoint (model.safetensors) for examples/serve.

    python3 make_weights.py                         # ./model.safetensors, ~85 MB
    python3 make_weights.py --seed 2 -o v2.safetensors
    python3 make_weights.py --layers 8 --d-model 768   # bigger

The config goes into the file's __metadata__ as a JSON string ("config"), so
the server builds the right module from the checkpoint alone. The output head
is tied to the token embedding and left out, as Hugging Face checkpoints do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from model import DEFAULT_CONFIG, checkpoint, init_weights  # noqa: E402


def make(path: str, cfg: dict = None, seed: int = 1) -> int:
    """Writes the checkpoint of TinyLM(cfg) seeded with seed at path;
    returns the bytes of its tensors."""
    from tensord.torch import save_safetensors

    cfg = dict(cfg or DEFAULT_CONFIG)
    sd = checkpoint(init_weights(cfg, seed))
    meta = {"format": "pt", "config": json.dumps(cfg, sort_keys=True),
            "seed": str(seed)}
    save_safetensors(sd, path, metadata=meta)
    return sum(t.numel() * t.element_size() for t in sd.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-o", "--out", default="model.safetensors")
    p.add_argument("--seed", type=int, default=1)
    for key, value in DEFAULT_CONFIG.items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=value,
                       dest=key)
    args = p.parse_args(argv)
    cfg = {k: getattr(args, k) for k in DEFAULT_CONFIG}
    nbytes = make(args.out, cfg, args.seed)
    print("%s: %.1f MB of weights, seed %d, %s"
          % (args.out, nbytes / 1e6, args.seed, json.dumps(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
