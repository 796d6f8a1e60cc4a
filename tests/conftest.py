import os

import pytest

# Triton runs kernels on CPU only through its interpreter, which must be chosen before any @triton.jit.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


@pytest.fixture(scope="session")
def tiny_llm():
    from orca_lab import LLM, EngineConfig
    return LLM("tiny", seed=1, engine=EngineConfig(max_bs=4, n_slots=4096))
