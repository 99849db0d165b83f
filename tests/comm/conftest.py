"""The one-rank communicator the comm tests call."""

import pytest

from mpitrain.comm.single import SingleCommunicator


@pytest.fixture
def comm():
    return SingleCommunicator()
