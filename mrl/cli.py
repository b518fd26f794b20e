"""``mrl`` command line: each sub-command is a Hydra app over ``conf/``.

    mrl train [overrides...]              the RL loop (tiny model, CPU engine, copy_last task by default)
    mrl check [overrides...]              the preflight of train/launch alone: every input checked, nothing started
    mrl check-model [overrides...]        load the HF checkpoint into megatron, compare with transformers, export back
    mrl engine [overrides...]             start the SGLang engines of engine.* and serve until Ctrl-C
    mrl engine --pool POOL [overrides...]  a scoring pool's share of scoring.POOL's engines on a node of its own
    mrl launch [overrides...] [--dry-run] [--wait]   write the run directory and submit it as a Slurm job
    mrl export CHECKPOINT OUT [--merge]   a trainer checkpoint (any layout) as a Hugging Face checkpoint
    mrl make-tiny-model DIR [--preset P]  write a tiny random Qwen3-MoE checkpoint + tokenizer.json
    mrl export-fp8 SRC DST [--ignore M]   write the block-FP8 (e4m3, 128x128) checkpoint of a bf16/fp32 one
    mrl tune-moe HF_DIR OUT [--dtype D]   tune SGLang's fused-MoE kernel for the model on this GPU
                                          (engine.moe_kernel_configs=OUT)

Hydra flags work after the sub-command (``mrl train --cfg job``, ``parallel=tp2_ep2``, ``+experiment=...``).
``mrl train`` and ``mrl launch`` run the preflight (mrl/preflight.py) first: a bad input ends them with exit
status 2 and one line per failed check, before the run directory is made or any process starts.
"""

from __future__ import annotations

import functools
import os
import sys

from mrl.cluster.rundir import UnsafeRunDir, secure_run_dir
from mrl.config.schema import Config, TinyPreset
from mrl.log import get_logger
from mrl.process import Terminated
from mrl.startup import stamp_launch

log = get_logger(__name__)


def _hydra_app(fn):
    """Run ``fn(Config)`` as a Hydra app over conf/, with the remaining argv as overrides."""
    import hydra
    from hydra.errors import CompactHydraException
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

    from mrl.config.load import to_config
    from mrl.config.moved import MovedKeyError, check_overrides, explain
    from mrl.config.store import CONF_DIR, register

    try:
        check_overrides(sys.argv[1:])
    except MovedKeyError as e:
        print(f"[mrl] invalid config: {e}", file=sys.stderr)
        sys.exit(1)
    register()
    # Hydra reports a composition error itself unless HYDRA_FULL_ERROR is set; set, the error reaches the
    # except below, which names a moved key's new name (a preset or experiment that sets engine.tp).
    # The job's own errors get Hydra's usual report: the variable goes once composition is over.
    own_full_error = "HYDRA_FULL_ERROR" not in os.environ
    if own_full_error:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    started = False

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
    def app(cfg: DictConfig) -> None:
        nonlocal started
        started = True
        if own_full_error:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        try:
            typed = to_config(cfg)
        except ValueError as e:  # a bad value: the field and what is wrong, without a traceback
            log.error("invalid config: %s", e)
            sys.exit(1)  # as Hydra's own composition errors
        os.umask(0o077)  # what the job writes (checkpoints, weights, logs) is this user's alone
        try:
            code = fn(typed)
        except UnsafeRunDir as e:
            log.error("%s", e)
            sys.exit(1)
        except Terminated as e:
            log.error("%s: every process of the job was ended", e)
            sys.exit(128 + e.signum)
        if code:
            sys.exit(code)

    try:
        return app()
    except Exception as e:
        if started:
            raise
        if moved := explain(e):
            print(f"[mrl] invalid config: {moved}", file=sys.stderr)
            sys.exit(1)
        if not own_full_error or not isinstance(e, CompactHydraException):
            raise  # the user asked for full errors, or Hydra would print a traceback too
        print(e, file=sys.stderr)  # as Hydra's own report of a composition error
        if isinstance(e.__cause__, OmegaConfBaseException):
            print(e.__cause__, file=sys.stderr)
        print("\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", file=sys.stderr)
        sys.exit(1)


def ensure_model(cfg: Config) -> str:
    path = cfg.model.hf_path
    if not os.path.isfile(os.path.join(path, "config.json")):
        if not cfg.model.make_tiny_if_missing:
            raise FileNotFoundError(f"model.hf_path={path}: no config.json there "
                                    "(and model.make_tiny_if_missing=false)")
        from mrl.models.tiny import make_tiny_model

        log.info("writing tiny model preset '%s' to %s", cfg.model.tiny_preset.value, path)
        make_tiny_model(path, cfg.model.tiny_preset)
    elif cfg.model.make_tiny_if_missing:
        from mrl.models.tiny import check_preset

        check_preset(path, cfg.model.tiny_preset)
    return path


