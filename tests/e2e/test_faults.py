"""Faults injected into ``mrl train`` itself (real SGLang engines, Megatron trainer ranks), and what survives.

- engines SIGKILLed mid-rollout and mid-sync (between two buckets of a multi-bucket push), in one run:
  their requests move to the survivor, the sender tears the broken group down so the survivor stops
  waiting in it, each sync drops the dead, rebuilds the groups and pushes again, every step is done, no
  sample is lost, and the survivor serves the trainer's weights;
- an engine SIGKILLed, then (once its replacement joined) the other SIGSTOPped -- hung: its port still
  accepts connections, nothing answers -- in one run: each is dropped, killed for good (no process of the
  hung one is left while the job goes on) and replaced, the replacements join and serve, no sample is lost;
- a trainer rank SIGKILLed after the first checkpoint: the job exits non-zero within seconds, one line names
  the rank, the signal and the checkpoint, no engine process is left. (That the same command resumes from
  the newest checkpoint is run under real Slurm, tests/slurm/test_real_slurm.py, and bit for bit in
  tests/distributed/test_resume.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")
FAULT = "fault injection (kill engine during sync"  # what tests.jobs.train_with_faults prints when it kills
QUICK = ["train.sft_warmup_steps=0", "train.eval_every=0", "train.prompts_per_step=4"]
N = 4  # rollout.n_samples_per_prompt of conf/rollout/default.yaml

pytestmark = pytest.mark.reliability


def _start(run, *overrides, kill_during_sync: str | None = None, env: dict | None = None) -> subprocess.Popen:
    """``mrl train`` (``env`` added to the environment); with ``kill_during_sync``
    (``<version>[:<engine>[:<broadcast>]]``) through the test entry point that kills an engine inside that
    weight sync (``tests/jobs/train_with_faults.py``)."""
    os.makedirs(run, exist_ok=True)
    cmd = [MRL] if kill_during_sync is None else [
        sys.executable, "-m", "tests.jobs.train_with_faults", "--kill-engine-during-sync", kill_during_sync]
    return subprocess.Popen([*cmd, "train", f"run_dir={run}", *overrides], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=open(os.path.join(run, "stdout.txt"), "w"),
                            stderr=open(os.path.join(run, "stderr.txt"), "w"), text=True)


def _finish(proc: subprocess.Popen, run, timeout: float = 900) -> tuple[int, str, str]:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:  # Ctrl-C: the launcher kills its whole tree (mrl.process.torchrun)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return proc.returncode, open(os.path.join(run, "stdout.txt")).read(), open(os.path.join(run, "stderr.txt")).read()


def _steps(run) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    rows = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
    return [r for r in rows if "step_seconds" in r]


def _wait_for(proc, cond, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"mrl train exited ({proc.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.2)


def _engine_pgid(run, name: str) -> int:
    """Process group of the SGLang server behind ``<run_dir>/engines/<name>.log`` (found by its port)."""
    log = open(os.path.join(run, "engines", f"{name}.log")).read()
    port = re.search(r"--port (\d+)", log).group(1)
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang.launch_server" in " ".join(cmd) and port in cmd:
            return os.getpgid(p.info["pid"])
    raise AssertionError(f"no server process for {name} (port {port})")


def _samples(last: dict, steps: int) -> dict:
    """Sample accounting at the last step: every group that reached the buffer was trained, dropped as
    stale (counted) or is still buffered; ``lost`` is what is none of these, plus samples that failed."""
    trained = steps * 4 * N
    dropped = last["dropped_stale"] * N
    lost = (last["rollout/groups_buffered"] * N - trained - dropped - last["buffered"] * N
            + last["rollout/samples_failed"])
    return {"generated": last["rollout/samples_completed"], "trained": trained, "dropped": dropped,
            "failed": last["rollout/samples_failed"], "retried": last["rollout/retries"], "lost": lost}


def _nothing_lost(steps: list[dict]) -> dict:
    """The run's sample accounting (``_samples``), asserting that no sample failed and none was lost."""
    last = steps[-1]
    assert last["rollout/samples_failed"] == 0 and last.get("rollout/groups_failed", 0) == 0, last
    samples = _samples(last, len(steps))
    assert samples["lost"] == 0, samples
    return samples


