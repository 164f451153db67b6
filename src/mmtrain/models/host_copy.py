"""Host values on the device without the host waiting for it.

A forward computes a few index tensors on the host from what the host already knows (a
native VLM's image sizes decide its attention layout and grids; a clip's frame rate its time
step). `tensor.to("cuda")` from ordinary (pageable) memory blocks the host until the stream has
run everything queued before the copy: a device sync in the middle of the forward. From
page-locked memory with `non_blocking=True` the copy is queued on the stream like a kernel and
the host goes on; torch's caching host allocator keeps the pinned block until the copy is done.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host` (a tensor on the CPU) on `device`, queued on the current stream: pinned first on
    CUDA; on the CPU, `host` itself."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
