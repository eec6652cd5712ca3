"""Logging that reads well in a terminal and in the journal.

Under systemd (JOURNAL_STREAM names our stderr) each line gets a `<N>` syslog priority prefix, which journald
turns into the entry's priority, and no timestamp, since the journal adds its own.
"""

from __future__ import annotations

import logging
import os
import sys

# syslog priorities journald understands as a "<N>" line prefix (sd-daemon.h)
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def stderr_is_journal() -> bool:
    """True when stderr is the journal stream systemd connected (JOURNAL_STREAM is "dev:inode")."""
    stream = os.environ.get("JOURNAL_STREAM")
    if not stream:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines() or [""])


def setup_logging(level: str = "info", prefix: str = "") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(JournalFormatter(f"{prefix}%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