def _kill_engine_at_step_2(proc, run, name: str) -> tuple[float, int]:
    """SIGKILL engine ``name``'s process group from outside the job once step 2 is logged; (when, last step)."""
    _wait_for(proc, lambda: any(r["step"] >= 2 for r in _steps(run)), "step 2")
    t_kill = time.time()
    os.killpg(_engine_pgid(run, name), signal.SIGKILL)
    return t_kill, max(r["step"] for r in _steps(run))


def _assert_engines_hold_trainer_weights(steps: list[dict]) -> None:
    """``train.max_staleness=0``: every trained token was stamped with the trainer's current version, so
    engine logprobs equal to the trainer's at every step mean the engines really hold its weights."""
    for r in steps:
        assert set(r["staleness_hist"]) == {"0"}, r
        assert r["logprob_diff_replay_on"] < 1e-5, r


def test_engines_killed_mid_rollout_and_between_buckets_are_survived(tmp_path, reliability):
    """Three engines, two faults in one run (one start-up for both):

    - mid-rollout: engine2's process group is SIGKILLed from outside once step 2 is logged; its requests
      go to the others, the next sync finds it dead (refused connection) and drops it;
    - mid-sync, between two buckets: ``--kill-engine-during-sync 5:1:1`` (``tests/jobs/train_with_faults.py``)
      SIGKILLs engine1 inside the sync to v5 (five buckets: ``weight_sync.bucket_mb=0.25``), after bucket 0
      reached both engines and right before the trainer's broadcast of bucket 1. That broadcast fails; the
      sender tears its group down at once, so the survivor, which waits in that group for buckets 1..4,
      fails them within moments instead of blocking for SGLang's 30-minute group default. The sync drops
      the dead engine, rebuilds the groups and pushes again; its in-flight rollouts (overlap mode) move to
      engine0.

    ``max_staleness=0``: every trained token comes from an engine stamped with the trainer's current
    version, and rewards by length move the weights every step -- so engine logprobs equal to the
    trainer's at every step mean the survivor really holds the trainer's weights."""
    run = tmp_path / "kills"
    proc = _start(run, "engine.count=3", "train.steps=6", "train.max_staleness=0", "engine.max_restarts=0",
                  "weight_sync.bucket_mb=0.25", "weight_sync.timeout_s=60",
                  "reward.fn=tests.e2e.reward_fns.response_length", *QUICK, kill_during_sync="5:1:1")
    t_kill, killed_at = _kill_engine_at_step_2(proc, run, "engine2")
    rc, out, err = _finish(proc, run)
    assert rc == 0, err[-5000:]
    line = next(x for x in out.splitlines() if FAULT in x)
    assert "before broadcast 1 of weight sync v5" in line, line
    steps = _steps(run)
    assert [r["step"] for r in steps] == list(range(1, 7))
    alive = [int(r["engines_alive"]) for r in steps]
    assert alive[:2] == [3, 3] and alive[4:] == [1, 1] and steps[-1]["engines_dropped"] == 2, alive
    _assert_engines_hold_trainer_weights(steps)
    assert all(r["grad_norm"] > 0.1 for r in steps), steps  # rewards by length: the weights move every step
    # the failed push ended in moments: well inside one bucket's limit, nowhere near 30 minutes
    assert steps[4]["sync_seconds"] < 60, steps[4]
    samples = _nothing_lost(steps)
    first_drop = alive.index(2) if 2 in alive else 4
    reliability.record(
        category="fault", name="engine SIGKILLed mid-rollout", survived=True, samples=samples,
        injected="SIGKILL to the process group of 1 of 3 SGLang engines once step 2 is logged (outside the job)",
        expected="its requests retried on the others; dropped at the next weight sync; run completes",
        message=f"dropped at the sync of step {first_drop + 1} (engines_alive {alive[first_drop - 1]} -> "
                f"{alive[first_drop]}); no error surfaced",
        details={"killed_during_step": killed_at + 1})
    reliability.record(
        category="fault", name="engine SIGKILLed mid-sync, between two buckets", survived=True, samples=samples,
        injected="kill engine during sync 5:1:1: SIGKILL 1 of the 2 engines left inside the sync to v5, before "
                 "broadcast 1 of 5 (weight_sync.bucket_mb=0.25)",
        expected="the sender tears the broken group down (the survivor's waits fail at once); engine dropped, "
                 "groups rebuilt, survivor re-pushed and stamped, run completes",
        message=line.strip().split("): ")[-1],
        details={"sync_seconds_with_fault": round(steps[4]["sync_seconds"], 3),
                 "sync_seconds_median": round(sorted(r["sync_seconds"] for r in steps)[3], 3),
                 "max_abs_logprob_diff_engine_vs_trainer": max(r["logprob_diff_replay_on"] for r in steps),
                 "requests_moved_to_survivors": steps[-1]["rollout/engine_failures"],
                 "run_seconds_after_first_kill": round(time.time() - t_kill, 1)})


