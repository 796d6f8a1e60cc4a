"""Importing orca_lab must not touch CUDA: a process that initialized the driver cannot fork children
that use CUDA, even though ``torch.cuda.is_initialized()`` still reads False (so it cannot serve as
the check). Here every function that initializes CUDA raises, then every module is imported."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[1])
# the checkout first, then whatever path the suite runs under (packages carried to a GPU machine)
PATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))

# Every torch.cuda entry point that initializes the driver, replaced by one that raises.
POISON = textwrap.dedent("""
    import torch, torch.cuda

    def poisoned(name):
        def f(*args, **kwargs):
            raise RuntimeError(f"torch.cuda.{name} called while importing orca_lab")
        return f

    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device",
                 "get_device_name", "get_device_properties", "get_device_capability", "mem_get_info",
                 "synchronize", "current_stream", "is_bf16_supported"):
        setattr(torch.cuda, name, poisoned(name))
    for name in ("_cuda_init", "_cuda_getDeviceCount"):
        if hasattr(torch._C, name):
            setattr(torch._C, name, poisoned(name))
""")

IMPORT_ALL = textwrap.dedent("""
    import importlib, pkgutil, orca_lab
    names = sorted(m.name for m in pkgutil.walk_packages(orca_lab.__path__, "orca_lab."))
    for name in names:
        importlib.import_module(name)
    assert "orca_lab.distributed.worker" in names and "orca_lab.torchrun" in names, names
    print(len(names))
""")


def run_python(code, **env):
    env = {k: v for k, v in dict(os.environ, **env).items() if v is not None}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)


def test_importing_every_module_calls_no_cuda_function():
    # TRITON_INTERPRET unset: the package makes its choice itself, without asking CUDA
    done = run_python(POISON + IMPORT_ALL + "import os; print(os.environ.get('TRITON_INTERPRET'))",
                      PYTHONPATH=PATH, TRITON_INTERPRET=None)
    assert done.returncode == 0, done.stderr[-3000:]
    n_modules, interpret = done.stdout.split()[-2:]
    assert int(n_modules) > 30                        # the walk really found the package
    from orca_lab.kernels._backend import gpu_visible
    assert interpret == ("None" if gpu_visible() else "1")    # the interpreter exactly where no GPU shows


def test_the_poison_catches_a_cuda_call():
    """The check above can fail: the same script with one CUDA call in it does."""
    done = run_python(POISON + "torch.cuda.is_available()")
    assert done.returncode != 0 and "torch.cuda.is_available called" in done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: forking after import is checked there")
def test_a_forked_child_of_a_process_that_imported_orca_lab_initializes_cuda():
    code = IMPORT_ALL + textwrap.dedent("""
        import os, torch
        pid = os.fork()
        if pid == 0:
            try:
                torch.cuda.init()
                x = torch.ones(4, device="cuda")
                os._exit(0 if float(x.sum()) == 4.0 else 2)
            except BaseException as e:
                print(e, flush=True)
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
    """)
    done = run_python(code, PYTHONPATH=PATH)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: workers over NCCL")
def test_workers_over_nccl_on_one_gpu_give_the_in_process_tokens_and_fail_fast():
    import signal
    import time

    from orca_lab import LLM, EngineConfig
    from orca_lab.distributed.pool import WorkerPool
    local = LLM("tiny", seed=2, engine=EngineConfig(device="cuda", n_slots=2048))
    llm = LLM("tiny", seed=2, engine=EngineConfig(device="cuda", n_slots=2048, executor="workers"))
    prompts = [[3, 4, 5], list(range(60, 90))]
    assert llm.generate(prompts, max_gen_tokens=6) == local.generate(prompts, max_gen_tokens=6)
    pool = WorkerPool(llm)
    os.kill(pool.pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 0 .*SIGKILL"):
        llm.generate(prompts, max_gen_tokens=6)
    assert time.monotonic() - t0 < 10
