"""Files written whole or not at all (dumps, cache files).

The bytes go to a hidden ``.NAME.PID.RANDOM.part`` file beside the path; :meth:`PartFile.commit`
flushes it to disk and renames it to the path (atomic on one file system), :meth:`PartFile.discard`
removes it. A write that fails midway (disk full, an error between two blocks) so leaves no
partial file under the path and does not replace the file that was there.
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager


class PartFile:
    """``f``: the open part file of ``path`` (mode ``"wb"`` or ``"w"``)."""

    def __init__(self, path, mode: str = "wb") -> None:
        self.path = os.fspath(path)
        self.part = os.path.join(os.path.dirname(os.path.abspath(self.path)),
                                 f".{os.path.basename(self.path)}.{os.getpid()}.{secrets.token_hex(4)}.part")
        try:
            self.f = open(self.part, mode.replace("w", "x"))
        except OSError as e:      # named by the path asked for, not the part file's
            raise OSError(e.errno, e.strerror, self.path) from None

    def commit(self) -> None:
        """Flush to disk and put the file at ``path``; on failure the part file is removed."""
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.part, self.path)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        self.f.close()
        try:
            os.unlink(self.part)
        except FileNotFoundError:
            pass


@contextmanager
def written_whole(path, mode: str = "wb"):
    """``with written_whole(path) as f:``: ``f`` ends up at ``path`` only if the block ends normally."""
    p = PartFile(path, mode)
    try:
        yield p.f
    except BaseException:
        p.discard()
        raise
    p.commit()
