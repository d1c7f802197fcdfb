"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned_empty():
    """torch.empty returns NaN-filled memory for the duration of a test (deterministic mode's fill), so an
    output element a kernel fails to write cannot pass as a zero. Opt in with
    `pytestmark = pytest.mark.usefixtures("poisoned_empty")`."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[2]
