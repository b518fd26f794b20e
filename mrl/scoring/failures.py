"""Groups a scoring pool could not score: dropped (never trained without their score) and counted; more than
``max_error_rate`` of the last ``WINDOW`` groups failing stops the run."""

from __future__ import annotations

import logging
from collections import deque

from mrl.scoring.base import GroupScores, ScoringError, ScoringGroup

logger = logging.getLogger(__name__)

WINDOW = 64


class FailedGroups:
    def __init__(self, node: str, max_error_rate: float):
        self.node, self.max_error_rate = node, max_error_rate
        self._recent: deque[bool] = deque(maxlen=WINDOW)
        self.failed = 0

    def ok(self) -> None:
        self._recent.append(False)

    def dropped(self, group: ScoringGroup, why: str) -> GroupScores:
        """The group's scores as dropped (every reward None); raises ``ScoringError`` past the error rate."""
        self.failed += 1
        self._recent.append(True)
        bad = sum(self._recent)
        if len(self._recent) == WINDOW and bad > self.max_error_rate * WINDOW:
            raise ScoringError(f"{self.node}: {bad} of the last {WINDOW} groups could not be scored, more than "
                               f"{self.node}.max_error_rate={self.max_error_rate}; last: {why}")
        if self.failed <= 5:
            logger.warning("%s could not score prompt %r (group dropped): %s", self.node, group.prompt.id, why)
        return GroupScores(rewards=[None] * len(group), errors=[why] * len(group))
