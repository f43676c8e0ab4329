"""A FastAPI server of TinyLM whose workers share one copy of the weights
through tensord, and swap in each new version between requests.

    gunicorn -k uvicorn.workers.UvicornWorker -w 4 --chdir examples/serve \\
        --bind 127.0.0.1:8000 app:app

Each worker, at start-up: attaches the model SERVE_NAME if tensord has it,
else loads SERVE_MODEL into tensord (load_safetensors: one worker loads, the
others wait and attach); builds TinyLM on the meta device and attaches it to
the shared tensors; and follows SERVE_NAME, so that a new version (``tensorctl
load NEW.safetensors --as NAME --force``) is built once per worker and used
from the next request on. A request takes ``follower.current`` once: it runs
on one version whatever is loaded meanwhile.

Environment:
  SERVE_MODEL    the checkpoint (default ./model.safetensors)
  SERVE_NAME     the model's name in tensord (default "tinylm")
  SERVE_SOCKET   tensord's socket (default: $TENSORD_SOCKET, libtensord's rule)
  SERVE_PRIVATE  "1": each worker reads SERVE_MODEL into memory of its own
                 with plain torch, no tensord (the baseline for memory)
  SERVE_THREADS  torch threads per worker (default 1: workers are processes)
  SERVE_TOPK     logits returned per prediction (default 5)
  SERVE_CONNECT_WAIT  seconds a starting worker waits for tensord to listen
                 (default 30; past it the worker fails, and gunicorn stops)

See docs/serving.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import List, Optional

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from model import TinyLM, check_tokens, config_from, load_private, predict  # noqa: E402

MODEL = os.environ.get("SERVE_MODEL", "model.safetensors")
NAME = os.environ.get("SERVE_NAME", "tinylm")
SOCKET = os.environ.get("SERVE_SOCKET") or None
PRIVATE = os.environ.get("SERVE_PRIVATE", "") == "1"
THREADS = int(os.environ.get("SERVE_THREADS", "1"))
TOPK = int(os.environ.get("SERVE_TOPK", "5"))
CONNECT_WAIT = float(os.environ.get("SERVE_CONNECT_WAIT", "30"))

log = logging.getLogger("serve")
app = FastAPI(title="TinyLM over tensord")


class Served:
    """What serves one version: the module and where it came from."""

    def __init__(self, model: TinyLM, version: int) -> None:
        self.model = model
        self.cfg = model.cfg
        self.version = version


class _State:
    client = None  # tensord.Client
    follower = None  # tensord.torch.Follower
    private: Optional[Served] = None


state = _State()


def build(weights) -> Served:
    """follow's callback: TinyLM on meta, attached to one version's shared
    tensors. Runs once per version per worker (at start-up, then in the
    follower's thread); the module is never changed after."""
    import tensord.torch as tdt

    model = TinyLM(config_from(weights.metadata), device="meta")
    tdt.attach(model, weights)  # the tied head is bound from tok.weight
    return Served(model.eval(), weights.version)


def current() -> Served:
    """The version this request runs on, taken once."""
    if state.private is not None:
        return state.private
    served = state.follower.current if state.follower else None
    if served is None:
        raise HTTPException(503, "no model yet")
    return served


def connect(tensord):
    """A connection to tensord, waiting up to SERVE_CONNECT_WAIT seconds
    for one to listen: a worker that fails its start-up makes gunicorn's
    master stop the whole server ("Worker failed to boot"), so a worker
    restarted while tensord restarts waits for it instead."""
    deadline = time.monotonic() + CONNECT_WAIT
    while True:
        try:
            return tensord.connect(SOCKET, name="serve worker")
        except tensord.Error as e:
            if time.monotonic() >= deadline:
                raise
            log.warning("worker %d: %s; trying again", os.getpid(), e)
            time.sleep(1.0)


@app.on_event("startup")
def startup() -> None:
    torch.set_num_threads(THREADS)
    if PRIVATE:
        state.private = Served(load_private(MODEL), 0)
        log.info("worker %d: %s read privately", os.getpid(), MODEL)
        return
    import tensord
    import tensord.torch as tdt

    state.client = connect(tensord)
    try:
        # The model tensord has now, whatever file it came from: a worker
        # that restarts after a swap serves the new version, and does not
        # load SERVE_MODEL over it.
        state.follower = tdt.follow(NAME, build, client=state.client)
    except tensord.NotFound:
        # Not loaded yet: the first worker loads, the others wait for it.
        tdt.load_safetensors(MODEL, name=NAME, client=state.client)
        state.follower = tdt.follow(NAME, build, client=state.client)
    log.info("worker %d: %s version %d", os.getpid(), NAME,
             state.follower.version)


@app.on_event("shutdown")
def shutdown() -> None:
    if state.follower is not None:
        state.follower.close()
        state.follower = None
    if state.client is not None:
        state.client.close()
        state.client = None
    state.private = None


class PredictRequest(BaseModel):
    tokens: List[int]


@app.post("/predict")
def predict_next(req: PredictRequest) -> dict:
    """The next token after req.tokens, and the top SERVE_TOPK logits.
    (A plain def: FastAPI runs it in its thread pool, off the event loop.)"""
    served = current()
    try:
        check_tokens(served.cfg, req.tokens)
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    token, top = predict(served.model, req.tokens, TOPK)
    return {
        "version": served.version,
        "pid": os.getpid(),
        "next_token": token,
        "top_k": [{"token": t, "logit": v} for t, v in top],
    }


@app.get("/health")
def health() -> dict:
    served = current()
    return {"pid": os.getpid(), "name": NAME, "version": served.version,
            "private": PRIVATE}
