"""The suite's own leak check (conftest.Daemon.segments, judged as each
module's tensord stops) sees every segment a daemon can leave."""
import os


def test_a_pooled_segment_counts_as_left(tensord_daemon):
    inst = f"{tensord_daemon.instance:016x}"
    path = f"/dev/shm/tensord.{inst}-pool.999999999"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    try:
        assert path in tensord_daemon.segments()
    finally:
        os.unlink(path)
    assert path not in tensord_daemon.segments()
