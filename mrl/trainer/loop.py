"""The RL loop, one process per trainer rank (``mrl train`` starts them with torchrun, entering through
``mrl.jobs.train``).

    loop = Loop(cfg)      # model, optimizer, the checkpoint to resume from, rank 0's metrics log
    loop.run()            # warm start, engines + rollout process, then per step:
                          # take batch, train step, maybe sync weights, log, maybe checkpoint
                          # (each part a phase of the step's time: ``mrl.trainer.phases``)

    rank 0 (``Controller``)                          every rank
    ───────────────────────                          ──────────
    engines (started here, or attached by URL)
    rollout process: prompts -> groups -> rewards -> buffer
    take a batch (staleness bound) -> advantages ──▶ RL step: replayed routes, policy loss, optimizer
                                                     every N steps: weight sync -> version + 1

Generation never waits for training (``train.mode=overlap``): engines keep generating while the
trainer computes; a sync pauses them briefly (in-flight requests are aborted and resumed on the new
weights; each token keeps the version that produced it). ``train.mode=sync`` is the baseline:
generate one batch, train, sync, repeat.

LoRA runs (``model.lora.rank > 0``) train adapters only; the engines keep their base weights and get each
version as an adapter (``AdapterChannel``: no weight-update group, no pause, no drain), and the run ends
by writing the final adapter as a PEFT directory (``run_dir/adapter``).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from mrl.config.lora_engine import lora_engine_spec
from mrl.config.schema import Config, LoopMode, WeightTransport
from mrl.sglang.endpoint import EngineEndpoint
from mrl.log import get_logger
from mrl.megatron import compat
from mrl.megatron.batch_scatter import BatchScatter
from mrl.megatron.collectives import broadcast_object
from mrl.megatron.export import save_hf_due
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy, RLBatch
from mrl.megatron.warm_up import warm_up
from mrl.models.checkpoint import check_tokenizer
from mrl.models.peft import save_peft
from mrl.trainer.async_save import AsyncCheckpoints
from mrl.trainer.controller import Controller, OtherRank, RankDuties, restarts_engines
from mrl.trainer.engines import RunEngines
from mrl.trainer.phases import StepPhases
from mrl.trainer.state import LoopState, checkpoint_dir, latest_checkpoint, read_loop_state
from mrl.trainer.warm_start import sft_warmup
from mrl.weight_sync.channel import WeightChannel
from mrl.weight_sync.adapter import AdapterChannel
from mrl.weight_sync.checks import check_finite_weights, verify_engines
from mrl.weight_sync.factory import make_transport
from mrl.weight_sync.full import FullWeightChannel
from mrl.startup import StartupClock

log = get_logger(__name__)


class NonFiniteUpdates(RuntimeError):
    """``train.max_nonfinite_steps`` optimizer steps in a row were skipped for a non-finite loss or gradient."""


class NonFiniteSteps:
    """Counts the RL steps whose update was skipped (``Policy.rl_step``: a non-finite loss or gradient on
    some rank); ``limit`` of them in a row stop the run (0 = never)."""

    def __init__(self, limit: int):
        self.limit, self.total, self.in_a_row = limit, 0, 0

    def update(self, step: int, m: dict) -> dict:
        if m.get("nonfinite_update"):
            self.total += 1
            self.in_a_row += 1
        else:
            self.in_a_row = 0
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteUpdates(
                f"train.max_nonfinite_steps={self.limit}: steps {step - self.in_a_row + 1}-{step} all had a non-finite "
                "(NaN/Inf) loss or gradient on some trainer rank and were skipped, so the weights have not changed "
                f"since step {step - self.in_a_row}; look at the rewards and advantages of these steps, or lower "
                "algo.lr. The last checkpoint holds finite weights: rerun to resume from it.")
        return {"nonfinite_steps": float(self.total)}


def _keep_off_engine_cores(cfg: Config) -> None:
    """CPU mode with ``engine.cpus``: trainer ranks run on the other cores (if any are left)."""
    eng = cfg.engine
    if eng.cpu_mode and eng.cpus and not (eng.urls or eng.url_dir):
        rest = sorted(os.sched_getaffinity(0) - set(eng.cpus))
        if rest:
            os.sched_setaffinity(0, rest)


class Loop:
    """The RL loop on one trainer rank. Rank 0's extra work (engines, rollout process, metrics) sits
    behind ``self.duties``; every rank runs the same steps and collectives."""

    def __init__(self, cfg: Config, engines: RunEngines | None = None):
        """``engines``: rank 0's, started early by the job (``mrl.jobs.train``); None: the controller starts
        them when the loop connects to them."""
        self.cfg, t = cfg, cfg.train
        self.clock = StartupClock()  # rank 0's marks go into its first step's metrics
        self.clock.mark("trainer_imported")
        self.hf_path = cfg.model.hf_path
        _keep_off_engine_cores(cfg)
        self.layout = init_parallel(cfg.parallel, seed=cfg.seed)
        self.clock.mark("parallel_ready")
        self.policy = Policy(cfg, self.layout, self.hf_path)
        hc = self.policy.bridge.hf_config  # the loop encodes prompts with this model's tokenizer: a mismatch fails here
        check_tokenizer(self.hf_path, vocab_size=self.policy.bridge.vocab_size, special_ids={
            k: getattr(hc, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
        self.state = LoopState()
        ckpt = latest_checkpoint(cfg) if t.resume else None
        if ckpt:
            self.policy.load(ckpt)
            self.state = read_loop_state(ckpt)
            log.info("resuming from %s (step %d of %d)", ckpt, self.state.step, t.steps)
        self.clock.mark("policy_ready")
        self.step, self.version = self.state.step, self.state.version
        self.preempted = False
        signal.signal(signal.SIGUSR1, self._on_usr1)  # Slurm: checkpoint + requeue
        self.duties: RankDuties = (Controller(cfg, self.state, engines, clock=self.clock) if self.layout.world_rank == 0
                                   else OtherRank())
        self.syncer: WeightChannel | None = None
        self.phases = StepPhases()  # opened again as the loop starts
        self.nonfinite = NonFiniteSteps(t.max_nonfinite_steps)
        self.saves = AsyncCheckpoints(self._complete_checkpoint) if t.async_save else None
        # each step's batch goes from rank 0 to each rank as its DP rank's share only
        self.batches = BatchScatter(dp_rank=self.layout.dp.rank, dp_size=self.layout.dp.size, group=dist.group.WORLD)

    def run(self) -> int:
        t = self.cfg.train
        self.warm_start()
        self.clock.mark("warm_started")
        self.connect_engines()
        t_loop = time.monotonic()
        self.phases = phases = StepPhases()
        try:
            while self.step < t.steps:
                with phases.timed("wait"):
                    batch, normalizer, info = self.take_batch()
                self.clock.mark("first_batch")
                m = self.train_step(batch, normalizer) | info
                m |= self.nonfinite.update(self.step + 1, m)
                self.step += 1
                if self.step % self.cfg.weight_sync.every_n_steps == 0:
                    m |= self.sync_weights()
                m |= self._first_step_marks()
                m |= phases.close() | {"version": self.version}
                with phases.timed("log"):
                    self.duties.log_step(self.step, m, time.monotonic() - t_loop)
                with phases.timed("eval"):  # submission and collection only: generation runs beside training
                    self.duties.maybe_evaluate(self.step, self.version)
                with phases.timed("checkpoint"):
                    save_hf_due(self.cfg, self.policy, self.step)  # train.save_hf(_every): run_dir/hf/final, step_N
                    stop = self.maybe_checkpoint()
                if stop:
                    break
                if t.mode == LoopMode.sync:  # after the checkpoint: nothing is in flight in it
                    self.duties.allow(t.prompts_per_step)
            if self.saves is not None:
                self._report(self.saves.finalize(blocking=True))
            if self.step == t.steps:
                self.write_outputs()
                self.wait_for_evaluations()
        finally:
            self.close()
        return 0

    def warm_start(self) -> None:
        """A fresh run: the supervised warm start, then the KL reference is the policy RL starts from."""
        if self.state.step == 0 and self.cfg.train.sft_warmup_steps:
            sft_warmup(self.cfg, self.policy, self.hf_path, self.duties)
        if self.state.step == 0:
            self.policy.capture_reference()  # algo.kl_coef > 0 only
        wp = self.cfg.train.warmup_pass
        if wp if wp is not None else compat.HAS_CUDA:  # fresh or resumed: a new process pays either way
            warm_up(self.policy)

    def connect_engines(self) -> None:
        """Engines and rollout process (rank 0), the weight-update channels, the engines brought level with
        the trainer's weights, then generation starts."""
        t = self.cfg.train
        endpoints = broadcast_object(self.duties.start_engines(self.hf_path, self.policy, self.state))
        if self.policy.lora is not None:
            self.syncer = self._adapter_channel(endpoints)
        else:
            self.syncer = FullWeightChannel(*self._channels(endpoints), self.layout, endpoints, rebuild=self._channels,
                                            model=self.policy.module, pause_mode=self.cfg.weight_sync.pause_mode.value,
                                            probe_timeout_s=self.cfg.weight_sync.probe_timeout_s)
        self.syncer.connect()
        self.clock.mark("weights_connected")
        if self.state.step > 0 or t.sft_warmup_steps:  # engines start from the HF checkpoint: bring them level
            self.version += 1
            self.syncer.sync(str(self.version))
        self.policy.version.synced(self.version)  # the engines' weights are the trainer's now
        self.verify_engines()
        self.duties.start_producing(t.max_inflight_groups if t.mode == LoopMode.overlap else t.prompts_per_step,
                                    self.state.step, self.version)
        self.clock.mark("generation_started")

    def _first_step_marks(self) -> dict:
        """This process's first step: how long from the launch each start phase took (rank 0 logs them)."""
        if "first_step" in self.clock.marks:
            return {}
        self.clock.mark("first_step")
        log.info("%s", self.clock.summary())
        return self.clock.metrics()

    def _channels(self, engines: list[EngineEndpoint]):
        """Transport + disk repair for ``engines``; also rebuilt without an engine that died (per-run group
        names: never reused)."""
        ws = self.cfg.weight_sync
        return make_transport(
            ws.transport, model=self.policy.model, layout=self.layout, bridge=self.policy.bridge,
            padded_vocab=self.policy.padded_vocab, engines=engines, bucket_bytes=int(ws.bucket_mb * (1 << 20)),
            export_dir=ws.export_dir or os.path.join(self.cfg.run_dir, "weights"), config_src=self.hf_path,
            timeout_s=ws.timeout_s, group_prefix=broadcast_object(f"mrl-{os.urandom(4).hex()}"),
            dtype=self.cfg.engine.dtype, master_address=ws.master_address,
            fp8=self.cfg.engine.quantization == "fp8", fp8_ignore=tuple(self.cfg.engine.fp8_ignore))

    def _adapter_channel(self, engines: list[EngineEndpoint]) -> AdapterChannel:
        """LoRA: versions go to the engines as adapters, over HTTP whatever ``weight_sync.transport`` (``disk``
        has them load each from ``weight_sync.export_dir``); the engines' base weights never change."""
        ws = self.cfg.weight_sync
        export_dir = (ws.export_dir or os.path.join(self.cfg.run_dir, "weights")) \
            if ws.transport == WeightTransport.disk else None
        return AdapterChannel(self.policy, self.layout, engines, spec=lora_engine_spec(self.cfg),
                              timeout_s=ws.timeout_s, probe_timeout_s=ws.probe_timeout_s, export_dir=export_dir,
                              dtype=getattr(torch, self.cfg.engine.dtype), on_loaded=self.duties.set_adapter)

    def take_batch(self) -> tuple[RLBatch, float, dict]:
        """Rank 0 takes ``train.prompts_per_step`` groups within the staleness bound; every rank gets the samples
        its DP rank trains on (``BatchScatter``)."""
        return self.batches.deliver(self.duties.next_batch(self.version), what=f"the step-{self.step + 1} batch")

    def train_step(self, batch: RLBatch, normalizer: float) -> dict:
        """Routing metrics (on the weights the samples are judged by), then the RL step."""
        t, m = self.cfg.train, {}
        if t.replay and t.routing_metrics_every and self.step % t.routing_metrics_every == 0:
            with self.phases.timed("routing"):
                m |= self.policy.routing_metrics(batch)
        with self.phases.timed("train"):
            return m | self.policy.rl_step(batch, normalizer)

    def sync_weights(self) -> dict:
        """The next weight version to the engines: restarted engines join, in-flight requests are drained
        around the push when it pauses the engines (they resume on the new weights), dead engines are
        dropped and replaced."""
        self.version += 1
        joining = broadcast_object(self.duties.joining_engines(), what="the engines joining at this sync") \
            if restarts_engines(self.cfg) else []
        # an adapter push pauses nothing, a retract / in-place pause keeps the requests in the engines: no drain
        drain = self.syncer.pauses_engines and not self.cfg.weight_sync.keeps_requests
        drained = 0
        if drain:
            with self.phases.timed("drain"):
                drained = self.duties.drain()
        try:
            with self.phases.timed("sync"):
                if joining:  # restarted engines: new groups with them; this sync gives them the weights
                    self.syncer.add(joining)
                rep = self.syncer.sync(str(self.version))
                self.policy.version.synced(self.version)
        finally:
            if drain:
                with self.phases.timed("drain"):  # resuming generation: the drain's other half
                    self.duties.undrain()
        with self.phases.timed("verify"):
            m = self.verify_engines()
        m |= self.duties.after_sync(self.syncer.engines, joining, rep.dropped_engines)
        m["sync_aborted_requests"] = float(drained)
        if rep.bytes_sent and rep.bytes_in_place is not None:  # rank 0's buckets: the share sent from its params
            m["sync_in_place_fraction"] = rep.bytes_in_place / rep.bytes_sent
        m |= {f"sync/{k}_seconds": v for k, v in rep.phase_seconds.items()}  # check, pause, push, finish, barrier
        return m | {"sync_bytes": float(rep.bytes_sent),
                    "sync_repaired": float(len(rep.repaired_from_disk)),
                    "engines_alive": float(len(self.syncer.engines)),
                    "engines_dropped": float(len(self.syncer.dropped))}

    def verify_engines(self) -> dict:
        """``weight_sync.verify``: every engine's logprobs of a fixed probe equal the trainer's, within
        ``weight_sync.verify_tol``, or the run stops naming them (``verify_engines``)."""
        ws = self.cfg.weight_sync
        if not (ws.verify if ws.verify is not None else self.cfg.engine.dtype == "float32"):
            return {}
        diffs, unreachable = verify_engines(self.policy.module, self.layout, self.syncer.engines,
                                            vocab_size=self.policy.bridge.vocab_size, tol=ws.verify_tol,
                                            version=str(self.version), seed=self.cfg.seed,
                                            lora_path=self.syncer.adapter, timeout_s=ws.timeout_s)
        return {"sync_verify_max_diff": max(diffs.values(), default=0.0),
                "sync_verify_unreachable": float(len(unreachable))}

    def maybe_checkpoint(self) -> bool:
        """Checkpoint every ``train.save_every`` steps, at the end (``train.save_at_end``), and before
        stopping (SIGUSR1, ``train.stop_after``); whether to stop. With ``train.async_save`` the save is
        scheduled here and completed at a later step's end (or before the next save, or at the run's end)."""
        t = self.cfg.train
        if self.saves is not None:
            self._report(self.saves.finalize(blocking=False))
        stop = broadcast_object(self.preempted or (t.stop_after is not None and self.step >= t.stop_after))
        if stop or (t.save_every and self.step % t.save_every == 0) or (self.step == t.steps and t.save_at_end):
            path = os.path.join(checkpoint_dir(self.cfg), f"step_{self.step}")
            check_finite_weights(self.policy.module, f"checkpoint {path}")
            t0 = time.perf_counter()
            state = LoopState(step=self.step, version=self.version)
            if self.saves is not None:
                self._report(self.saves.finalize(blocking=True))  # one save writing at a time
                self.saves.schedule(self.policy.save(path, async_save=True), path, state, began=t0)
                # a stopping run completes it in run(), as any run at its end
                log.info("checkpoint step_%d: shards staged in %.3g s, writing while training goes on", self.step,
                         time.perf_counter() - t0)
                return stop
            # a large model's save takes minutes: say what the job is doing
            log.info("saving checkpoint %s (optimizer state: %s)", path, t.optimizer_checkpoint)
            self.policy.save(path)
            self._complete_checkpoint(path, state)
            self.duties.checkpoint_written(path, time.perf_counter() - t0, asynchronous=False)
        return stop

    def _complete_checkpoint(self, path: str, state: LoopState) -> None:
        """Every rank's shards of ``path`` are written: rank 0 syncs them and marks the checkpoint. Collective."""
        dist.barrier()
        self.duties.save_loop_state(path, state)
        dist.barrier()

    def _report(self, completed: list[tuple[str, float]]) -> None:
        for path, seconds in completed:
            self.duties.checkpoint_written(path, seconds, asynchronous=True)

    def wait_for_evaluations(self) -> None:
        """The run's end: rank 0 waits for the evaluations still generating (``train.eval_wait_at_end_s``); the
        other ranks wait with it in rounds shorter than a collective's timeout."""
        wait_s = min(60.0, self.cfg.parallel.collective_timeout_s / 2)
        while not broadcast_object(self.duties.finish_evaluations(wait_s), what="the end of the evaluations"):
            pass

    def write_outputs(self) -> None:
        """At the end of a run: a LoRA run's final adapter as a Hugging Face PEFT directory, ``run_dir/adapter``
        (the checkpoints hold it in megatron's sharded format, for resuming). Collective."""
        if self.policy.lora is None:
            return
        out = self.policy.export_lora(dst=0)
        if out is not None:
            save_peft(os.path.join(self.cfg.run_dir, "adapter"), *out)
        dist.barrier()

    def close(self) -> None:
        if self.saves is not None:
            self.saves.abort()  # only a failing run gets here with a save still writing
        if self.syncer is not None:
            self.syncer.close()
        self.duties.close()

    def _on_usr1(self, *_) -> None:
        self.preempted = True


def main(cfg: Config, engines: RunEngines | None = None) -> int:
    code = Loop(cfg, engines).run()
    destroy()
    return code
