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
    """`device` as a `torch.device` (None: `default_device()`), a bare "cuda" with its index. A
    ValueError names a device the engine cannot run on: only "cpu" and "cuda[:N]", and CUDA only
    where torch sees that GPU."""
    try:
        dev = torch.device(device) if device is not None else default_device()
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: use cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device (torch {torch.__version__})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


def synchronize(device: torch.device) -> None:
    """Return once every kernel queued on `device` has finished (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
