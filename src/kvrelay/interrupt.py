"""Ctrl+C that no library can swallow.

Python raises KeyboardInterrupt wherever the main thread happens to be, and some code catches
every exception: torch's C initialisation imports numpy and carries on without it if that import
fails, so a Ctrl+C that lands in numpy's import is lost and `kvrelay serve` goes on to serve. The
handler installed here raises as Python's own does and also remembers the request, so the
command checks `requested()` where it passes from loading to serving and stops there.
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()


def _interrupt(signum, frame) -> None:
    _requested.set()
    raise KeyboardInterrupt


def install() -> None:
    """Take over SIGINT (main thread only, as signal.signal requires)."""
    signal.signal(signal.SIGINT, _interrupt)


def requested() -> bool:
    """Whether a Ctrl+C (or a SIGTERM routed to KeyboardInterrupt by the CLI) has arrived."""
    return _requested.is_set()


def request() -> None:
    _requested.set()
