"""The errors an endpoint records: the most recent ones, bounded, and a count of all.

An endpoint records one typed error per refused handshake, corrupt or unexpected message, failed
pull or failed serve, whoever sent the message. Keeping every one would let a peer that sends junk
grow the process without bound, and more so with their tracebacks, which hold the handler's frames
and so the message's buffers (up to ``max_frame_bytes`` each). So each error is kept without its
traceback (nor those of its cause and context), only the last ``keep`` are kept, and ``total``
counts every one recorded.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections import deque

KEEP = 256


def raised_at(e: BaseException) -> str:
    """`` (at file.py:LINE in function)``: where ``e`` was raised (its traceback's innermost
    frame), for the message of an error that wraps it; '' without a traceback."""
    tb = traceback.extract_tb(e.__traceback__)
    return f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""


class ErrorLog:
    """Recorded errors, oldest first; iterable, ``len()`` is the number kept.

    Appended to from an endpoint's I/O thread and read from others (a snapshot under a lock).
    """

    def __init__(self, keep: int = KEEP) -> None:
        self._items: deque = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.total = 0

    def append(self, e: BaseException) -> None:
        todo, seen = [e], set()
        while todo:                  # e, its cause and context, theirs, ...
            x = todo.pop()
            if x is None or id(x) in seen:
                continue
            seen.add(id(x))
            x.__traceback__ = None
            todo += [x.__cause__, x.__context__]
        with self._lock:
            self._items.append(e)
            self.total += 1

    def since(self, count: int) -> tuple[list, int]:
        """``(errors, total)``: the errors recorded after the first ``count`` that are still kept
        (those dropped meanwhile number ``total - count - len(errors)``), and the running total."""
        with self._lock:
            n = min(self.total - count, len(self._items))
            return (list(self._items)[len(self._items) - n:] if n > 0 else []), self.total

    def _snapshot(self) -> list:
        with self._lock:
            return list(self._items)

    def __iter__(self):
        return iter(self._snapshot())

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __getitem__(self, i):
        return self._snapshot()[i]

    def __repr__(self) -> str:
        return f"ErrorLog(total={self.total}, kept={self._snapshot()!r})"
