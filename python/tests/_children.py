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
