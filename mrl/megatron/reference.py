"""The reference policy of the KL penalty, without a second model.

The reference's local weight shards live in host memory and are swapped into the training model for
one forward-only pass per step (slime keeps its reference the same way). So the reference sees the
same layout, the same micro-batches and the same replayed routes as the policy -- the KL measures the
weights, not two routings -- and no second set of megatron ``RouterReplay`` instances is created
(they are process-global; a second model would break the replay of the first). With ``scoring.reference``
the reference runs on engines instead (``mrl.scoring.reference``): the batch carries its logprobs
(``RLBatch.ref_logp``) and nothing is swapped.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from mrl.megatron.train_step import forward_backward


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Everything a forward reads that training changes: trainable parameters and floating-point buffers
    (e.g. expert biases), in a fixed order. Frozen parameters (a LoRA run's base weights) are the same for
    the reference and the policy and are not copied."""
    return [p for p in module.parameters() if p.requires_grad] + [b for b in module.buffers() if b.is_floating_point()]


class ReferenceWeights:
    def __init__(self) -> None:
        self._host: list[torch.Tensor] | None = None

    @property
    def ready(self) -> bool:
        return self._host is not None

    def capture(self, module: torch.nn.Module) -> None:
        """This rank's shards of the current weights become the reference."""
        pin = torch.cuda.is_available()
        self._host = [t.detach().to("cpu", copy=True) for t in _tensors(module)]
        if pin:
            self._host = [t.pin_memory() for t in self._host]

    @contextmanager
    def swapped_in(self, module: torch.nn.Module):
        """The reference's weights in ``module`` for the duration; the policy's are restored after
        (in place: megatron's DDP buffers keep pointing at the same storage)."""
        if self._host is None:
            raise RuntimeError("reference weights were never captured")
        live = _tensors(module)
        if [t.shape for t in live] != [t.shape for t in self._host]:
            raise RuntimeError("reference weights do not match the model's shards (another layout?)")
        backup = [t.detach().to("cpu", copy=True) for t in live]
        with torch.no_grad():
            for t, ref in zip(live, self._host):
                t.copy_(ref, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, b in zip(live, backup):
                    t.copy_(b, non_blocking=True)

    def fill(self, model, layout, plans: list[list], passes: dict) -> None:
        """Each micro-batch's ``data["ref"]``: its logprobs by a forward-only pass of the policy's micro-batches
        (its routes replayed, ``passes``: ``forward_backward``'s options) with the reference's weights in."""
        with self.swapped_in(model.module):
            for mbs in plans:
                for mb, o in zip(mbs, forward_backward(model, layout, mbs, forward_only=True, **passes)):
                    mb.data["ref"] = o["logprobs"]

    def save(self, path: str, rank: int) -> None:
        if self._host is not None:
            torch.save(self._host, os.path.join(path, f"reference_rank{rank}.pt"))

    def load(self, path: str, rank: int) -> bool:
        f = os.path.join(path, f"reference_rank{rank}.pt")
        if not os.path.isfile(f):
            return False
        self._host = torch.load(f, weights_only=True)
        return True
