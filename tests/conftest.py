import os

import pytest

# Without a GPU, Triton runs kernels only through its interpreter, which must be chosen before any
# @triton.jit; with one, the kernels are compiled and run on it (tests/helpers.py: DEVICE).
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass
# Each test process times its own launch tiles: none recalls a choice an earlier run left on disk
# (the tests of that store point it at a folder of their own).
os.environ["ORCA_LAB_TUNING_CACHE"] = "0"


@pytest.fixture(scope="session", autouse=True)
def learners_package(tmp_path_factory):
    """Where the exercises of notebooks a test executes are saved (``mine.home()``, inherited by their
    kernels): never the learner's own package, in notebooks/my_orca or where they pointed it."""
    os.environ["ORCA_LAB_MY_ORCA"] = str(tmp_path_factory.mktemp("my_orca"))


@pytest.fixture(scope="session")
def tiny_llm():
    """The tiny preset on the CPU, fp32 (test_engine.py and test_model.py put a copy on ``helpers.DEVICE``)."""
    from orca_lab import LLM, EngineConfig
    return LLM("tiny", seed=1, engine=EngineConfig(max_bs=4, n_slots=4096))


@pytest.fixture(scope="module")
def one_thread():
    """Small ops on a shared 2-core machine: one intra-op thread (see ``model/executor.py``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
