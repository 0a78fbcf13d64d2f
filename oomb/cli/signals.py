"""Ctrl-C and SIGTERM while ``oomb train`` starts up: remembered, and acted on once training can save a checkpoint."""

from __future__ import annotations


class _StartupSignals:
    """SIGINT/SIGTERM of ``oomb train`` from its start until the training loop's GracefulStop takes them over.

    During setup (imports, data, model: nothing written yet) a signal raises KeyboardInterrupt at once ("oomb:
    interrupted", exit 130) and is also recorded: a KeyboardInterrupt raised while Python runs a finalizer
    (``__del__``) is printed as "Exception ignored" and dropped, and a user saw the run then train to
    its end. :meth:`check` stops on a recorded one. From :meth:`defer` on (the output directory is being written)
    a signal is only recorded, so that moving an earlier run aside (--overwrite) is never cut in two.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferred = False
        self.previous: dict = {}

    def install(self) -> "_StartupSignals":
        import signal

        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (main() called from one): Python's own handling
                pass
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        if self.signum is None:
            self.signum = signum
        if not self.deferred:
            raise KeyboardInterrupt

    def defer(self) -> None:
        """From here on the output is written: a signal is recorded, and stops the run at the next :meth:`check`."""
        self.deferred = True
        self.check()

    def check(self) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt

    def restore(self) -> None:
        import signal

        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
