"""UploadGroup: every host-to-device copy of one request, submitted together on the worker's stream.

No synchronisation per copy: the compute is queued on the same stream after the group, so the stream
orders it (and orders the copies after the previous group's compute, which reads the same device mirror),
and the wait on the group's done event after its readback is the only host wait per group. If a
submission fails part-way, the copies already queued may still be reading the pinned staging slot, so
the group drains the stream before raising; only then may the slot be rewritten.
"""
from __future__ import annotations

from collections.abc import Callable

from .cudart import CudaError, is_sticky, memcpy_async, stream_synchronize
from .workspace import Workspace

# A device address no allocation can have: a copy to it fails inside the real cudaMemcpyAsync.
_INVALID_DEVICE_POINTER = 0x8


class UploadError(RuntimeError):
    """A copy of the group could not be submitted; the group was drained first. `sticky`: the CUDA error poisons the
    context (an earlier kernel faulted), so nothing more can run in this process."""

    def __init__(self, message: str, sticky: bool = False):
        super().__init__(message)
        self.sticky = sticky


class UploadGroup:
    def __init__(self, workspace: Workspace, stream: int):
        self.ws, self.stream = workspace, stream
        # Test hook: given the index of the copy about to be submitted, return True to aim it at an
        # invalid device pointer. The failure then comes from CUDA itself, on the real path.
        self.fault: Callable[[int], bool] | None = None
        self.submitted = 0
        self.drains = 0
        self.last_drained_after: int | None = None

    def submit(self, spans: list[tuple[int, int]], slot: int = 0) -> None:
        """Queue the copies of `spans` from slot `slot`'s pinned inputs into the device mirror."""
        host, dev = self.ws.slots[slot].host_in.ctypes.data, self.ws.dev_in.data_ptr()
        done = 0
        try:
            for offset, count in spans:
                if count == 0:
                    continue
                dst = dev + 4 * offset
                if self.fault is not None and self.fault(done):
                    dst = _INVALID_DEVICE_POINTER
                memcpy_async(dst, host + 4 * offset, 4 * count, True, self.stream)
                done += 1
        except CudaError as e:
            if done:
                stream_synchronize(self.stream)
                self.drains += 1
            self.last_drained_after = done
            raise UploadError(f"upload failed after {done} of {len(spans)} copies were submitted "
                              f"(drained before the staging is reused): {e}", is_sticky(e.code)) from e
        self.submitted += done
