"""``mrl.jobs.sync_weights`` with one bucket sent one row short, as a trainer bug would send it: the engines
must reject it ("partially updated") and the sync must repair them from disk.

    torchrun --nproc-per-node 2 -m tests.jobs.sync_weights_fault --short-bucket 1 <mrl.jobs.sync_weights args>

Every bucket numbered ``--short-bucket`` (one per sender) is declared to the engines with its first 2-D
tensor one row short, and its broadcast carries the bytes of that declaration only. The fault lives in a
subclass of the package's executor that the job's transport factory builds instead; nothing in ``mrl``
knows of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch

import mrl.weight_sync.factory as factory
from mrl.jobs.sync_weights import main as sync_weights
from mrl.weight_sync.executor import BucketExecutor
from mrl.weight_sync.planner import Bucket


def one_row_short(meta):
    """The first 2-D tensor of ``meta`` (HF tensors) one row short."""
    i = next(i for i, t in enumerate(meta) if len(t.shape) == 2)
    t = meta[i]
    return meta[:i] + [type(t)(t.name, (t.shape[0] - 1,) + tuple(t.shape[1:]), t.dtype)] + meta[i + 1:]


class ShortBucket(Bucket):
    """A planned bucket whose declared tensors are one row short (what its request tells the engines)."""

    @property
    def tensors(self):
        return one_row_short(super().tensors)


class ShortStep:
    """A bucket's copy step whose flat buffer, once filled, is cut to the bytes its short declaration names."""

    def __init__(self, step, dtype: torch.dtype):
        self._step, self._dtype = step, dtype

    def __getattr__(self, name):
        return getattr(self._step, name)

    @property
    def flat(self):
        flat = self._step.flat
        if flat is None:
            return None
        elem = torch.empty((), dtype=self._dtype).element_size()
        out, off = [], 0
        for full, cut in zip(self._step.bucket.tensors, one_row_short(self._step.bucket.tensors)):
            out.append(flat[off:off + math.prod(cut.shape) * elem])
            off += math.prod(full.shape) * elem
        return torch.cat(out)


def short_executor(index: int):
    class OneBucketShort(BucketExecutor):
        def _replan(self, plan):
            super()._replan(plan)  # the copy plan keeps the real buckets; the requests get the short ones
            self._global = [ShortBucket(**{f.name: getattr(b, f.name) for f in dataclasses.fields(b)})
                            if b.index == index else b for b in self._global]

        def steps(self):
            return [ShortStep(s, getattr(torch, self.dtype)) if s.bucket.index == index else s
                    for s in super().steps()]

    return OneBucketShort


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short-bucket", type=int, required=True)
    a, rest = ap.parse_known_args(argv)
    factory.BucketExecutor = short_executor(a.short_bucket)  # what make_transport builds
    return sync_weights(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
