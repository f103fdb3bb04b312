"""The device policy every stage shares (s00 device.py; not graded: this code is given)."""

from __future__ import annotations

import pytest
import torch

from s00_foundation.device import avoid_cudnn_attention


@pytest.fixture
def cudnn_attention_on():
    """SDPA's cuDNN switch on for the test, and put back as it was after it."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_a_model_on_cuda_takes_cudnn_out_of_sdpa(cudnn_attention_on):
    avoid_cudnn_attention("cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled(), "a model on a CPU should leave SDPA's kernel choice alone"
    avoid_cudnn_attention(torch.device("cuda", 0))
    assert not torch.backends.cuda.cudnn_sdp_enabled(), (
        "a model on CUDA should take cuDNN out of SDPA's kernels: it builds a plan for every new shape "
        "(38-59 ms per decode step's new length on an H200)"
    )
