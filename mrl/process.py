"""Process helpers: the local torchrun launcher, parent-death signals and killing a process tree.

When a rank started by ``torchrun`` dies, torchrun stops the others and the launcher ends with one line
naming the rank and how it died, after torchrun's own report; for the RL loop also the checkpoint a rerun
resumes from:

    [mrl] mrl.jobs.train failed: rank 1 (pid 4242) was killed by SIGKILL; torchrun stopped the other ranks.
          Last checkpoint: runs/x/checkpoints/step_2 -- rerun the same command to resume from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from mrl.log import get_logger

log = get_logger(__name__)


@contextlib.contextmanager
def job_sys_path():
    """Import user modules as the job will: its processes run ``python -m ...``, which puts the working
    directory first on ``sys.path`` (the ``mrl`` script's own path starts at its bin directory)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def die_with_parent() -> None:
    """The calling process gets SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)


def become_subreaper() -> None:
    """Orphaned descendants of the calling process are handed to it rather than to PID 1
    (Linux ``PR_SET_CHILD_SUBREAPER``). An engine's server dies at once on a stop, before it could reap
    its scheduler and detokenizer; without this they would wait as zombies for PID 1, which in a container
    is often not an init that reaps them (they pile up, and a check for leftover engines sees them)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(36, 1)


def reap_zombies(session: int | None = None, timeout: float = 5.0) -> list[int]:
    """Reap the zombie children of this process (those in ``session`` only, when given); their pids.
    A process shows as a zombie when its main thread has exited, but can be reaped only once its other
    threads have too: psutil's wait retries until ``timeout``. Only processes no ``Popen`` owns are ever
    in a session other than the one each ``Popen`` leads, so reaping a session never takes an exit
    status a ``Popen.wait`` still expects; unscoped, call it only when no ``Popen`` of this process is left."""
    import psutil

    zombies = []
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE and (
                    session is None or (os.getsid(child.pid) == session and child.pid != session)):
                zombies.append(child)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    gone, _ = psutil.wait_procs(zombies, timeout=timeout)
    return [p.pid for p in gone]


_SPAWNER: ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()


def on_lasting_thread(fn):
    """Call ``fn`` (a ``Popen`` whose child uses :func:`die_with_parent`) on a thread that lasts as long as
    this process: the parent-death signal follows the *thread* that forked the child, so a child started
    from a short-lived helper thread (a health watcher restarting a server on a fresh port) would be
    killed when that thread ends. The main thread lasts; any other caller hands ``fn`` to one spawner
    thread kept for the process's life."""
    global _SPAWNER
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mrl-spawner")
    return _SPAWNER.submit(fn).result()


# torchrun's agent, run in-process so that its ChildFailedError (which ranks failed, and how) is ours to report
_AGENT = "import sys; from mrl.process import agent_main; sys.exit(agent_main(sys.argv[1:]))"


def ignore_usr1() -> None:
    """For a child that has no use for SIGUSR1 (an engine, the rollout process): under Slurm, srun hands a
    USR1 (the warning before a preemption) to every process of the step, and its default action would end
    the child while the ranks checkpoint. Ignored dispositions survive exec, so the child's own children
    (SGLang's scheduler, reward workers) ignore it too. May run between fork and exec."""
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    except ValueError:  # forked from a thread other than the main one: block it instead (also inherited)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


class Terminated(BaseException):
    """SIGTERM or SIGHUP to the launcher: raised like KeyboardInterrupt for SIGINT, so that the job is ended."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum: int, _frame) -> None:
    raise Terminated(signum)


def _forward_usr1(agent: subprocess.Popen | int):
    """SIGUSR1 (Slurm's warning before a preemption) goes to the ranks, torchrun's direct children (``agent``:
    its process or pid): they checkpoint and exit (``mrl.trainer.loop``); the default action would end the launcher
    or the agent alone. A rank that gets it twice (from srun and from here) checkpoints once."""
    pid = agent if isinstance(agent, int) else agent.pid

    def handler(_signum, _frame) -> None:
        import psutil

        try:
            ranks = psutil.Process(pid).children()
        except psutil.NoSuchProcess:
            return
        for p in ranks:
            try:
                p.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                pass
    return handler


def torchrun(module: str, args: list[str], nproc: int, *, timeout: float | None = None, capture: bool = True,
             cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m module`` on ``nproc`` local ranks. A timeout, Ctrl-C, SIGTERM or SIGHUP kills the
    launcher and every process under it (ranks, rollout process, engines): no orphans keep ports or cores.
    SIGUSR1 is passed on to the ranks."""
    if os.environ.get("PET_NNODES"):  # a Slurm trainer node: torchrun reads the multi-node rendezvous
        # (PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR/PORT) from the environment
        cmd = [sys.executable, "-c", _AGENT, "-m", module, *args]
    else:
        cmd = [sys.executable, "-c", _AGENT, "--standalone", f"--nproc-per-node={nproc}", "-m", module, *args]
    if not capture:
        log.info("torchrun %s", " ".join(cmd[3:]))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    pipe = subprocess.PIPE if capture else None
    # The agent has a session of its own (so does each rank, and each engine): a signal to the launcher
    # reaches none of them. Handlers first, so no signal falls between the start and the try.
    handlers = {signal.SIGTERM: _raise_terminated, signal.SIGHUP: _raise_terminated}
    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    old = {sig: signal.signal(sig, h) for sig, h in handlers.items()} if main_thread else {}
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, cwd=cwd, start_new_session=True)
        if main_thread:
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, _forward_usr1(proc))
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # timeout, Ctrl-C, SIGTERM, SIGHUP: take the workers down with the launcher
            kill_tree(proc.pid)
            out, err = proc.communicate()
            if isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise TimeoutError(f"{module} timed out after {timeout}s:\n{(err or '')[-3000:]}")
            raise
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL torchrun's agent and every process under it: the workers run in sessions of their own (torch
    elastic starts them so), so killing the agent's process group alone would leave them running."""
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=10)


