"""The generation side of the loop: prompts -> GRPO groups on the engines -> scores -> buffer.

Runs on the controller (trainer rank 0) in its own thread and event loop, so generation continues
while the trainer computes. Throttled by credits (``allow``): one credit = one group may start.
Each finished group goes to the group scorer (``mrl.scoring``: ``reward.fn``, an environment's reward,
a teacher's per-token reverse KL, ...), as a task of its own, so scoring overlaps generation.
Groups that carry no signal under DAPO's dynamic sampling, whose score was dropped, or whose samples
failed are not buffered and give their credit back (all counted). With an environment (``episodes``),
each sample is a multi-turn episode (``mrl.rollout.multiturn``), scored with the environment's reward;
a group with a dropped episode (the environment raised) is not buffered either (``groups_env_dropped``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from concurrent.futures import Future

from mrl.rollout.buffer import Group, RolloutBuffer
from mrl.data import Prompt, PromptSource
from mrl.data.prompt import budget_error, prompt_ids
from mrl.rollout.manager import RolloutManager
from mrl.rollout.multiturn import EpisodeRunner
from mrl.scoring.base import Scorer, ScoringGroup


def row_budget(prompt: Prompt, group_size: int) -> int | list[int] | None:
    """A JSONL row's ``max_new_tokens``: one budget for the group, or a list of one per sample (length
    benchmarks with within-group spread, as real responses have), repeated to cover the group. The
    dataset already skips rows with a bad one (counted); prompts from elsewhere are checked here."""
    b = prompt.meta.get("max_new_tokens")
    if b is None:
        return None
    if (why := budget_error(b)) is not None:
        raise ValueError(f"prompt {prompt.id}: {why}")
    return [b[i % len(b)] for i in range(group_size)] if isinstance(b, list) else b


class Producer:
    def __init__(self, *, manager: RolloutManager, scorer: Scorer, source: PromptSource, tokenizer,
                 buffer: RolloutBuffer, group_size: int, dynamic_sampling: bool, start_index: int = 0,
                 redo: list[int] | None = None, episodes: EpisodeRunner | None = None):
        """``start_index``: the next prompt to draw; ``redo``: prompts drawn before a checkpoint whose groups
        were still in flight at it (a resumed run generates them first, so no prompt is skipped)."""
        self.manager, self.scorer, self.source, self.tok = manager, scorer, source, tokenizer
        self.episodes = episodes
        self.buffer, self.group_size, self.dynamic_sampling = buffer, group_size, dynamic_sampling
        self.next_index = start_index
        self._redo = list(redo or [])
        self._inflight: set[int] = set()
        self.counts: Counter = Counter()
        self._credits = 0
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop.run_forever, name="mrl-producer", daemon=True)
        self._main: Future | None = None
        self.error: BaseException | None = None

    # -- control from the trainer thread ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self._loop)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def unfinished(self) -> list[int]:
        """Prompts drawn whose groups are not buffered yet (in flight, or still to redo): for a checkpoint."""
        return sorted(self._inflight.copy() | set(self._redo))

    def allow(self, n: int) -> None:
        """Let ``n`` more groups start."""
        self._loop.call_soon_threadsafe(self._add_credits, n)

    def run(self, coro):
        """Run a coroutine on the producer's loop (e.g. eval generations) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def drain(self, timeout: float = 60.0, also: list[RolloutManager] = ()) -> int:
        """Before a weight sync: no request on any engine (in-flight ones aborted, kept, resumed by
        ``undrain``), so the engines pause at once; ``also``: the other managers sending to the same
        engines (evaluation). Returns the number of requests aborted."""
        async def every():
            return sum(await asyncio.gather(*(m.drain(timeout) for m in [self.manager, *also])))

        return self.run(every())

    def undrain(self, also: list[RolloutManager] = ()) -> None:
        for m in [self.manager, *also]:
            self._loop.call_soon_threadsafe(m.undrain)

    def stop(self) -> None:
        self._stop = True
        self._loop.call_soon_threadsafe(self._add_credits, 0)
        if self._main is not None:
            try:
                self._main.result(timeout=60)
            except Exception:  # cancelled groups: the run is over
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout producer failed: {self.error!r}") from self.error

    # -- loop thread -----------------------------------------------------------------------------
    def _add_credits(self, n: int) -> None:
        self._credits += n
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        try:
            while not self._stop:
                if self._credits <= 0:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._credits -= 1
                if self._redo:
                    gid = self._redo.pop(0)
                else:
                    gid = self.next_index
                    self.next_index += 1
                prompt = self.source.sample(gid)
                t = asyncio.create_task(self._group(prompt, gid))
                tasks.add(t)
                self._inflight.add(gid)
                t.add_done_callback(lambda t, gid=gid: (tasks.discard(t), self._inflight.discard(gid)))
        except BaseException as e:  # surfaced to the trainer by check()
            self.error = e
        finally:  # run over: in-flight groups are abandoned (counted), their cancellation awaited quietly
            self.counts["groups_abandoned_at_stop"] += len(tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _group(self, prompt: Prompt, gid: int) -> None:
        try:
            if self.episodes is not None:
                await self._episode_group(prompt, gid)
                return
            ids = prompt_ids(prompt, self.tok)
            samples = await self.manager.generate_group(ids, self.group_size, gid,
                                                        max_new_tokens=row_budget(prompt, self.group_size))
            if any(s.error for s in samples):
                self.counts["groups_failed"] += 1
                if all(not slot.healthy for slot in self.manager.slots):  # nothing left to retry on
                    raise RuntimeError(f"every engine is down ({[s.client.url for s in self.manager.slots]}); "
                                       f"last error: {next(s.error for s in samples if s.error)}")
                self._add_credits(1)
                return
            await self._score(prompt, samples)
        except Exception as e:
            self.error = e

    async def _episode_group(self, prompt: Prompt, gid: int) -> None:
        """A group of multi-turn episodes; rewards come from the environment, not ``reward.fn``."""
        samples = await self.episodes.run_group(prompt, self.group_size, gid)
        if any(s.error for s in samples):
            dropped = any(s.metadata.get("env_dropped") for s in samples)  # the environment failed, not an engine
            self.counts["groups_env_dropped" if dropped else "groups_failed"] += 1
            if not dropped and all(not slot.healthy for slot in self.manager.slots):
                raise RuntimeError(f"every engine is down ({[s.client.url for s in self.manager.slots]}); "
                                   f"last error: {next(s.error for s in samples if s.error)}")
            self._add_credits(1)
            return
        await self._score(prompt, samples)

    async def _score(self, prompt: Prompt, samples: list) -> None:
        """Score a finished group and buffer it, unless its score was dropped (a sample is never trained
        without its score) or it carries no signal under dynamic sampling."""
        texts = [self.tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        group = ScoringGroup(prompt, samples, texts)
        scores = (await self.scorer.score(group)).check(group, self.scorer.name)
        if scores.dropped:
            self.counts["groups_reward_dropped"] += 1
            self._add_credits(1)
            return
        rewards = [float(r) for r in scores.rewards]
        self.counts["reward_errors"] += sum(e is not None for e in scores.errors)
        # a group with token rewards has signal even when its samples' rewards are equal
        if self.dynamic_sampling and max(rewards) == min(rewards) and scores.token_rewards is None:
            self.counts["groups_no_signal"] += 1  # DAPO: zero advantage everywhere, resample
            self._add_credits(1)
            return
        self.buffer.put(Group(prompt, samples, rewards, texts, scores.token_rewards))
        self.counts["groups_buffered"] += 1
