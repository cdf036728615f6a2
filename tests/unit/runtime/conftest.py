"""Fixtures of the runtime's unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def no_default_group() -> Iterator[None]:
    """The test starts and ends with no default process group in this process."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
