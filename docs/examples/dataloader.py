#!/usr/bin/env python3
"""Trains a tiny classifier with tensord's DataLoader.

Two worker processes collate batches straight into tensord storages and hand
the training process only references; a batch the training loop drops goes
back to the daemon, which recycles its pages for a later batch. Apart from
the import, this is the usual PyTorch loop.

Run against a daemon (tensord --socket PATH) with TENSORD_SOCKET=PATH:
    PYTHONPATH=build/python /usr/bin/python3 docs/examples/dataloader.py
"""

import torch
import torch.utils.data

import tensord
import tensord.torch as tdt


class Blobs(torch.utils.data.Dataset):
    """Three Gaussian blobs in 16 dimensions; sample i is always the same."""

    def __init__(self, n: int) -> None:
        self.n = n
        g = torch.Generator().manual_seed(0)
        self.centres = torch.randn(3, 16, generator=g) * 2

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        label = i % 3
        x = self.centres[label] + torch.randn(16, generator=g)
        return {"x": x, "label": label}


def main() -> None:
    torch.manual_seed(0)
    client = tensord.connect()  # $TENSORD_SOCKET, else the default socket
    train = tdt.DataLoader(
        Blobs(3000), batch_size=100, shuffle=True, num_workers=2, client=client
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        total = 0.0
        for batch in train:  # batch["x"]: float32[100, 16] in a tensord storage
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        print("epoch %d: loss %.3f" % (epoch, total / len(train)))

    test = tdt.DataLoader(Blobs(600), batch_size=200, client=client)  # in-process
    right = 0
    with torch.no_grad():
        for batch in test:
            right += int((model(batch["x"]).argmax(1) == batch["label"]).sum())
    print("accuracy %.3f" % (right / 600))
    stat = client.stat()
    print("daemon: %d storages, pool %s" % (stat["storages"], stat.get("pool")))
    client.close()


if __name__ == "__main__":
    main()
