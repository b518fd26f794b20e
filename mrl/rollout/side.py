"""The rollout side as the trainer sees it: one interface, two implementations.

    rollout: RolloutSide = RolloutService.start(cfg, hf_path, urls, codec, state)   # trainer rank 0
    rollout.start_producing(16); groups = rollout.take(8, version, timeout=600)
    n = rollout.drain(60); ...weight sync...; rollout.undrain()

``LocalRollout`` (``mrl.rollout.service``) holds the objects (producer, buffer, rewards, engine clients)
inside the rollout process; ``RolloutService`` is the trainer's proxy of it, whose methods are generated
from this interface (``mrl.rollout.service``), so the two cannot drift apart.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mrl.rollout.buffer import Group


class RolloutSide(abc.ABC):
    """What the trainer's rank 0 asks of the rollout side. A method with a ``timeout`` argument may block
    that long; the others answer at once."""

    @abc.abstractmethod
    def start_producing(self, credits: int) -> None:
        """Generation starts, ``credits`` groups ahead."""

    @abc.abstractmethod
    def allow(self, n: int) -> None:
        """``n`` more groups may be generated (sync mode: the next batch)."""

    @abc.abstractmethod
    def take(self, n: int, version: int, timeout: float) -> list[Group]:
        """``n`` groups within the staleness bound of ``version`` (blocks until there are ``n``, or TimeoutError)."""

    @abc.abstractmethod
    def drain(self, timeout: float) -> int:
        """Abort the engines' in-flight requests and hold new ones until ``undrain``; how many were aborted."""

    @abc.abstractmethod
    def undrain(self) -> None:
        """The held and aborted requests go on (on the engines' new weights)."""

    @abc.abstractmethod
    def submit_eval(self, step: int, version: int) -> bool:
        """Evaluate ``train.eval_sets`` on the engines (weight ``version``, after ``step``) in the background;
        False, and nothing submitted, while the previous evaluation still generates."""

    @abc.abstractmethod
    def eval_results(self, timeout: float) -> list:
        """The evaluation results (``mrl.rollout.evaluation.EvalResult``) finished since the last call, after
        waiting up to ``timeout`` for a running evaluation."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Counters since the start (buffer, producer, engine calls); the prefix-cache hit rate since the last call."""

    @abc.abstractmethod
    def state(self) -> tuple[int, list, list[int]]:
        """(next prompt index, buffered groups, prompts drawn but unfinished) for a checkpoint."""

    @abc.abstractmethod
    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to the producer's counter ``key`` (e.g. groups the trainer refused)."""

    @abc.abstractmethod
    def add_engine(self, url: str) -> None:
        """A restarted engine joins: rollouts and evaluations use it from now on."""

    @abc.abstractmethod
    def set_adapter(self, name: str, version: int) -> None:
        """LoRA: new requests use adapter ``name`` (loaded on every engine already); their tokens get ``version``."""

    @abc.abstractmethod
    def stop(self) -> None:
        """End generation and close the engine clients."""
