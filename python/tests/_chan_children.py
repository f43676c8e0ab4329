"""Code that test_channel.py runs in spawned processes (importable there)."""

import torch

import tensord


def produce(sock: str, name: str, n: int) -> None:
    """Sends n slots; slot i begins with the int32s i, i + 1, i + 2."""
    with tensord.connect(sock) as c, c.channel(name, side="send", timeout=30) as ch:
        for i in range(n):
            s = ch.loan(timeout=30)
            x = s.torch().view(torch.int32)
            x[:3] = torch.arange(i, i + 3, dtype=torch.int32)
            ch.send(x, timeout=30)  # the torch view: the slot goes with it
