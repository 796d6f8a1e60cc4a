"""Small shared pieces of the tests, and the device they run on.

``DEVICE`` is the GPU where CUDA exists, else the CPU, where the Triton kernels run in Triton's
interpreter (``conftest.py`` turns it on). The same ``pytest`` command then tests the kernels and the
engine for real on a GPU machine and through the interpreter here; a test that only means something
on a GPU is marked ``needs_gpu`` and skips here, saying so.
"""
import random

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (scripts/gpu_check.sh runs it there)")


def engine_config(**kw):
    """An ``EngineConfig`` on the test device (``LLM(gpt=model, ...)`` moves the model there)."""
    from orca_lab import EngineConfig
    return EngineConfig(**{"device": str(DEVICE), **kw})


def on_device(llm):
    """``llm`` itself on the CPU; on a GPU machine a copy of its model there (``LLM(gpt=...)`` moves
    the module it is given, so the CPU original stays for the tests that share it)."""
    if not ON_GPU:
        return llm
    import copy
    from orca_lab import LLM
    return LLM(gpt=copy.deepcopy(llm.model), engine=llm.engine_config.replace(device=str(DEVICE)))


def random_prompts(n, vocab, lo=1, hi=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_log_softmax(llm, folder):
    """``ids -> [len(ids), vocab]``: ``log_softmax`` of transformers' GPT-2 logits for a whole sequence,
    fp32, on ``llm``'s weights saved to ``folder``: a reference computed apart from the engine."""
    transformers = pytest.importorskip("transformers")
    llm.save_pretrained(folder)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval().float()

    def logprobs(ids):
        with torch.inference_mode():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs


def execute_notebook(*args, **kwargs):
    """``papermill.execute_notebook``, tried again when the kernel died before it answered:
    jupyter_client picks the kernel's TCP ports, closes them and lets the kernel bind them, and on a
    busy host another process can take one in between ("Address already in use", seen in a
    fresh-clone CI run beside two CPU hogs)."""
    import papermill as pm
    for attempt in range(3):
        try:
            return pm.execute_notebook(*args, **kwargs)
        except RuntimeError as e:
            if "Kernel died before replying to kernel_info" not in str(e) or attempt == 2:
                raise
