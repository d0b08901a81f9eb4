import pytest
import torch

from hyperrec.integration import SyntheticRecsysData, get_preset


@pytest.fixture(autouse=True)
def _one_thread():
    # Bitwise-reproducibility tests compare runs made in one process; pin the thread
    # count so reductions are ordered identically whatever the machine.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def micro():
    return get_preset("micro")


@pytest.fixture
def micro_data(micro):
    return SyntheticRecsysData(micro.data)
