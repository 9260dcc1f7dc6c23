"""Which device the engine runs on, named one way.

`default_device()` is CUDA when torch sees a GPU, else the CPU. `resolve_device` turns a name into
the `torch.device` that the engine's tensors report: a bare "cuda" becomes the current CUDA
device ("cuda:0"), so the model, its KV cache and their tensors compare equal whichever spelling
a caller used. `synchronize` waits for the device's queued work: CUDA kernels run asynchronously,
so a host clock read right after a launch would time the launch, not the work.
"""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """`device` as a `torch.device` (None: `default_device()`), a bare "cuda" with its index."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def synchronize(device: torch.device) -> None:
    """Return once every kernel queued on `device` has finished (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
