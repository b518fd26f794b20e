"""The distributed transport: SGLang's ``update_weights_from_distributed``, each sender broadcasting its buckets
into a weight-update group with every engine rank (``executor.BucketExecutor`` runs the plan)."""

from __future__ import annotations

from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.executor import BucketExecutor
from mrl.weight_sync.transport import PushStats, Transport


class DistributedTransport(Transport):
    name = "distributed"

    def __init__(self, executor: BucketExecutor):
        self.executor = executor

    @property
    def staged(self) -> bool:
        return self.executor.staged

    @staged.setter
    def staged(self, on: bool) -> None:
        if on != self.executor.staged:  # the request bodies are encoded once, with the mark or without
            self.executor.staged, self.executor._bodies, self.executor._batched = on, None, None

    def connect(self) -> None:
        self.executor.connect()

    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        if engines is not None and set(engines) != set(self.executor.engines):
            raise ValueError("the distributed transport pushes to every engine of its groups at once")
        return self.executor.push(version)

    def forget(self, urls: list[str]) -> None:
        self.executor.forget(urls)

    def close(self) -> None:
        self.executor.close()
