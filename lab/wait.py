"""The one polling loop. Every wait is bounded and says what it waited for when it gives up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from lab.errors import TimeoutError_

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None],  # None (or any falsy value): not yet; so what returns is never None
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
    max_interval: float = 1.0,
    detail: Callable[[], str] | None = None,
) -> T:
    """Call `check` until it returns a truthy value, and return that value.

    The interval grows from `interval` to `max_interval` (cheap checks answer fast at first,
    then back off). `check` may raise to abort the wait at once (e.g. the process died).
    On timeout raises TimeoutError_ naming `what`, the time waited, and `detail()` if given.
    """
    start = time.monotonic()
    delay = interval
    while True:
        value = check()
        if value:
            return value
        elapsed = time.monotonic() - start
        if elapsed >= timeout:
            extra = ""
            if detail is not None:
                try:
                    extra = f" ({detail()})"
                except Exception as exc:  # detail is best effort; the timeout is the error
                    extra = f" (no detail: {exc})"
            raise TimeoutError_(f"timed out after {elapsed:.1f} s waiting for {what}{extra}")
        time.sleep(min(delay, max(0.0, timeout - elapsed)))
        delay = min(delay * 1.5, max_interval)
