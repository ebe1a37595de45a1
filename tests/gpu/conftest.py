"""The GPU suite: each fix on vLLM's own code under real CUDA graphs.

Run by `make gpu-test` on a CUDA machine, once per packed tree and state (see
tests/gpu/run.sh). Anywhere else every case is skipped with the reason printed.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def cuda_device() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("GPU suite: no CUDA device here; run `make gpu-test` on a GPU machine")
