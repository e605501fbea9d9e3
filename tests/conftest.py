import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def script(monkeypatch):
    """`script(turns)`: the next episodes' turns, forced (see agent_helpers.scripted_turns)."""
    from agent_helpers import scripted_turns

    return scripted_turns(monkeypatch)
