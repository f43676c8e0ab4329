"""A state dict of torch CUDA tensors, published by one process and loaded
by another, on a real GPU (ctest label gpu; tests/gpu/run.sh).

publish_state_dict keeps each CUDA storage on its GPU (a daemon-owned
storage per region); load_state_dict in a second process returns CUDA
tensors over that same memory: a write through a writable lookup of the
region in the first process is seen by the second. Exits 77 (skipped) where
torch has no CUDA, there is no GPU, or $TENSORD_CUDA_DRIVER names the test
double; 1 on a failure. Needs $TENSORD_BIN and the tensord package on
PYTHONPATH (ctest sets both)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77


def skip(why):
    print("test_state_dict_gpu: skipped: %s" % why)
    sys.exit(SKIP)


CHILD = r"""
import sys, torch, tensord, tensord.torch as tdt
c = tensord.connect(sys.argv[1])
sd = tdt.load_state_dict(c, "sd")
w, tied, b, cpu = sd["w"], sd["tied"], sd["b"], sd["cpu"]
assert w.is_cuda and b.is_cuda and not cpu.is_cuda, (w.device, b.device, cpu.device)
assert w.device == torch.device("cuda:0")
assert tied.data_ptr() == w.t().data_ptr() and tied.stride() == (1, 64)
print("SUMS", float(w.double().sum()), float(b.double().sum()),
      float(cpu.double().sum()), sd.version, flush=True)
sys.stdin.readline()                      # the parent wrote through the region
torch.cuda.synchronize()
print("AFTER", float(w.double().sum()), flush=True)
sys.stdin.readline()
"""


def main():
    if os.environ.get("TENSORD_CUDA_DRIVER"):
        skip("TENSORD_CUDA_DRIVER names a stand-in, not the driver")
    try:
        import torch
    except ImportError:
        skip("no torch")
    if not torch.cuda.is_available():
        skip("torch %s has no CUDA, or there is no GPU" % torch.__version__)
    import tensord
    import tensord.torch as tdt

    d = tempfile.mkdtemp(prefix="tensord-gpu-sd.")
    sock = os.path.join(d, "tensord.sock")
    daemon = subprocess.Popen([os.environ["TENSORD_BIN"], "--socket", sock],
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    child = None
    try:
        for _ in range(1000):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(sock)
                break
            except OSError:
                time.sleep(0.01)
            finally:
                s.close()
        c = tensord.connect(sock)
        w = torch.randn(64, 32, device="cuda:0")
        b = torch.arange(10, dtype=torch.int64, device="cuda:0")
        cpu = torch.ones(5)
        v = tdt.publish_state_dict(
            c, "sd", {"w": w, "tied": w.t(), "b": b, "cpu": cpu})
        gpu = [s for s in c.ls() if s["device"] == "cuda"]
        assert len(gpu) == 2, gpu  # one storage per CUDA region
        child = subprocess.Popen([sys.executable, "-c", CHILD, sock],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        line = child.stdout.readline().split()
        assert line[0] == "SUMS", line
        assert abs(float(line[1]) - float(w.double().sum())) < 1e-3, line
        assert float(line[2]) == 45.0 and float(line[3]) == 5.0, line
        assert int(line[4]) == v, line
        # The same memory: a write through a writable lookup of w's region.
        t = c.lookup("sd", timeout=0)
        key = tdt._read_manifest(t)["regions"][0]["key"]
        t.release()
        r = c.lookup(key, timeout=0)
        rt = r.torch()
        rt[: w.numel() * 4].view(torch.float32).fill_(1.0)
        torch.cuda.synchronize()
        child.stdin.write("\n")
        child.stdin.flush()
        line = child.stdout.readline().split()
        assert line == ["AFTER", str(float(w.numel()))], line
        # In this process too, and after a new version the old goes.
        mine = tdt.load_state_dict(c, "sd")
        assert float(mine["w"].sum()) == w.numel()
        del rt, mine
        r.release()
        v2 = tdt.publish_state_dict(c, "sd", {"w": w})
        assert v2 > v
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(60) == 0
        child = None
        for _ in range(200):
            left = [s for s in c.ls() if s["device"] == "cuda"]
            if len(left) == 1:
                break
            time.sleep(0.01)
        assert len(left) == 1 and left[0]["keys"] == ["sd@%d/r0" % v2], left
        c.close()
        print("test_state_dict_gpu: ok")
    finally:
        if child is not None:
            child.kill()
            child.wait()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
