"""The signals a launcher forwards to its workers, latched for its loop."""

from __future__ import annotations

import signal



FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalLatch:
    """Queues the forwarded signals for the agent's loop instead of raising where they land."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalLatch:
        for signum in FORWARDED_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def raise_if_received(self) -> None:
        if self.received:
            raise Interrupted(self.received[0])