def trainer_world_size(cfg: Config) -> int:
    return cfg.parallel.local_world_size


def check_model(cfg: Config) -> int:
    secure_run_dir(cfg.run_dir)
    path = ensure_model(cfg)
    p = cfg.parallel
    args = ["--hf", path, "--tp", str(p.tp), "--pp", str(p.pp), "--ep", str(p.ep),
            "--dispatcher", p.dispatcher.value, "--dtype", cfg.model.dtype.value,
            "--out", os.path.join(cfg.run_dir, "check_model.json"),
            "--export", os.path.join(cfg.run_dir, "export_hf")]
    if p.etp is not None:
        args += ["--etp", str(p.etp)]
    from mrl.process import torchrun

    return torchrun("mrl.jobs.check_model", args, trainer_world_size(cfg), capture=False).returncode


PREFLIGHT_FAILED = 2
"""Exit status of a failed preflight (a config that does not compose or validate exits 1, as Hydra's own)."""


def preflight(cfg: Config, where: str | None = None) -> int:
    """Run the preflight; print each failure as one line. 0, or ``PREFLIGHT_FAILED``."""
    from mrl.preflight import LOCAL, run_preflight

    failures = run_preflight(cfg, where or LOCAL)
    for msg in failures:
        log.error("%s", msg)
    return PREFLIGHT_FAILED if failures else 0


def check(cfg: Config) -> int:
    """``mrl check``: the preflight of ``mrl train`` (``mrl launch`` for ``cluster=slurm``), nothing else."""
    from mrl.config.schema import ClusterKind
    from mrl.preflight import LOCAL, SUBMIT, model_state_note

    where = SUBMIT if cfg.cluster.kind == ClusterKind.slurm else LOCAL
    code = preflight(cfg, where)
    if note := model_state_note(cfg, where):  # informative, pass or fail: on stdout, the failures on stderr
        log.info("%s", note)
    if not code:
        log.info("preflight passed: run_dir=%s, model.hf_path=%s", cfg.run_dir, cfg.model.hf_path)
    return code