def agent_main(argv: list[str]) -> int:
    """``torchrun argv...``; on a failed rank, torchrun's report and then a summary line (stderr), exit 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    # the ranks (this agent's children) checkpoint on USR1; the agent passes one on rather than die of it
    signal.signal(signal.SIGUSR1, _forward_usr1(os.getpid()))
    try:
        run(args)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        module = args.training_script if args.module else os.path.basename(args.training_script)
        try:
            world = int(args.nproc_per_node) * int(str(args.nnodes).split(":")[-1])
        except ValueError:  # "gpu", "auto", ...
            world = None
        log.error("%s%s", failure_summary(module, e.failures, world), resume_hint(module, args.training_script_args))
        return 1
    return 0


def failure_summary(module: str, failures: dict, world_size: int | None = None) -> str:
    """One sentence from torchrun's ``{global rank: ProcessFailure}``, first failure first."""
    ranks = sorted(failures, key=lambda r: (failures[r].timestamp, r))
    parts = []
    for r in ranks:
        f = failures[r]
        if f.exitcode < 0:
            parts.append(f"rank {r} (pid {f.pid}) was killed by {f.signal_name()}")
        else:
            parts.append(f"rank {r} (pid {f.pid}) exited with code {f.exitcode} (its error is above)")
    rest = "; torchrun stopped the other ranks" if world_size is None or len(failures) < world_size else ""
    return f"{module} failed: {'; '.join(parts)}{rest}."


TRAIN_MODULE = "mrl.jobs.train"  # the rank entry point of the RL loop
LOOP_STATE_FILE = "loop_state.json"  # in <run_dir>/checkpoints/step_N, written last: the checkpoint is complete


def resume_hint(module: str, args: list[str]) -> str:
    """For the loop's ``<run_dir>/config.yaml``: where a rerun resumes (``mrl.trainer.state.latest_checkpoint``)."""
    if module != TRAIN_MODULE or not args or not os.path.isfile(args[0]):
        return ""
    import yaml

    with open(args[0]) as f:
        cfg = yaml.safe_load(f)
    root = os.path.join(cfg["run_dir"], "checkpoints")
    done = sorted((d for d in (os.listdir(root) if os.path.isdir(root) else [])
                   if os.path.isfile(os.path.join(root, d, LOOP_STATE_FILE))), key=lambda d: int(d.split("_")[-1]))
    if not done:
        return f"\n      No checkpoint in {root} yet (train.save_every): a rerun starts from the beginning."
    if not cfg.get("train", {}).get("resume", True):
        return f"\n      Last checkpoint: {os.path.join(root, done[-1])} (train.resume=false: a rerun ignores it)."
    return f"\n      Last checkpoint: {os.path.join(root, done[-1])} -- rerun the same command to resume from it."


def open_files(pids: list[int], prefix: str) -> set[str]:
    """The paths starting with ``prefix`` that any of ``pids`` holds open (from ``/proc``; processes
    gone or not ours are skipped)."""
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                out.add(target)
    return out


def child_setup(cpus: list[int] | None):
    """``preexec_fn`` for a child that must die with this process (and optionally keep to ``cpus``)."""

    def setup() -> None:  # runs in the child between fork and exec
        die_with_parent()
        ignore_usr1()
        if cpus:
            os.sched_setaffinity(0, cpus)  # inherited by the scheduler/detokenizer processes

    return setup
