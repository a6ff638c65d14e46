"""The library's logger and its once-per-process warnings.

One helper for the whole library, so that a warning repeated on every
traced step (the eager fallback of a tape, a CPU allocator that makes
peaks noisy) is said once, and so that tests can forget every given
warning with one call. No TensorFlow here.
"""

import logging
import threading

logger = logging.getLogger("memsave")

_given = set()
_lock = threading.Lock()


def warn_once(key, message, *args):
    """Log ``message % args`` at WARNING, unless ``key`` was warned about before."""
    with _lock:
        if key in _given:
            return
        _given.add(key)
    logger.warning(message, *args)


def reset_warnings():
    """Forget which once-only warnings were given (for tests)."""
    with _lock:
        _given.clear()


def size_text(nbytes):
    """``nbytes`` for a message: MiB from 1 MiB up (``"12.5 MiB"``), else KiB
    or bytes, so that a small budget and its smallest plan do not both read
    "0.0 MiB"."""
    if nbytes >= 2 ** 20:
        return "%.1f MiB" % (nbytes / 2 ** 20)
    if nbytes >= 2 ** 10:
        return "%.1f KiB" % (nbytes / 2 ** 10)
    return "%d bytes" % nbytes