def train(cfg: Config) -> int:
    """The RL loop (``mrl.trainer.loop``, entered through ``mrl.jobs.train``) on the trainer ranks; rank 0 starts
    the engines."""
    from omegaconf import OmegaConf

    from mrl.process import TRAIN_MODULE, torchrun

    if code := preflight(cfg):
        return code
    secure_run_dir(cfg.run_dir)
    path = ensure_model(cfg)
    if cfg.model.hf_path != path:
        cfg.model.hf_path = path
    from mrl.sglang.keys import ensure_run_secrets

    ensure_run_secrets(cfg.run_dir)  # engine keys: a 0600 file named by $MRL_ENGINE_KEYS_FILE, never the config
    resolved = os.path.join(cfg.run_dir, "config.yaml")
    with open(resolved, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return torchrun(TRAIN_MODULE, [resolved], trainer_world_size(cfg), capture=False).returncode


def make_tiny(argv: list[str]) -> int:
    import argparse

    from mrl.models.tiny import make_tiny_model

    ap = argparse.ArgumentParser(prog="mrl make-tiny-model")
    ap.add_argument("dir")
    ap.add_argument("--preset", default="tiny", choices=[p.value for p in TinyPreset])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    make_tiny_model(a.dir, TinyPreset(a.preset), seed=a.seed)
    log.info("wrote %s to %s", a.preset, a.dir)
    return 0


def engine(cfg: Config, pool: str | None = None) -> int:
    """Start the engines of ``cfg.engine`` (or, with ``pool``, this node's share of ``scoring.<pool>``'s:
    ``engine.count / nodes``) and serve until interrupted."""
    import socket

    from mrl.console import route_library_output
    from mrl.engine.launcher import engines_from_config

    secure_run_dir(cfg.run_dir)
    route_library_output(cfg.run_dir, f"engine_node_{socket.gethostname()}")  # health polls, library warnings
    cfg.model.hf_path = ensure_model(cfg)
    from mrl.engine.fp8_model import engine_model_path
    from mrl.sglang.keys import ensure_run_secrets

    ensure_run_secrets(cfg.run_dir)
    if pool is not None:
        return _serve_pool(cfg, pool)
    path = engine_model_path(cfg)  # engine.quantization=fp8: the run's block-FP8 export (shared run_dir: one)
    eng = cfg.engine
    # With engine.url_dir (cluster engine nodes) each healthy engine is announced to the trainer as
    # <dir>/<host>-engine<i>.url: the servers listen on this node's own interface (not 0.0.0.0) and the
    # URL names it (MRL_ENGINE_HOST overrides it). Without, they stay on loopback.
    from mrl.sglang.endpoint import interface_address
    from mrl.config.lora_engine import lora_engine_spec

    url_dir = eng.url_dir
    host = socket.gethostname()
    bind = interface_address() if url_dir else "127.0.0.1"
    names = [f"{host}-engine{i}" for i in range(eng.count)] if url_dir else None
    engines = engines_from_config(eng, path, log_dir=os.path.join(cfg.run_dir, "engines"), names=names, host=bind,
                                  lora=lora_engine_spec(cfg))  # a LoRA run's trainer loads adapters into them
    return _serve(engines, url_dir, bind)


def _serve_pool(cfg: Config, name: str) -> int:
    """A scoring pool's node (``scoring.<name>.nodes``): ``engine.count / nodes`` of its servers, announced in
    its ``engine.url_dir`` as ``<host>-<name><i>``, with the run's keys, as rollout engine nodes serve."""
    import socket

    from mrl.engine.launcher import engines_from_config
    from mrl.sglang.endpoint import interface_address

    pools = cfg.scoring.pools
    p = pools.get(name)
    if p is None or not p.nodes or not p.engine.url_dir:
        log.error("mrl engine --pool %s: not a scoring pool on nodes of its own (pools on nodes: %s)", name,
                  [k for k, c in pools.items() if c.nodes])
        return 2
    bind, host = interface_address(), socket.gethostname()
    per = p.engine.count // p.nodes
    engines = engines_from_config(p.engine, p.model_path(cfg.model.hf_path), names=[f"{host}-{name}{i}" for i in
                                  range(per)], log_dir=os.path.join(cfg.run_dir, "engines"), host=bind)
    for e in engines:
        e.return_routed_experts = False  # nothing replays a scorer's routes
        e.server_args = {**p.SERVER_ARGS, **e.server_args}
    return _serve(engines, p.engine.url_dir, bind)


def _serve(engines: list, url_dir: str | None, bind: str) -> int:
    """Start ``engines``, announce each healthy one in ``url_dir`` (when set), serve until TERM, stop them."""
    import signal
    import threading

    from mrl.cluster.engines import announce, withdraw

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_healthy()
            url = e.url
            if url_dir:
                url = f"http://{bind}:{e.port}"
                announce(url_dir, e.name, url)
            log.info("%s ready at %s (log %s)", e.name, url, e.log_path)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        for e in engines:
            if url_dir:
                withdraw(url_dir, e.name)
            e.stop()
    return 0


def launch(argv: list[str]) -> int:
    """``mrl launch``: not a Hydra app, because it takes flags of its own (--dry-run, --wait); it composes
    the overrides itself (mrl/cluster/launch.py), then runs the preflight of a submitted job."""
    from mrl.cluster.launch import main as launch_main
    from mrl.preflight import SUBMIT

    return launch_main(argv, preflight=lambda cfg: preflight(cfg, SUBMIT))


COMMANDS = {"train": train, "check": check, "check-model": check_model, "engine": engine}


def main() -> None:
    stamp_launch()  # a run's start phases count from here (its time to first step)
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "make-tiny-model":
        sys.exit(make_tiny(rest))
    if cmd == "export":
        from mrl.jobs.export import launch as export

        sys.exit(export(rest))
    if cmd == "export-fp8":
        from mrl.quant.export import main as export_fp8

        sys.exit(export_fp8(rest))
    if cmd == "tune-moe":
        from mrl.engine.moe_tuning import main as tune_moe

        sys.exit(tune_moe(rest))
    if cmd == "launch":
        sys.exit(launch(rest))
    if cmd == "engine" and "--pool" in rest:  # a scoring pool's node (mrl_node.sh scoring POOL)
        at = rest.index("--pool")
        if at + 1 >= len(rest):
            print("mrl engine: --pool needs a pool name (scoring.<pool>)", file=sys.stderr)
            sys.exit(2)
        pool, rest = rest[at + 1], rest[:at] + rest[at + 2:]
        sys.argv = [f"mrl {cmd}", *rest]
        _hydra_app(functools.partial(engine, pool=pool))
        return
    if cmd not in COMMANDS:
        others = ['export', 'export-fp8', 'launch', 'make-tiny-model', 'tune-moe']
        print(f"mrl: unknown command {cmd!r}; commands: {sorted(COMMANDS) + others}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"mrl {cmd}", *rest]
    _hydra_app(COMMANDS[cmd])


if __name__ == "__main__":
    main()
