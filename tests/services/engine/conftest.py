from __future__ import annotations

import pytest
import torch

from tests.services.engine.helpers import write_pair


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """(target folder, drafter folder) of the random pair, window 8."""
    return write_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: intra-op threads only add synchronisation (and spin badly on a
    loaded machine). Restored afterwards for the rest of the session."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
