"""How data crosses between host and device on the hot path: out in one copy
per fetch, in by ``upload`` (asynchronous host lists, e.g. indices).

A device-to-host read blocks until the device has caught up, and each costs
a round trip; a step that reads its drafts, tokens and logprobs one tensor
(or one request) at a time stalls the GPU dozens of times. ``HostStaging``
gathers everything one point of the step needs into one flat buffer and
copies it once, through a pinned host buffer that is kept and grown, not
allocated per step. An engine step fetches at most twice: the drafts (when
speculating), then the step's results. Hot-path code reads device tensors
only through here (a test scans for strays).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list (ids, rows, slots) as a tensor on ``device``, copied without
    waiting for it."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostStaging:
    """One pinned staging buffer for one device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffer: torch.Tensor | None = None  # [capacity] float64, pinned

    def fetch(self, tensors: Sequence[torch.Tensor | None]) -> list[list | None]:
        """``tensors`` as nested Python lists (None stays None), by one
        transfer. Values are carried as float64: exact for float32 values and
        for integers below 2**53 (token ids, lengths, counts)."""
        present = [t for t in tensors if t is not None]
        if not present:
            return [None] * len(tensors)
        if self.device.type == "cpu":  # already host memory: nothing to copy
            lists = [t.tolist() for t in present]
        else:
            flat = torch.cat([t.reshape(-1).to(torch.float64) for t in present])
            host = self._staging(flat.numel())
            host.copy_(flat, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            lists, at = [], 0
            for t in present:
                part = host[at : at + t.numel()].view(t.shape)
                at += t.numel()
                lists.append(part.to(t.dtype).tolist())
        out = iter(lists)
        return [next(out) if t is not None else None for t in tensors]

    def _staging(self, n: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < n:
            size = max(n, 2 * (self._buffer.numel() if self._buffer is not None else 4096))
            self._buffer = torch.empty(size, dtype=torch.float64, pin_memory=True)
        return self._buffer[:n]
