"""mrl's own messages, through Python's logging, on the console of rank 0 only.

    from mrl.log import get_logger
    log = get_logger(__name__)
    log.info("resuming from %s", path)        # stdout:  [mrl] resuming from runs/x/checkpoints/step_2
    log.warning("engine %s dropped", url)      # stderr:  [mrl] engine http://... dropped

Every process that logs gets the console handler on its first ``get_logger`` call: info on stdout,
warnings and errors on stderr (the stream is looked up per message, so rich's live progress bar, which
swaps ``sys.stdout`` while it draws, keeps its lines above it). A filter lets records through on rank 0
only (``console_rank``), so that code run on every trainer rank logs without asking for its rank; the
rank's own log file (``logs/rank<r>.log``, attached by ``mrl.console.route_library_output``) keeps every
rank's messages. The ``mrl`` logger does not propagate: a root handler (Hydra's, the rank file's) never
shows a message twice. Library loggers stay where ``mrl.console`` sends them. Imports no torch.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "mrl"
PREFIX = "[mrl] "


def console_rank() -> int:
    """This process's rank: torch.distributed's once it is initialised, else ``$RANK`` (torchrun's, inherited
    by the rollout process), else 0 (the launcher, a job of one process)."""
    dist = sys.modules.get("torch.distributed")  # never imported here: only asked when already loaded
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankZeroFilter(logging.Filter):
    """Lets a record through on rank 0 only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return console_rank() == 0


class ConsoleHandler(logging.Handler):
    """Info to ``sys.stdout``, warnings and errors to ``sys.stderr``, both looked up per record."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(PREFIX + "%(message)s"))
        self.addFilter(RankZeroFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def setup() -> logging.Logger:
    """The ``mrl`` logger with its console handler (once per process); idempotent."""
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, ConsoleHandler) for h in root.handlers):
        root.addHandler(ConsoleHandler())
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``mrl.x.y``: under the ``mrl`` logger, whose handlers it uses)."""
    setup()
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")
