import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def script():
    """`script(turns)`: the next episodes' turns, forced (helpers.ScriptedBackend: the samplers the test
    builds with helpers.sampler / episode_sampler / backend_for sample them)."""
    import helpers

    yield helpers.scripted_turns()
    helpers.SCRIPT = None


@pytest.fixture(autouse=True)
def _close_environments():
    """The environments a test's episode samplers loaded (helpers.episode_sampler): their worker
    processes stopped after it."""
    yield
    import helpers

    while helpers.OPEN_ENVIRONMENTS:
        helpers.OPEN_ENVIRONMENTS.pop().close()


def pytest_collection_modifyitems(config, items):
    """tests/distributed/ spawns process groups: marked distributed and slow."""
    for item in items:
        if "distributed" in item.path.parts[-2:-1]:
            item.add_marker(pytest.mark.distributed)
            item.add_marker(pytest.mark.slow)
