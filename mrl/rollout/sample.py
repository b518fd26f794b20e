"""The rollout data contract: one sample = one prompt + one response, with per-token provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(kw_only=True)
class SamplingSpec:
    """Per-request sampling parameters (SGLang ``sampling_params``)."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    """Per-request ``sampling_seed`` derived from (seed, group, sample, segment): reproducible rollouts
    (SGLang honours it only with ``--enable-deterministic-inference``)."""

    def to_request(self, max_new_tokens: int) -> dict[str, Any]:
        p = {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
             "top_k": self.top_k, "min_p": self.min_p, "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            p["stop_token_ids"] = list(self.stop_token_ids)
        return p


@dataclass(kw_only=True)
class Sample:
    """A (possibly partial) rollout. Partial rollouts resume by resubmitting prompt + response so far."""

    prompt_ids: list[int]
    group_id: int
    index: int
    max_new_tokens: int
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Weight version that produced each response token (segments of a partial rollout can differ)."""
    routes: np.ndarray | None = None
    """Compact expert ids ``[prompt + response - 1, moe_layers, top_k]`` of the last engine call."""
    support: list[list[int]] = field(default_factory=list)
    """Keep Sampling Mask: per response token, the ids of the engine's sampling support ([] = not rebuilt)."""
    support_log_mass: list[float] = field(default_factory=list)
    """Per response token: log of the engine's probability mass on that support."""
    finish_reason: str | None = None  # "stop" | "length" when done
    error: str | None = None  # set when the sample could not be completed (counted, never dropped)
    num_segments: int = 0
    num_aborts: int = 0
    num_retries: int = 0
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.response_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def check(self) -> None:
        """Invariants every finished sample satisfies (cheap; called by the manager)."""
        n = len(self.response_ids)
        assert len(self.response_logprobs) == n and len(self.versions) == n, "per-token arrays out of sync"
        assert not self.support or len(self.support) == len(self.support_log_mass) == n, "supports out of sync"
        if self.routes is not None and n:
            assert self.routes.shape[0] == len(self.prompt_ids) + n - 1, "routes rows != prompt + response - 1"
