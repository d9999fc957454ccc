"""Handles for collectives that run on a CUDA stream of their own.

A handle records an event on the communication stream after the collective; ``wait()``
makes the caller's current stream wait for that event (the device orders the work; the host
does not block), ``test()`` asks the event. The stream and event objects come from a
``StreamOps`` backend: torch's on a GPU, a recording stand-in in the CPU tests, so that the
bookkeeping is tested where no GPU exists."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

__all__ = ["StreamOps", "TorchStreamOps", "StreamHandle"]


class StreamOps(Protocol):
    """The few stream operations the GPU data plane uses."""

    def current_stream(self) -> Any: ...
    def new_event(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def query(self, event: Any) -> bool: ...
    def wait_stream(self, stream: Any, other: Any) -> None: ...


class TorchStreamOps:
    """``StreamOps`` on torch.cuda streams and events (needs a GPU)."""

    def __init__(self, device: int):
        import torch

        self._torch = torch
        self.device = device

    def current_stream(self):
        return self._torch.cuda.current_stream(self.device)

    def new_stream(self):
        return self._torch.cuda.Stream(self.device)

    def new_event(self):
        return self._torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def query(self, event) -> bool:
        return bool(event.query())

    def wait_stream(self, stream, other) -> None:
        stream.wait_stream(other)


class StreamHandle:
    """A collective in flight on ``stream``: finished on the device once ``event`` is."""

    def __init__(self, ops: StreamOps, stream: Any, result: Any,
                 after: Optional[Callable[[], None]] = None):
        self._ops = ops
        self._event = ops.new_event()
        if after is not None:
            after()
        ops.record(self._event, stream)
        self._result = result
        self._waited = False

    def test(self) -> bool:
        """Whether the device has finished the collective (never blocks)."""
        return self._ops.query(self._event)

    def wait(self) -> Any:
        """Order the caller's current stream after the collective and return its result;
        the host does not wait (reading the result on the host synchronises as usual)."""
        if not self._waited:
            self._ops.wait_event(self._ops.current_stream(), self._event)
            self._waited = True
        return self._result
