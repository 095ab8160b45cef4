"""A result computed on a daemon thread: started now, read (joined) once needed, its error raised there.

The two readers of a weight version into a second buffer share it: :class:`dynaresize.staging.Prefetch` (a staged
snapshot read from disk) and :class:`dynaresize.comm.transport.CommFetch` (received from rank 0 over the world
group); the install that needs the version calls :meth:`Background.result`."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """``work()`` on a daemon thread named ``name``; ``started``/``finished`` are ``perf_counter`` times."""

    def __init__(self, work: Callable[[], T], name: str):
        self._result: T | None = None
        self._error: BaseException | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._th = threading.Thread(target=self._run, args=(work,), daemon=True, name=name)
        self._th.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._result = work()
        except BaseException as e:  # noqa: BLE001 - re-raised in result()
            self._error = e
        self.finished = time.perf_counter()

    def _wait(self) -> T:
        """The result once the thread ended; its error raised as it was."""
        self._th.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def result(self) -> Any:
        return self._wait()
