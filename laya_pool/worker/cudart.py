"""The few CUDA runtime calls the worker makes itself, through cuda-python, each return code checked.

Page-locked staging comes from `cudaHostAlloc` rather than torch's caching host allocator: the
workspace owns it for the life of the process and knows exactly when a copy that reads it is done.
"""
from __future__ import annotations

import ctypes

import numpy as np

try:  # cuda-python >= 12.6 moved the bindings; older releases only have the flat module
    from cuda.bindings import runtime as _rt
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    from cuda import cudart as _rt  # type: ignore[no-redef]


class CudaError(RuntimeError):
    """A CUDA runtime call that did not return cudaSuccess."""

    def __init__(self, call: str, err):
        _, text = _rt.cudaGetErrorString(err)
        name = getattr(err, "name", str(err))
        self.call, self.code = call, int(err)
        super().__init__(f"{call} failed: {name} ({text.decode() if isinstance(text, bytes) else text})")


# Errors that leave the context unusable: every later call in this process fails with them (CUDA's "sticky" errors,
# a kernel's fault or the hardware's). A worker that meets one must leave, not retry.
STICKY = ("cudaErrorIllegalAddress", "cudaErrorLaunchTimeout", "cudaErrorAssert", "cudaErrorHardwareStackError",
          "cudaErrorIllegalInstruction", "cudaErrorMisalignedAddress", "cudaErrorInvalidAddressSpace",
          "cudaErrorInvalidPc", "cudaErrorLaunchFailure", "cudaErrorECCUncorrectable")


def is_sticky(code: int) -> bool:
    """Whether a CUDA runtime error code poisons the context (see STICKY)."""
    return any(int(getattr(_rt.cudaError_t, name, -1)) == int(code) for name in STICKY)


def check(call: str, result):
    """Unwrap a cuda-python result tuple, raising `CudaError` unless it succeeded."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != _rt.cudaError_t.cudaSuccess:
        raise CudaError(call, err)
    return rest[0] if len(rest) == 1 else tuple(rest)


class PinnedBuffer:
    """Page-locked host memory owned by one object, with a numpy view, freed exactly once."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.ptr = int(check("cudaHostAlloc", _rt.cudaHostAlloc(self.nbytes, _rt.cudaHostAllocDefault)))
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        self.bytes = np.ctypeslib.as_array(raw)

    def view(self, dtype, offset: int, count: int) -> np.ndarray:
        return self.bytes[offset: offset + count * np.dtype(dtype).itemsize].view(dtype)

    def close(self) -> None:
        if self.ptr:
            self.bytes = None
            check("cudaFreeHost", _rt.cudaFreeHost(self.ptr))
            self.ptr = 0

    def __del__(self):  # the process may exit without close(); freeing pinned pages is still polite
        try:
            self.close()
        except Exception:
            pass


def memcpy_async(dst: int, src: int, nbytes: int, to_device: bool, stream: int) -> None:
    kind = _rt.cudaMemcpyKind.cudaMemcpyHostToDevice if to_device else _rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    check("cudaMemcpyAsync", _rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream))


def graph_exec(raw: int) -> object:
    """A captured graph's cudaGraphExec_t (torch's `CUDAGraph.raw_cuda_graph_exec()`), wrapped once for
    `graph_launch`; it lives as long as the torch graph that owns it."""
    return _rt.cudaGraphExec_t(init_value=raw)


def graph_launch(exec_: object, stream: int) -> None:
    check("cudaGraphLaunch", _rt.cudaGraphLaunch(exec_, stream))


def stream_synchronize(stream: int) -> None:
    check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(stream))


class Event:
    """A CUDA event without timing, recorded on a stream: `done()` asks without waiting, `wait()` blocks the
    calling thread (cuda-python drops the GIL there, so the I/O thread keeps running)."""

    def __init__(self):
        self.handle = check("cudaEventCreateWithFlags",
                            _rt.cudaEventCreateWithFlags(_rt.cudaEventDisableTiming))

    def record(self, stream: int) -> None:
        check("cudaEventRecord", _rt.cudaEventRecord(self.handle, stream))

    def done(self) -> bool:
        result = _rt.cudaEventQuery(self.handle)
        err = result[0] if isinstance(result, tuple) else result
        if err == _rt.cudaError_t.cudaErrorNotReady:
            return False
        check("cudaEventQuery", result)
        return True

    def wait(self) -> None:
        check("cudaEventSynchronize", _rt.cudaEventSynchronize(self.handle))

    def close(self) -> None:
        if self.handle is not None:
            check("cudaEventDestroy", _rt.cudaEventDestroy(self.handle))
            self.handle = None
