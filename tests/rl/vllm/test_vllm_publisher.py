"""The weight publisher's files without vLLM (rl/vllm/publisher.py), with a stand-in server: a run keeps
at most one copy of its weights in RUN_DIR/vllm/ while it goes on and none after it, so that
`train.keep_checkpoints` alone bounds what it leaves on disk (issue 32)."""

import os
import sys

import pytest
import torch
from helpers import tiny

from backstream.rl.vllm.publisher import WeightPublisher
from backstream.rl.vllm.server import VLLMConfig


class StandIn:
    """A server that takes every request: what is tested is the publisher's side."""

    url, proc = "http://127.0.0.1:9", None

    def __init__(self):
        self.posts, self.stopped = [], False

    def post(self, route, body=None):
        self.posts.append(route)
        return {"success": True} if route == "/reset_prefix_cache" else {}

    def stop(self):
        self.stopped = True


def _step(model):
    with torch.no_grad():  # an "optimizer step": in place, so the weights' versions change
        next(model.parameters()).add_(0.01)


@pytest.mark.parametrize("url", ["", "http://127.0.0.1:9"])
def test_published_weights_leave_with_the_run(tmp_path, url):
    """Started by the run: `initial/` goes once the server has loaded it; each publish replaces the
    last; `close` leaves no weights behind (nor does it with a server of the user's, `vllm.url`,
    which loaded them and needs them no more)."""
    server = StandIn()  # started by the run, or the one at vllm.url (checked, connected)
    model, tok = tiny(torch.float32)
    model.save_pretrained(tmp_path / "model")
    model = type(model).from_pretrained(tmp_path / "model").eval()  # as a run loads it
    run = tmp_path / "run"
    pub = WeightPublisher(VLLMConfig(python=sys.executable, url=url), tok, str(run), seed=0, server=server)
    folder = run / "vllm"
    pub.ensure(model)
    assert sorted(os.listdir(folder)) == (["weights-1"] if url else [])  # the user's server: ours published
    _step(model)
    pub.ensure(model)
    assert sorted(os.listdir(folder)) == ["weights-2" if url else "weights-1"]
    assert "/collective_rpc" in server.posts
    pub.close()
    assert not folder.exists()
    assert server.stopped
