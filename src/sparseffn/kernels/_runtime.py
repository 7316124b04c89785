"""Launch-time facts the kernel launchers share."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: launchers call this on every launch)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
