"""Keep the console for mrl's own lines: library warnings and log records go to the run's log file.

    route_library_output(run_dir, rank)    # before megatron/transformers are imported, and again after

megatron-core, transformers and torch warn on import and while building a model (deprecations, optional
packages not installed, DDP bucket layouts); a user needs them when something breaks, not on every run.
Library warnings and the root logger go to ``<run_dir>/logs/rank<r>.log`` only; mrl's own warnings (a
config option without effect) stay on the console, and mrl's own messages (``mrl.log``) go to both: the
console on rank 0, the file on every rank. Libraries that install console handlers of their own
on import (transformers) are routed to the file again by the second call. Imports no torch.
"""

from __future__ import annotations

import logging
import os
import warnings

from mrl.log import setup as setup_mrl_logger

LIBRARIES = ("py.warnings", "megatron", "transformers", "torch", "urllib3", "httpx", "httpcore")
MRL_DIR = os.path.dirname(os.path.abspath(__file__))
# compat's TorchFunctionMode forwards megatron's own tensor calls, so torch attributes the warnings they
# raise (a non-leaf ``.grad`` read) to compat.py: they are megatron's
FORWARDERS = (os.path.join(MRL_DIR, "megatron", "compat.py"),)
_console_showwarning = warnings.showwarning


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    path = os.path.abspath(filename)
    if path.startswith(MRL_DIR + os.sep) and path not in FORWARDERS:
        _console_showwarning(message, category, filename, lineno, file, line)
    else:
        logging.getLogger("py.warnings").warning(warnings.formatwarning(message, category, filename, lineno, line))


def log_path(run_dir: str, rank: int | str) -> str:
    return os.path.join(run_dir, "logs", f"rank{rank}.log" if isinstance(rank, int) else f"{rank}.log")


def route_library_output(run_dir: str, rank: int | str) -> str:
    """Send warnings and every library logger to this rank's log file (``logs/rank<r>.log``; a name instead
    of a rank: ``logs/<name>.log``), mrl's own messages there too (and on rank 0's console); the path.
    Idempotent."""
    path = log_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "baseFilename", None) == os.path.abspath(path)), None)
    if handler is None:
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    mrl_logger = setup_mrl_logger()  # its console handler kept, its file this rank's
    mrl_logger.handlers[:] = [h for h in mrl_logger.handlers if not isinstance(h, logging.FileHandler)] + [handler]
    warnings.showwarning = _showwarning
    # torch gives many of its child loggers console handlers of their own (torch._dynamo's recompile
    # warnings, torch.distributed's): every logger under a library goes to the file
    known = [n for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] in LIBRARIES]
    for name in {*LIBRARIES, *known}:
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    return path
