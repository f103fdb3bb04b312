"""Every stage-7 test runs with the sampling spy of chunked_helpers: a request sampled before its
whole prompt has been computed fails the test at once, with that message, whatever the test was
looking at (the symptoms come later and point elsewhere)."""

from __future__ import annotations

import pytest

from chunked_helpers import sampling_spy


@pytest.fixture(autouse=True)
def no_sampling_mid_prefill(request):
    with sampling_spy(request.node.name):
        yield
