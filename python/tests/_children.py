"""Code that runs in child processes of the tests (spawned, so importable)."""

import tensord


def spawn_child(sock: str, key_in: str, key_out: str) -> None:
    """Connects by path, checks and rewrites the parent's tensor in place,
    publishes one of its own."""
    with tensord.connect(sock) as c:
        t = c.lookup(key_in, timeout=5)
        a = t.numpy()
        if a.tolist() != list(range(8)):
            raise SystemExit(f"child saw {a.tolist()}")
        a *= 10  # the parent must see it: same pages
        mine = c.share(b"from the spawned child")
        c.publish(key_out, mine)
        mine.release()
        del a
        t.release()


def _shared_weights_example():
    """docs/examples/shared_weights.py, imported as a module."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                        "docs", "examples", "shared_weights.py")
    spec = importlib.util.spec_from_file_location("shared_weights", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def serve_weights(conn, sock: str, key: str, sizes: dict, how: str) -> None:
    """A server of test_torch_state's memory test: says "ready" once torch has
    run a forward pass of a tiny Net (so that what torch allocates at its
    first call is in the baseline the parent reads then), and on "go" builds
    the example's Net (how: "meta", the example's server_model; or
    "load_state_dict", a CPU Net that loads the weights into its own),
    loads the state dict under key, runs one forward pass and sends back
    the logits; on "quit" exits."""
    import torch
    import tensord.torch as tdt

    ex = _shared_weights_example()
    torch.manual_seed(1)
    tokens = torch.randint(0, sizes["vocab"], (1, 4))
    tiny = ex.Net(vocab=16, width=8).eval()
    ex.run(ex.server_model(vocab=16, width=8), tiny.state_dict(), tokens % 16)
    with tensord.connect(sock) as client:
        conn.send("ready")
        assert conn.recv() == "go"
        if how == "meta":
            model = ex.server_model(**sizes)
        else:
            model = ex.Net(**sizes).eval()
        weights = tdt.load_state_dict(client, key)
        if how == "load_state_dict":
            model.load_state_dict(weights)  # copies into model's own
            with torch.no_grad():
                logits = model(tokens)
        else:
            logits = ex.run(model, weights, tokens)
        conn.send((tokens, logits))
        assert conn.recv() == "quit"
        del weights, model
