"""Where the loop is, as a checkpoint holds it besides the weights, and the checkpoint files.

    write_loop_state(path, LoopState(step=7, version=3, ...))   # last: its file marks the checkpoint complete
    state = read_loop_state(latest_checkpoint(cfg))

The loop state is plain JSON, never a pickle: loading a checkpoint runs no code from it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np

from mrl.config.schema import Config
from mrl.data import Prompt
from mrl.process import LOOP_STATE_FILE
from mrl.rollout.buffer import Group
from mrl.rollout.sample import Sample


@dataclass
class LoopState:
    """What a checkpoint holds besides the weights: where the loop is."""

    step: int = 0
    version: int = 0
    prompt_index: int = 0
    buffered: list[Group] | None = None
    history: list[dict] | None = None
    redo_prompts: list[int] | None = None
    """Prompts drawn whose groups were unfinished at the checkpoint: generated first after a resume."""


def _state_types() -> dict[str, type]:
    return {c.__name__: c for c in (LoopState, Group, Sample, Prompt)}


def state_to_json(x):
    """The loop state as plain JSON: the dataclasses above tagged by name, numpy arrays (routes) as
    dtype + shape + base64 bytes. JSON, not pickle: loading a checkpoint runs no code from it."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if type(x).__name__ not in _state_types():
            raise TypeError(f"loop state: {type(x).__name__} is not one of {sorted(_state_types())}")
        return {"__type__": type(x).__name__, **{f.name: state_to_json(getattr(x, f.name))
                                                for f in dataclasses.fields(x)}}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.dtype.str, "shape": list(x.shape),
                "data": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()}
    if isinstance(x, dict):
        return {str(k): state_to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [state_to_json(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    raise TypeError(f"loop state: cannot store a {type(x).__name__} as JSON")


def state_from_json(x):
    """Inverse of ``state_to_json``; only the tagged dataclasses and numeric arrays are rebuilt."""
    if isinstance(x, list):
        return [state_from_json(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__ndarray__" in x:
        dt = np.dtype(x["__ndarray__"])
        if dt.kind not in "biuf":
            raise ValueError(f"loop state: array of dtype {dt} (only numbers are stored)")
        return np.frombuffer(base64.b64decode(x["data"]), dtype=dt).reshape(x["shape"]).copy()
    if "__type__" in x:
        cls = _state_types().get(x["__type__"])
        if cls is None:
            raise ValueError(f"loop state: unknown type {x['__type__']!r}")
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: state_from_json(v) for k, v in x.items() if k in init})
    return {k: state_from_json(v) for k, v in x.items()}


def write_loop_state(path: str, state: LoopState) -> None:
    """The loop state into checkpoint ``path`` once every rank's shards are durable there: its file, renamed
    into place last, marks the checkpoint complete, so a crash never leaves a "complete" checkpoint with a hole."""
    sync_tree(path)
    final = os.path.join(path, LOOP_STATE_FILE)
    with open(final + ".tmp", "w") as f:
        json.dump(state_to_json(state), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + ".tmp", final)
    sync_tree(path, files=False)


def read_loop_state(path: str) -> LoopState:
    with open(os.path.join(path, LOOP_STATE_FILE)) as f:
        return state_from_json(json.load(f))


def checkpoint_dir(cfg: Config) -> str:
    return os.path.join(cfg.run_dir, "checkpoints")


def latest_checkpoint(cfg: Config) -> str | None:
    root = checkpoint_dir(cfg)
    if not os.path.isdir(root):
        return None
    done = sorted((d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, LOOP_STATE_FILE))),
                  key=lambda d: int(d.split("_")[-1]))
    old = [d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "loop_state.pkl"))]
    if old and not done:  # never unpickled: a pickle in a checkpoint runs whatever code it names
        raise ValueError(f"{root}: checkpoints {sorted(old)} hold a pickled loop state (loop_state.pkl, written by "
                         f"an older mrl), which is no longer loaded; start afresh with train.resume=false or "
                         "another run_dir")
    return os.path.join(root, done[-1]) if done else None


def tree_bytes(path: str) -> int:
    """The bytes of every file under ``path`` (a checkpoint's size on disk)."""
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def sync_tree(path: str, *, files: bool = True) -> None:
    """fsync every file under ``path`` (written by any rank: the page cache is the inode's), then the
    directories, so their entries are durable too."""
    for root, dirs, names in os.walk(path, topdown=False):
        for name in (names if files else []):
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def prune_checkpoints(root: str, keep: int) -> list[str]:
    """Delete the complete checkpoints under ``root`` older than the newest ``keep`` (0: none deleted).
    A directory without its marker (being written, or left by a crash) is not counted and not touched."""
    if keep <= 0 or not os.path.isdir(root):
        return []
    done = sorted((d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, LOOP_STATE_FILE))),
                  key=lambda d: int(d.split("_")[-1]))
    old = done[:-keep]
    for d in old:
        shutil.rmtree(os.path.join(root, d))
    return old
