"""The hardware and library versions recorded with every result that leaves the process.

It sits at the bottom of the layers (beside config.py) so kernels, the simulator and the CLI all
record the same fields.
"""
import os
import platform
import time

import torch


def environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpu_count": cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def cpu_count() -> int:
    """The cores this process may run on (a container's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
