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


def hf_llama(folder, arch="LlamaForCausalLM", seed=0, max_shard_size=None, **shape):
    """A transformers ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` of tiny ``shape`` with seeded random
    weights (``0.2 * N(0, 1)``, norm gains ``1 + 0.1 * N(0, 1)``: wide enough that greedy tokens
    vary), saved to ``folder`` (sharded when ``max_shard_size`` is given): the reference model."""
    transformers = pytest.importorskip("transformers")
    config = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config}[arch]
    shape = {"hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256, **shape}
    torch.manual_seed(seed)
    hf = getattr(transformers, arch)(config(**shape)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.1).add_(1.0) if "norm" in name else p.normal_(0, 0.2)
    hf.save_pretrained(folder, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    return hf


def hf_greedy(hf, prompt, n):
    """transformers' greedy ``generate``: exactly ``n`` tokens after ``prompt``, EOS ignored."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def first_iteration_logits(llm, prompts):
    """The logits of each prompt's last token from one engine iteration prefilling them all together."""
    from orca_lab import SamplingParams
    engine = llm.new_engine()
    try:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_gen_tokens=1))
        batch = engine.scheduler.select()
        with torch.inference_mode():
            return llm.model(batch.tensors(llm.engine_config.device), engine.scheduler.kv)
    finally:
        engine.close()