def _group_pids(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid:
                out.append(p.info["pid"])
        except ProcessLookupError:
            continue
    return out


def test_dead_engine_is_restarted_and_rejoins(tmp_path, reliability):
    """Two engines; engine1's process group is SIGKILLed from outside at step 2. The next sync drops it and
    starts a replacement (same server, new port); once healthy it joins at a sync -- new groups, the current
    weights pushed -- and then serves rollouts (``max_staleness=0``: engine logprobs equal the trainer's).

    Then, in the same run, engine0's process group is SIGSTOPped: hung, its port still accepting
    connections. Its requests are abandoned after the liveness probe (``weight_sync.probe_timeout_s``)
    fails -- by the drain's abort or the rollout side's own probe -- and resume on the replacement; the
    sync judges it dead, drops it, kills its whole group (checked while the job runs) and starts a second
    replacement, which joins and serves too. A replacement boots in 30 s on an idle box and minutes on a
    loaded one, so the run does not end after a fixed number of steps: once the second replacement has
    served two steps, SIGTERM to ``mrl train`` must end every process of the job within 30 s -- the
    ranks, the rollout process and the engines, replacements included, which run in sessions of their
    own, so the launcher must end them itself."""
    run = tmp_path / "restart"
    proc = _start(run, "engine.count=2", "train.steps=400", "train.max_staleness=0",
                  "weight_sync.probe_timeout_s=5", "reward.fn=tests.e2e.reward_fns.response_length", *QUICK)
    t_kill, killed_at = _kill_engine_at_step_2(proc, run, "engine1")

    def served_two_steps(drops: int) -> bool:  # the replacement after the drops-th drop joined 2 steps ago
        rows = _steps(run)
        first = next((i for i, r in enumerate(rows) if r["engines_dropped"] >= drops), None)
        if first is None:
            return False
        back = next((i for i in range(first, len(rows)) if rows[i]["engines_alive"] == 2), None)
        return back is not None and len(rows) - back >= 3

    _wait_for(proc, lambda: served_two_steps(1), "the replacement of engine1 serving", timeout=900)
    pgid = _engine_pgid(run, "engine0")
    hung_pids = _group_pids(pgid)
    t_stop = time.time()
    os.killpg(pgid, signal.SIGSTOP)
    stopped_at = max(r["step"] for r in _steps(run))
    _wait_for(proc, lambda: any(r["engines_dropped"] >= 2 for r in _steps(run)), "the hung engine's drop",
              timeout=300)
    t_drop = time.time()
    time.sleep(1)  # the kill is done by the time the step is logged; a moment for the kernel to reap
    left = [p for p in hung_pids if _pid_alive(p)]
    assert not left and proc.poll() is None, f"processes of the hung engine left while the job runs: {left}"
    _wait_for(proc, lambda: served_two_steps(2), "the replacement of engine0 serving", timeout=900)
    tree = _descendants(proc)
    cmds = [_cmdline(p) for p in tree]
    assert sum("sglang.launch_server" in c for c in cmds) == 2, cmds  # the two replacements
    assert any("mrl.rollout.service" in c for c in cmds) and any("mrl.jobs.train" in c for c in cmds), cmds
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc, out, err = _finish(proc, run, timeout=30)
    _, alive = psutil.wait_procs(tree, timeout=max(0.1, 30 - (time.monotonic() - t_term)))
    took = time.monotonic() - t_term
    left = [f"{p.pid}: {_cmdline(p)[:120]}" for p in alive if _alive(p)]
    assert not left, f"processes of the job left 30 s after SIGTERM: {left}"
    assert rc == 128 + signal.SIGTERM, (rc, err[-3000:])
    assert "[mrl] stopped by SIGTERM: every process of the job was ended" in err, err[-2000:]
    steps = _steps(run)
    alive = [int(r["engines_alive"]) for r in steps]
    dropped = alive.index(1)
    assert alive[:killed_at] == [2] * killed_at and 1 in alive, alive
    rejoined = next(i for i in range(dropped, len(alive)) if alive[i] == 2)  # step index of the joining sync
    hung_dropped = next(i for i, r in enumerate(steps) if r["engines_dropped"] >= 2)
    assert all(a == 2 for a in alive[rejoined:hung_dropped]) and alive[hung_dropped] == 1, alive
    rejoined2 = next(i for i in range(hung_dropped, len(alive)) if alive[i] == 2)
    assert all(a == 2 for a in alive[rejoined2:]), alive
    assert steps[-1]["engines_restarted"] == 2 and steps[-1]["engines_restart_failed"] == 0
    served = steps[-1]["rollout/served_by_engine"]
    replacement, replacement2 = (next(u for u in served if u not in served_before(steps, i))
                                 for i in (rejoined, rejoined2))
    assert served[replacement] > 0 and served[replacement2] > 0, served  # they took requests after joining
    line = [x for x in err.splitlines() if "dropped: " in x][-1]  # a warning; the hung engine's: the second drop
    assert "liveness probe failed" in line and "(no answer)" in line, line  # silent, not refused
    _assert_engines_hold_trainer_weights(steps)  # the replacements included, once they joined
    samples = _nothing_lost(steps)
    reliability.record(
        category="fault", name="engine SIGKILLed and restarted", survived=True, samples=samples,
        injected="SIGKILL to the process group of 1 of 2 SGLang engines once step 2 is logged (outside the job)",
        expected="dropped at the next sync; a replacement starts, joins at a sync once healthy (groups rebuilt, "
                 "weights pushed) and serves rollouts; run completes",
        message=f"dropped at the sync of step {dropped + 1}, replacement joined at the sync of step {rejoined + 1}",
        details={"killed_during_step": killed_at + 1,
                 "seconds_from_drop_to_rejoin": round(
                     steps[rejoined]["wall_seconds"] - steps[dropped]["wall_seconds"], 1),
                 "requests_served_by_replacement": served[replacement],
                 "run_seconds_after_kill": round(time.time() - t_kill, 1)})
    reliability.record(
        category="fault", name="engine SIGSTOPped (hung) and restarted", survived=True, samples=samples,
        injected="SIGSTOP to the process group of 1 of 2 SGLang engines (outside the job) once the first "
                 "replacement serves; weight_sync.probe_timeout_s=5",
        expected="its requests abandoned after a failed liveness probe and retried on the other; dropped at the "
                 "next sync, its process group SIGKILLed, a replacement joins and serves; run completes",
        message=re.sub(r"http://[\w.:-]+", "http://<engine>", line.split("[mrl] ", 1)[-1].strip()),
        details={"stopped_during_step": stopped_at + 1, "dropped_at_the_sync_of_step": hung_dropped + 1,
                 "seconds_from_stop_to_drop_logged": round(t_drop - t_stop, 1),
                 "hung_engine_processes_left_after_drop": len(left),
                 "replacement_joined_at_the_sync_of_step": rejoined2 + 1,
                 "requests_served_by_its_replacement": served[replacement2]})
    reliability.record(category="fault", name="SIGTERM to mrl train", survived=True,
                       injected="SIGTERM to `mrl train` after two engine replacements (2 engines, 1 rank, rollout "
                                "process)",
                       expected="every process of the job ends within 30 s",
                       message=f"{len(tree)} processes (rank, rollout process, SGLang engines and their children) "
                               f"ended in {took:.1f} s; exit {rc}")


def served_before(steps: list[dict], i: int) -> set[str]:
    return set(steps[i - 1]["rollout/served_by_engine"])


def _descendants(proc) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _rank_pid(proc, rank: int) -> int:
    for p in _descendants(proc):
        try:
            if "mrl.jobs.train" in _cmdline(p) and p.environ().get("RANK") == str(rank):
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no trainer rank {rank} among the job's processes")


@pytest.mark.parametrize("victim_rank", [1, 0])
def test_trainer_rank_killed_exits_clearly_naming_the_checkpoint(tmp_path, reliability, victim_rank):
    """EP2 trainer (2 ranks), checkpoint every 2 steps; one rank is SIGKILLed once step_2 exists. Rank 0 is
    also the controller: it holds the engines and the rollout process, which must not outlive it."""
    run = tmp_path / "rank"
    args = ["parallel=ep2", "train.steps=4", "train.save_every=2", *QUICK]
    proc = _start(run, *args)
    ckpt = run / "checkpoints" / "step_2"
    _wait_for(proc, lambda: (ckpt / "loop_state.json").exists(), "checkpoint step_2")
    engines = [p for p in _descendants(proc) if "sglang" in _cmdline(p)]
    assert engines, "no engine process found under the job"
    rollout = [p for p in _descendants(proc) if "mrl.rollout.service" in _cmdline(p)]
    assert len(rollout) == 1, "no rollout process under the job"
    under_job = _descendants(proc)  # ranks, engines, the rollout process, megatron's checkpoint writer
    victim = _rank_pid(proc, victim_rank)
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    rc, _, err = _finish(proc, run, timeout=120)
    exit_s = time.time() - t_kill
    assert rc != 0 and exit_s < 60, (rc, exit_s)
    line = next(x for x in err.splitlines() if x.startswith("[mrl] mrl.jobs.train failed"))
    assert f"rank {victim_rank} (pid {victim}) was killed by SIGKILL" in line, line
    newest = max((d for d in os.listdir(run / "checkpoints") if (run / "checkpoints" / d / "loop_state.json").exists()),
                 key=lambda d: int(d.split("_")[1]))
    assert f"Last checkpoint: {run / 'checkpoints' / newest} -- rerun the same command to resume" in err
    time.sleep(2)  # engines die with their launcher (parent-death signal): give the kernel a moment
    alive = [p.pid for p in engines + rollout if _alive(p)]
    assert not alive, f"engine or rollout processes survived the trainer: {alive}"
    left = [(p.pid, _cmdline(p)[:120]) for p in under_job if _alive(p)]
    assert not left, f"processes of the job survived it: {left}"
    done_before = max(r["step"] for r in _steps(run))
    # the steps done before the kill: EP2 (DP2) sums the mismatch split over both DP ranks, and the tokens
    # sampled by the trainer's own weights match the engine's exactly (fp32, replay on)
    exact = [r for r in _steps(run) if r["mismatch/numerics_tokens"] > 0]
    assert exact and all(r["mismatch/numerics_kl"] <= 1e-6 and r["mismatch/numerics_logprob_diff"] <= 1e-6
                         for r in exact), _steps(run)

    reliability.record(
        category="fault", name=f"trainer rank {victim_rank} SIGKILLed", survived=True,
        message=(line + " " + err.split("[mrl] mrl.jobs.train failed")[1].split("\n")[1].strip()).replace(
            str(run), "<run_dir>"),
        injected=f"SIGKILL to trainer rank {victim_rank} of 2 (parallel=ep2) after checkpoint step_2",
        expected="job exits non-zero naming rank, signal and the checkpoint to resume from; no engine or rollout "
                 "process left",
        details={"exit_seconds_after_kill": round(exit_s, 1), "steps_done_before_kill": done_before})
