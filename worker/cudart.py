"""The few CUDA calls the worker makes itself, through cuda-python's driver API, each return code checked.

Page-locked staging comes from `cuMemHostAlloc` rather than torch's caching host allocator: the workspace owns it
for the life of the process and knows exactly when a copy that reads it is done.

Why the driver API and not cuda-python's runtime module: on the H200 (2026-12-03, device runs 1-2), a worker
process that compiled the fast path's Triton kernels from a cold cache saw every later call of cuda-python's
runtime module fail with cudaErrorInvalidAddressSpace (cudaMemcpyAsync first, then even cudaHostAlloc), right
after `torch.cuda.synchronize()` had returned cleanly: the context was healthy, the runtime module's own state was
not. The driver calls below work on the context they are given and keep no state of their own.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

try:  # cuda-python >= 12.6 moved the bindings; older releases only have the flat module
    from cuda.bindings import driver as _drv
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    from cuda import cuda as _drv  # type: ignore[no-redef]


class CudaError(RuntimeError):
    """A CUDA driver call that did not return CUDA_SUCCESS."""

    def __init__(self, call: str, err):
        _, text = _drv.cuGetErrorString(err)
        name = getattr(err, "name", str(err))
        self.call, self.code = call, int(err)
        super().__init__(f"{call} failed: {name} ({text.decode() if isinstance(text, bytes) else text})")


def check(call: str, result):
    """Unwrap a cuda-python result tuple, raising `CudaError` unless it succeeded."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != _drv.CUresult.CUDA_SUCCESS:
        raise CudaError(call, err)
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


_bound = threading.local()


def bind(device: int = 0) -> None:
    """Make `device`'s primary context (torch's) current on this thread, once per thread.

    Driver calls act on the calling thread's current context; a worker's compute thread may reach an upload before
    it has made any torch CUDA call that would have set one."""
    if getattr(_bound, "device", None) == device:
        return
    check("cuInit", _drv.cuInit(0))
    dev = check("cuDeviceGet", _drv.cuDeviceGet(device))
    ctx = check("cuDevicePrimaryCtxRetain", _drv.cuDevicePrimaryCtxRetain(dev))
    check("cuCtxSetCurrent", _drv.cuCtxSetCurrent(ctx))
    _bound.device = device


class PinnedBuffer:
    """Page-locked host memory owned by one object, with a numpy view, freed exactly once."""

    def __init__(self, nbytes: int, device: int = 0):
        bind(device)
        self.nbytes = int(nbytes)
        self.ptr = int(check("cuMemHostAlloc", _drv.cuMemHostAlloc(self.nbytes, 0)))
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        self.bytes = np.ctypeslib.as_array(raw)

    def view(self, dtype, offset: int, count: int) -> np.ndarray:
        return self.bytes[offset: offset + count * np.dtype(dtype).itemsize].view(dtype)

    def close(self) -> None:
        if self.ptr:
            self.bytes = None
            check("cuMemFreeHost", _drv.cuMemFreeHost(self.ptr))
            self.ptr = 0

    def __del__(self):  # the process may exit without close(); freeing pinned pages is still polite
        try:
            self.close()
        except Exception:
            pass


def memcpy_async(dst: int, src: int, nbytes: int, to_device: bool, stream: int, device: int = 0) -> None:
    bind(device)
    if to_device:
        check("cuMemcpyHtoDAsync", _drv.cuMemcpyHtoDAsync(dst, src, nbytes, stream))
    else:
        check("cuMemcpyDtoHAsync", _drv.cuMemcpyDtoHAsync(dst, src, nbytes, stream))


def stream_synchronize(stream: int, device: int = 0) -> None:
    bind(device)
    check("cuStreamSynchronize", _drv.cuStreamSynchronize(stream))
