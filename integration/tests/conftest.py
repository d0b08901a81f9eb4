import dataclasses

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


@pytest.fixture
def micro_empty_block(micro):
    """``micro`` with empty histories allowed and one block-attention layer below a
    full one (block size 4)."""
    return dataclasses.replace(
        micro,
        data=dataclasses.replace(micro.data, min_seqlen=0, seqlen_scale=1.0),
        model=dataclasses.replace(
            micro.model, seq_layers=2, block_attention_layers=1, attn_block_size=4
        ),
    )
