"""Where a collective's byte buffers live."""

from __future__ import annotations

import torch
import torch.distributed as dist


def wire_device(group=None) -> torch.device:
    """Where a collective's byte buffers live: the current GPU for NCCL, the host for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
