"""Landing watch: one thread that waits for launched groups to land and tells the compute thread through its queue.

With a group computing, the compute thread must wake for whichever comes first: a new request (to admit it and
launch the next group while the device is busy) or the group's answers landing in host memory. It cannot block
on both a queue and a CUDA event, and polling costs 100-200 us a wake (`queue.get(timeout=...)` sleeps with the
kernel's timer slack). So this thread blocks on each group's done event in launch order (cuda-python drops the GIL
there) and then puts a `Landed` on the compute queue, which wakes the compute thread at once, the same way a
request does.

The watched group's event belongs to this thread from `watch` until `job.landed` is set: the compute thread waits
on `landed` (never on the event) and only then frees the slot, so a slot's event is never recorded again while
this thread may still wait on it. An error from the wait (a CUDA fault) is kept on the job and raised by
`Runtime.finish` in the compute thread, inside its guard. A CUDA call from this thread while the compute thread
captures a graph would break the capture, so the runtime calls `quiesce` before each capture (after synchronizing
the device, so any wait in progress returns at once); nothing new is watched until the capture is over, because
only the compute thread hands work here.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .threadname import name_os_thread


@dataclass(frozen=True, eq=False)
class Landed:
    """Put on the compute queue when `flight`'s answers are in host memory (or its wait failed)."""
    flight: Any


class LandingWatch:
    def __init__(self, post: Callable[[Landed], None], name: str = "landing"):
        self.post, self.name = post, name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.waiting = 0                  # watched and not yet landed
        self.cond = threading.Condition()

    def watch(self, flight: Any) -> None:
        """Report `flight` (its `job` a runtime.Launched) once it landed; launch order is landing order."""
        job = flight.job
        job.landed = threading.Event()
        if job.event is None:          # the CPU computes inside launch: it has landed already
            job.landed.set()
            self.post(Landed(flight))
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        with self.cond:
            self.waiting += 1
        self.jobs.put(flight)

    def quiesce(self) -> None:
        """Return once this thread waits on no event (everything watched has landed)."""
        with self.cond:
            self.cond.wait_for(lambda: self.waiting == 0)

    def _run(self) -> None:
        name_os_thread(self.name)
        while True:
            flight = self.jobs.get()
            if flight is None:
                return
            job = flight.job
            try:
                job.event.wait()
                job.landed_at = time.monotonic()
            except Exception as e:  # noqa: BLE001 - handed to the compute thread, which answers for it
                job.error = e
            finally:
                with self.cond:
                    self.waiting -= 1
                    self.cond.notify_all()
                job.landed.set()
                self.post(Landed(flight))

    def close(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread = None
