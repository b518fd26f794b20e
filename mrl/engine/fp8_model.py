"""The checkpoint FP8 engines start from (``engine.quantization=fp8``): ``model.hf_path`` exported to block
FP8 (``mrl.quant.export``) once per run, into the run directory.

SGLang's ``fp8`` method serves block-wise scales only from an FP8-serialized checkpoint: given a bf16 one
with ``--quantization fp8`` it quantizes per channel at load, which is not what the weight sync sends. So
the job writes ``<run_dir>/fp8_model`` before the engines start, and every later start of the run (a
resumed job, a restarted engine, ``mrl engine`` on a cluster engine node) reuses it.

Completeness: the export is written into ``fp8_model.partial`` and renamed to ``fp8_model`` only after its
last file, the marker ``mrl_fp8_export.json`` (the source and its fingerprint), is written: a directory of
that name is whole. A partial export left by a killed job is removed and redone; an export of another source
(``model.hf_path`` changed between two starts of the run), or with other modules kept in high precision
(``engine.fp8_ignore``), is redone too. Concurrent starts (engine nodes of
one run sharing its directory) take a lock file, so one exports and the others reuse its result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Sequence

from mrl.log import get_logger
from mrl.quant.export import WEIGHT_FILES, export_fp8

logger = get_logger(__name__)

FP8_DIR = "fp8_model"
MARKER = "mrl_fp8_export.json"


def fp8_model_dir(run_dir: str) -> str:
    return os.path.join(run_dir, FP8_DIR)


def source_fingerprint(src: str) -> dict:
    """What identifies ``src``'s content cheaply: config.json's hash and every weight file's name and size."""
    with open(os.path.join(src, "config.json"), "rb") as f:
        config = hashlib.sha256(f.read()).hexdigest()
    files = {fn: os.path.getsize(os.path.join(src, fn)) for fn in sorted(os.listdir(src)) if WEIGHT_FILES.search(fn)}
    return {"source": os.path.abspath(src), "config_sha256": config, "weight_files": files}


def complete_export(dst: str, src: str, ignored: Sequence[str] = ()) -> bool:
    """``dst`` is a whole export of ``src`` as it is now, with the same modules kept in high precision."""
    try:
        with open(os.path.join(dst, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return marker.get("fingerprint") == source_fingerprint(src) and marker.get("ignored", []) == sorted(ignored)


@contextlib.contextmanager
def _locked(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_fp8_model(src: str, run_dir: str, *, ignored: Sequence[str] = (), device: str | None = None,
                     log=None) -> str:
    """The block-FP8 checkpoint of ``src`` in ``run_dir`` (module docstring), ``ignored``'s modules in high
    precision (``engine.fp8_ignore``): reused when whole, of ``src`` and of the same ``ignored``, else
    (re)written. Returns its path. ``log``: where its lines go (default: mrl's logger)."""
    log = log or logger.info
    dst = fp8_model_dir(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    with _locked(dst + ".lock"):
        if complete_export(dst, src, ignored):
            log(f"FP8 engines: reusing the block-FP8 export {dst}")
            return dst
        if os.path.exists(dst):  # another source's, or a marker that does not parse: not ours to reuse
            log(f"FP8 engines: {dst} is not a whole export of {src} with these ignored modules; exporting again")
            shutil.rmtree(dst)
        tmp = dst + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)  # a killed job's partial export
        summary = export_fp8(src, tmp, ignored=ignored, device=device, log=log)
        if device is not None and device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"fingerprint": source_fingerprint(src), "ignored": sorted(ignored), "summary": summary}, f,
                      indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dst)
    return dst


def engine_model_path(cfg) -> str:
    """Where the run's engines load their weights from: ``model.hf_path``, or its block-FP8 export for
    ``engine.quantization=fp8``."""
    if cfg.engine.quantization == "fp8":
        return ensure_fp8_model(cfg.model.hf_path, cfg.run_dir, ignored=tuple(cfg.engine.fp8_ignore),
                                device=_export_device())
    return cfg.model.hf_path


def _export_device() -> str | None:
    """The GPU when there is one: the export sits on the path to the first step (the engines start from
    it), and the fused kernel quantizes far faster than the CPU path; one tensor is on the GPU at a time,
    and the cache is emptied after, before engines or the trainer take the memory."""
    import torch

    return "cuda" if torch.cuda.is_available() else None
