"""On CUDA the K/V pool is sized from the GPU's free memory after the weights, unless n_slots is given;
a model that cannot fit is refused before anything is allocated. Free memory is mocked here."""
import pytest

from orca_lab import LLM, EngineConfig
from orca_lab.config import PRESETS
from orca_lab.llm import kv_slots_on_gpu

GiB = 1 << 30


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device that reports ``gpu.free`` of ``gpu.total`` bytes (no CUDA call is made)."""
    class Fake:
        free, total = 10 * GiB, 16 * GiB
    monkeypatch.setattr("orca_lab.model.kv_sizing.gpu_memory", lambda device: (Fake.free, Fake.total))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    return Fake


def test_cpu_keeps_16384_slots_and_cuda_defaults_to_auto():
    assert EngineConfig().n_slots == 16384
    assert EngineConfig(device="cuda").n_slots is None
    assert EngineConfig(device="cuda", n_slots=512).n_slots == 512
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 is out of range"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_auto_slots_fill_the_free_memory_after_the_weights(gpu):
    cfg = PRESETS["gpt2"]
    ec = EngineConfig(device="cuda", dtype="float16")
    budget = gpu.free - 1_717_986_919           # 10% of 16 GiB kept back, rounded up
    expected = (budget - 2 * cfg.n_params) // cfg.kv_bytes_per_token(2)
    expected -= expected % ec.block_size          # whole blocks, so paged and chunked take the same pool
    assert kv_slots_on_gpu(cfg, ec) == expected
    assert kv_slots_on_gpu(cfg, ec.replace(n_slots=1000)) == 1000
    # with 2 x 2 workers each rank holds a quarter of the matrices and of each slot: more slots fit
    assert kv_slots_on_gpu(cfg, ec.replace(tensor_parallel=2, pipeline_parallel=2)) > 3 * expected


def test_a_model_that_cannot_fit_is_refused_before_any_allocation(gpu):
    gpu.free = 20 * GiB
    # gpt3-13b in fp16 is 26 GB of weights: refused with bytes needed against bytes available. Were
    # anything allocated first, this CPU-only torch would fail with another error.
    with pytest.raises(ValueError, match=r"gpt3-13b in float16 .* does not fit on cuda: it needs [\d,]+ bytes "
                                         r"\([\d,]+ of weights \+ [\d,]+ of K/V for n_slots=2048\) but "
                                         r"19,756,849,561 bytes are available \(21,474,836,480 free"):
        LLM("gpt3-13b", engine=EngineConfig(device="cuda", dtype="float16"))
    with pytest.raises(ValueError, match=r"for n_slots=4000000\) but"):        # a given n_slots too
        kv_slots_on_gpu(PRESETS["gpt2"], EngineConfig(device="cuda", n_slots=4_000_000))
    # split over 8 GPUs, each holds an eighth: it fits
    assert kv_slots_on_gpu(PRESETS["gpt3-13b"], EngineConfig(device="cuda", dtype="float16", tensor_parallel=8)) > 2048


def test_a_model_too_big_for_the_hosts_memory_is_refused_before_any_allocation(monkeypatch):
    """On the CPU the host's available memory is the bound: weights and K/V of every rank on it (a
    175B model otherwise grew until the OOM killer stopped it). Where the host does not say, no check."""
    cfg = PRESETS["gpt2"]
    need = 4 * cfg.n_params + 16384 * cfg.kv_bytes_per_token(4)
    monkeypatch.setattr("orca_lab.model.kv_sizing.host_memory", lambda: need // 2)
    with pytest.raises(ValueError, match=r"gpt2 in float32 .* does not fit in this host's memory: it needs "
                                         r"[\d,]+ bytes of weights and K/V \(n_slots=16384\) but [\d,]+ bytes"):
        LLM("gpt2")
    with pytest.raises(ValueError, match=r"tensor_parallel x pipeline_parallel = 2 x 1\) does not fit"):
        LLM("gpt2", engine=EngineConfig(tensor_parallel=2, n_slots=16384))   # two ranks, each a half: the whole
    monkeypatch.setattr("orca_lab.model.kv_sizing.host_memory", lambda: 2 * need)
    assert LLM("gpt2", engine=EngineConfig(n_slots=64)).cfg.name == "gpt2"
    monkeypatch.setattr("orca_lab.model.kv_sizing.host_memory", lambda: None)
    assert LLM("gpt2", engine=EngineConfig(n_slots=64)).cfg.name == "gpt2"


def test_a_worker_that_fails_at_start_up_names_its_error(tiny_llm, monkeypatch):
    """Start-up errors come before a worker's report channel exists: the master reads them from the
    store when it sees the process exit."""
    from orca_lab.distributed.pool import WorkerPool
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=256, pipeline_parallel=2))
    monkeypatch.setattr(WorkerPool, "_weights_for_workers", lambda self, llm: ("/nonexistent/weights.pt", 0))
    with pytest.raises(RuntimeError, match=r"worker rank \d .* exited with code 1: FileNotFoundError: .*/nonexistent"):
        WorkerPool(llm, attach=False)
