"""The package imports and round-trips one tensor."""

import numpy as np

import tensord


def test_empty_publish_lookup(client):
    t = client.empty((4, 3), "float32")
    t.numpy()[:] = np.arange(12, dtype=np.float32).reshape(4, 3)
    client.publish("smoke", t)
    u = client.lookup("smoke", timeout=0)
    assert u.storage_id == t.storage_id
    assert (u.numpy() == np.arange(12).reshape(4, 3)).all()
    client.unpublish("smoke")
    assert isinstance(u, tensord.Tensor)
