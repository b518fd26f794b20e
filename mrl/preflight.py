"""Preflight: every input of a run that can be checked before a process starts, one line per failure.

    failures = run_preflight(cfg)              # [] or one line per failed check, each naming field and value
    failures = run_preflight(cfg, where=SUBMIT)  # ``mrl launch``: the nodes check what lives on them

``mrl train`` and ``mrl launch`` run it first (exit status 2 on a failure, before the run directory is made
or any engine, trainer or job starts); ``mrl check ARGS...`` runs it alone. Each check is a function of the
config returning None or its one-line message. Nothing here writes a file but ``datasets``' cache (``data=hf``).

The cheap checks (run directory, layout, data, reward and environment fns and scorers, GPU packages, ports,
trackers) run first, all of them; the model check runs only when they pass. It reads safetensors headers, never
tensor data, and the model's bridge reads config.json itself: neither torch nor transformers is imported
(seconds on a small CPU box), unless config.json leaves a key to transformers' defaults or type checks.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import inspect
import json
import os
import re
import socket
from typing import Callable

from mrl.config.schema import Config
from mrl.process import job_sys_path

LOCAL = "local"  # ``mrl train``/``mrl check``: this host runs the job (or is one of its Slurm nodes)
SUBMIT = "submit"  # ``mrl launch``: the job runs on other nodes; what only they can see is checked there

Check = Callable[[Config, str], "str | None"]


def _named(key: str, value, msg: str) -> str:
    """``key=value: msg``, or ``key: msg`` when the message already shows the value."""
    return f"{key}: {msg}" if str(value) in msg else f"{key}={value}: {msg}"


def _in_image(cfg: Config, where: str) -> bool:
    """``mrl launch`` with a container: paths and packages are the image's, checked on the nodes."""
    from mrl.config.schema import ContainerKind

    return where == SUBMIT and cfg.cluster.container != ContainerKind.none


def _existing_ancestor(path: str) -> str:
    """The nearest directory at or above ``path`` that exists (what a new run directory is made in)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_run_dir(cfg: Config, where: str) -> str | None:
    """An existing run directory must be this user's, private and writable; a new one must be creatable."""
    from mrl.cluster.rundir import UnsafeRunDir, check_run_dir as refuse_unsafe

    path = cfg.run_dir
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"run_dir={path}: exists and is not a directory"
        try:
            refuse_unsafe(path)
        except UnsafeRunDir as e:
            return str(e)
        if not os.access(path, os.W_OK | os.X_OK):
            return f"run_dir={path}: not writable by this user"
        return None
    parent = _existing_ancestor(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(parent):
        return f"run_dir={path}: cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"run_dir={path}: cannot be created: {parent} is not writable by this user"
    return None


def trainer_world(cfg: Config, where: str) -> tuple[int, str]:
    """The trainer's world size, and how it was found when not from ``parallel.*`` alone."""
    from mrl.config.schema import ClusterKind

    c = cfg.cluster
    if where == SUBMIT and c.kind == ClusterKind.slurm:
        return c.num_train_nodes * c.nproc_per_node, (
            f" (trainer world size = cluster.num_train_nodes * cluster.nproc_per_node = "
            f"{c.num_train_nodes}*{c.nproc_per_node})")
    if (nodes := os.environ.get("PET_NNODES", "").split(":")[-1]).isdigit() and (
            per := os.environ.get("PET_NPROC_PER_NODE", "")).isdigit():  # a Slurm trainer node: torchrun's world
        return int(nodes) * int(per), f" (trainer world size = PET_NNODES * PET_NPROC_PER_NODE = {nodes}*{per})"
    return cfg.parallel.local_world_size, ""


def check_layout(cfg: Config, where: str) -> str | None:
    """The world size fits parallel.* and a DP share algo.mini_batches (the model's own needs: check_model)."""
    world, how = trainer_world(cfg, where)
    try:
        cfg.parallel.check_world_size(world)
        cfg.algo.check_mini_batches(cfg.samples_per_step, world // cfg.parallel.model_parallel_size)
    except ValueError as e:
        return f"{e}{how}"
    return None


def check_context_parallel(cfg: Config, where: str) -> str | None:
    """``parallel.cp`` > 1 runs only with Transformer Engine's attention on GPUs (the layouts it combines with
    are ``ParallelConfig``'s and ``check_layout``'s). Where the trainer runs: here, or the nodes under
    ``mrl launch``."""
    if cfg.parallel.cp == 1 or where == SUBMIT:
        return None
    return cfg.parallel.context_parallel_problem(
        transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
        gpu=bool(glob.glob("/dev/nvidia[0-9]*")))


def check_data(cfg: Config, where: str) -> str | None:
    """The prompt files exist and yield a usable row (bad rows: as the run reports them); a task's needs are met
    (``mrl.data.checks``)."""
    if _in_image(cfg, where):
        return None
    from mrl.data.checks import data_problem

    def tiny_tokenizer():  # what ``ensure_model`` will write
        from mrl.models.tiny import PRESETS, TINY_CONTEXT, build_tokenizer

        return build_tokenizer(PRESETS[cfg.model.tiny_preset]["vocab_size"]), TINY_CONTEXT

    return data_problem(cfg, tiny_tokenizer)


def check_eval_sets(cfg: Config, where: str) -> str | None:
    """An evaluation set read from a JSONL file (``train.eval_sets``): it exists and yields a usable row."""
    from mrl.data import JsonlDataset

    d = cfg.data
    for s in [] if _in_image(cfg, where) or not cfg.train.eval_every else cfg.train.eval_files:
        try:
            JsonlDataset(s.source, prompt_key=d.prompt_key, answer_key=d.answer_key, id_key=d.id_key,
                         on_bad_row=d.on_bad_row, seed=d.seed, shuffle=False)
        except (ValueError, TypeError, OSError) as e:
            return _named(f"train.eval_sets[{s.name}].source", s.source, str(e))
    return None


def check_reward_fn(cfg: Config, where: str) -> str | None:
    """``reward.fn`` imports and accepts ``(prompt, response_text)``; the scorers pass ``mrl.scoring.checks``."""
    if _in_image(cfg, where):
        return None
    from mrl.reward import load_reward_fn
    from mrl.scoring.checks import scoring_problem

    try:
        with job_sys_path():
            load_reward_fn(cfg.reward.fn)
            return scoring_problem(cfg)
    except (ValueError, ImportError) as e:
        return str(e)


def check_env_fn(cfg: Config, where: str) -> str | None:
    """``rollout.env.fn`` (or the built-in task's environment) imports, is an ``mrl.env.Environment`` class or a
    factory, and takes ``rollout.env.args``."""
    if _in_image(cfg, where):
        return None
    path = cfg.rollout.env.fn
    if path is None and cfg.data.path is None:
        from mrl.data.tasks import TASKS

        path = getattr(TASKS.get(cfg.data.task), "env", None)  # a built-in multi-turn task names its own
    if path is None:
        return None
    from mrl.env.base import Environment, load_env_factory

    try:
        with job_sys_path():
            factory = load_env_factory(path)
    except ValueError as e:
        return str(e)
    except Exception as e:  # the module raised on import: what the first episode would raise
        return f"rollout.env.fn={path!r}: importing it failed: {type(e).__name__}: {e}"
    if inspect.isclass(factory) and not issubclass(factory, Environment):
        return f"rollout.env.fn={path!r}: {factory.__name__} is not a subclass of mrl.env.Environment"
    args = dict(cfg.rollout.env.args)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (some builtins): the first episode tells
        return None
    try:
        sig.bind(**args)
    except TypeError as e:
        return (f"rollout.env.fn={path!r}: cannot be called with rollout.env.args={args} ({e}); "
                f"its signature is {sig}")
    return None


def _starts_engines(cfg: Config) -> bool:
    eng = cfg.engine
    return not (eng.urls or eng.url_dir)


def check_gpu_stack(cfg: Config, where: str) -> str | None:
    """GPU engines started here need SGLang's GPU kernels and a GPU (what ``gpu_mode.check_gpu_stack`` later
    proves by loading them, in a child process: seconds, so not here)."""
    if cfg.engine.cpu_mode or where == SUBMIT or not _starts_engines(cfg):
        return None
    from mrl.engine.gpu_mode import GPUStackError, check_gpu_packages

    try:
        check_gpu_packages()
    except GPUStackError as e:
        return str(e)
    if not glob.glob("/dev/nvidia[0-9]*"):
        return ("engine.cpu_mode=false: this host has no NVIDIA GPU (no /dev/nvidia<N> device); run on a GPU "
                "node, or use engine=cpu")
    tuned = cfg.engine.moe_kernel_configs
    if tuned and not os.path.isdir(os.path.join(os.path.expanduser(tuned), "configs")):
        return _named("engine.moe_kernel_configs", tuned, "no configs/ folder there (`mrl tune-moe HF_DIR OUT`)")
    return None


def _port_in_use(port: int) -> str | None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers that take it: TIME_WAIT is no clash
        try:
            s.bind(("", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_ports(cfg: Config, where: str) -> str | None:
    """The fixed ports this host would listen on are free: the rendezvous port on the first node of a
    multi-node trainer, ports named in ``engine.server_args`` of engines started here. (Every other port is
    picked free when it is bound.)"""
    if where == SUBMIT:
        return None
    wanted = []
    if os.environ.get("PET_NNODES") and os.environ.get("PET_NODE_RANK", "0") == "0" and os.environ.get(
            "PET_MASTER_PORT"):
        wanted.append(("MASTER_PORT", os.environ["PET_MASTER_PORT"], "torchrun's rendezvous on this node"))
    if _starts_engines(cfg):
        wanted += [(f"engine.server_args.{k}", v, "an engine's") for k, v in cfg.engine.server_args.items()
                   if k.endswith("port") and v is not None]
    for key, value, what in wanted:
        try:
            port = int(value)
        except (TypeError, ValueError):
            return f"{key}={value}: not a port number"
        if not 0 < port < 65536:
            return f"{key}={value}: not a port number (1-65535)"
        why = _port_in_use(port)
        if why:
            return f"{key}={port}: {what} port is not free on this host ({why})"
    return None


EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # logger name -> module it imports


def check_loggers(cfg: Config, where: str) -> str | None:
    """The trackers of ``logger`` are installed (rank 0 imports them when the run starts)."""
    if _in_image(cfg, where):
        return None
    missing = [n for n in cfg.logger if n in EXTRAS and importlib.util.find_spec(EXTRAS[n]) is None]
    if missing:
        return (f"logger={list(cfg.logger)}: {', '.join(missing)} not installed; pip install 'mrl[tracking]' "
                "(or drop it from logger)")
    return None


def _model_msg(path: str, msg: str) -> str:
    key = f"model.hf_path={path}"
    for prefix in (path + "/", path + ": ", path):
        if msg.startswith(prefix):
            return f"{key}: {msg[len(prefix):]}"
    return f"{key}: {msg}"


def _safetensors_files(path: str) -> tuple[list[str], str | None]:
    """The checkpoint's files (the index's when there is one), or a message."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [], f"model.safetensors.index.json: not a safetensors index ({type(e).__name__}: {e})"
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            return [], f"model.safetensors.index.json names files that are not there: {missing[:3]}"
        return [os.path.join(path, n) for n in names], None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    return files, None if files else "no *.safetensors files"


_EXPERT = re.compile(r"^(?P<layer>.+\.experts\.)(?P<e>\d+)(?P<rest>\..+)$")


def expert_gaps(shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Per-expert tensors (``<layer>.experts.<e>.<proj>``, the hub layout) that a layer lacks or holds in
    another shape than its other experts: seen from the headers alone, so the line names the odd expert
    against its siblings rather than against the bridge's list of every expected tensor."""
    layers: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        if m := _EXPERT.match(name):
            layers.setdefault(m["layer"], {}).setdefault(m["rest"], {})[int(m["e"])] = shape
    missing, odd = [], []
    for layer, projs in sorted(layers.items()):
        experts = set().union(*projs.values())
        experts |= set(range(max(experts) + 1))
        for rest, found in sorted(projs.items()):
            missing += [f"{layer}{e}{rest}" for e in sorted(experts - set(found))]
            common = max(set(found.values()), key=list(found.values()).count)
            odd += [f"{layer}{e}{rest} is {list(s)}, its layer's other experts {list(common)}"
                    for e, s in sorted(found.items()) if s != common]
    problems = ([f"missing tensors: {missing[:5]}" + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")]
                if missing else []) + (["mis-shaped tensors: " + "; ".join(odd[:3])] if odd else [])
    return "checkpoint is incomplete: " + "; ".join(problems) if problems else None


def check_model(cfg: Config, where: str) -> str | None:
    """config.json of a mapped architecture, tokenizer.json of this model, every tensor the bridge needs with
    its shape (headers only: a truncated file is one whose header does not cover it), a layout that can
    shard the model."""
    if _in_image(cfg, where):
        return None
    path = cfg.model.hf_path
    if not os.path.isfile(os.path.join(path, "config.json")):
        if cfg.model.make_tiny_if_missing:
            return None  # ``ensure_model`` writes the tiny checkpoint there
        what = "no such directory" if not os.path.isdir(path) else "no config.json there"
        return _model_msg(path, f"{what} (and model.make_tiny_if_missing=false)")
    try:
        with open(os.path.join(path, "config.json")) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return _model_msg(path, f"config.json is not JSON ({e})")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):  # before the costly part; its content after
        return _model_msg(path, "tokenizer.json: missing; the RL loop encodes prompts with the model's own "
                          "tokenizer (tokenizers' tokenizer.json next to config.json)")
    files, why = _safetensors_files(path)
    if why:
        return _model_msg(path, why)
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for fn in files:
        try:
            with safe_open(fn, framework="numpy") as f:  # the header only; numpy: no torch for this
                shapes.update((k, tuple(f.get_slice(k).get_shape())) for k in f.keys())
        except Exception as e:  # safetensors raises its own error type for a bad or truncated header
            return _model_msg(path, f"{os.path.basename(fn)}: not a complete safetensors file ({e})")
    if why := expert_gaps(shapes):
        return _model_msg(path, why)
    from mrl.models import ConfigNeedsTransformers

    try:
        return _check_bridge(cfg, path, json_config=True)
    except ConfigNeedsTransformers:  # a key left to transformers' defaults or type checks: its config class decides
        return _check_bridge(cfg, path, json_config=False)


def _check_bridge(cfg: Config, path: str, json_config: bool) -> str | None:
    """The tokenizer against config.json, every tensor the bridge names with its shape, the layout against the
    model. ``json_config``: the bridge reads config.json itself (no transformers, no torch: seconds less)."""
    from mrl.models import get_bridge
    from mrl.models.checkpoint import HFCheckpoint, check_tokenizer

    errors: tuple[type[Exception], ...] = (ValueError, OSError, KeyError, TypeError)
    if not json_config:  # transformers checks config.json's types through huggingface_hub (an Exception)
        with contextlib.suppress(ImportError):
            from huggingface_hub.errors import StrictDataclassError

            errors += (StrictDataclassError,)
    try:
        bridge = get_bridge(path, json_config=json_config)
        hc = bridge.hf_config
        check_tokenizer(path, vocab_size=bridge.vocab_size, special_ids={
            k: getattr(hc, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
        ckpt = HFCheckpoint(path)
        padded = bridge.padded_vocab(cfg.model.vocab_divisible_by, cfg.parallel.tp)
        ckpt.check_against(bridge.hf_tensor_shapes(padded), skip=bridge.skipped_hf_tensors(ckpt.shapes))
        sizes = dict(num_experts=bridge.num_experts, num_layers=bridge.num_layers,
                     num_query_groups=bridge.num_query_groups)
    except errors as e:  # transformers' config errors among them
        return _model_msg(path, str(e))
    try:
        cfg.parallel.check_model(**sizes)
    except ValueError as e:
        return f"{e} (model.hf_path={path})"
    return None


def check_fp8_shapes(cfg: Config, where: str) -> str | None:
    """``engine.quantization=fp8``: SGLang's block-FP8 layers load this model at ``engine.tp`` x
    ``engine.ep`` (whole 128-blocks per engine rank: ``sglang_shape_problems``; the model's config.json, or the
    tiny preset's when ``make_tiny_if_missing`` will write it), and ``fp8_ignore`` splits no fused group."""
    eng = cfg.engine
    if eng.quantization != "fp8" or _in_image(cfg, where):
        return None
    import transformers

    from mrl.quant.fp8_targets import ignore_problem, sglang_shape_problems

    path = cfg.model.hf_path
    if not os.path.isfile(os.path.join(path, "config.json")) and not cfg.model.make_tiny_if_missing:
        return None  # check_model names the missing model
    try:
        if os.path.isfile(os.path.join(path, "config.json")):
            hf_config = transformers.AutoConfig.from_pretrained(path)
        else:
            from mrl.models.tiny import FAMILIES, PRESETS

            config_cls, arch = FAMILIES[cfg.model.tiny_preset]
            hf_config = getattr(transformers, config_cls)(architectures=[arch], **PRESETS[cfg.model.tiny_preset])
    except (ValueError, OSError, KeyError) as e:
        return _model_msg(path, str(e))  # check_model reports a missing model; this is a bad config.json
    problems = sglang_shape_problems(hf_config, eng.tp, eng.ep)
    if problems:
        return (f"engine.quantization=fp8: SGLang's block-FP8 layers cannot load model.hf_path={path} at "
                f"engine.tp={eng.tp}, engine.ep={eng.ep}: {'; '.join(problems)} (another engine.tp "
                "or engine.ep, or engine.quantization=null)")
    # a q/k/v, gate/up or experts group that engine.fp8_ignore splits (the export would refuse it)
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    return ignore_problem(path, eng.fp8_ignore) if eng.fp8_ignore and has_config else None


def _from_bridge(cfg: Config, where: str, fn):
    """``fn(bridge)`` for the model's bridge read from config.json (transformers' config where config.json
    leaves a key to its defaults or type checks), or None where config.json cannot be read here, the run
    trains LoRA adapters (the estimates are for full fine-tuning), or the model or layout is one the
    checks name (check_model, check_layout)."""
    path = cfg.model.hf_path
    if cfg.model.lora.enabled or _in_image(cfg, where) or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from mrl.models import ConfigNeedsTransformers, get_bridge

    try:
        try:
            return fn(get_bridge(path, json_config=True))
        except ConfigNeedsTransformers:
            return fn(get_bridge(path))
    except Exception:  # noqa: BLE001 -- transformers' own validation errors too: check_model names them
        return None


def model_state_note(cfg: Config, where: str) -> str | None:
    """``mrl check``'s informative line: the trainer's model states per rank for this layout, from config.json
    alone (``mrl.megatron.memory``; no torch unless config.json leaves a key to transformers)."""
    from mrl.megatron.memory import describe, model_state_bytes

    def note(bridge) -> str:
        est = model_state_bytes(bridge, cfg.parallel, dtype=cfg.model.dtype,
                                optimizer_states_dtype=cfg.train.optimizer_states_dtype,
                                padded_vocab=bridge.padded_vocab(cfg.model.vocab_divisible_by, cfg.parallel.tp),
                                world_size=trainer_world(cfg, where)[0])
        return describe(est, cfg.parallel)

    return _from_bridge(cfg, where, note)


def check_checkpoint_space(cfg: Config, where: str) -> str | None:
    """Every run saves a checkpoint at its end: the run directory's filesystem must have room for one
    (a lower bound from config.json, ``mrl.megatron.memory.checkpoint_bytes``), or the run would fail there,
    after all its steps. Checked where the run directory lives (``mrl launch``: on the nodes)."""
    if where != LOCAL:
        return None
    import shutil

    from mrl.megatron.memory import checkpoint_bytes

    need = _from_bridge(cfg, where, lambda bridge: checkpoint_bytes(
        bridge, dtype=cfg.model.dtype, optimizer_states_dtype=cfg.train.optimizer_states_dtype,
        padded_vocab=bridge.padded_vocab(cfg.model.vocab_divisible_by, 1),
        optimizer_checkpoint=cfg.train.optimizer_checkpoint))
    if need is None:
        return None
    params, need = need
    free = shutil.disk_usage(_existing_ancestor(os.path.join(cfg.run_dir, "checkpoints"))).free
    if free >= need:
        return None
    return (f"run_dir={cfg.run_dir}: its filesystem has {free / 2**30:.1f} GiB free, and one checkpoint of this "
            f"model takes at least {need / 2**30:.1f} GiB ({params / 1e9:.2f}B parameters in {cfg.model.dtype.value} "
            f"and the optimizer state as train.optimizer_checkpoint={cfg.train.optimizer_checkpoint} saves it); every "
            "run saves one at its end: put run_dir on a filesystem with room")


CHEAP: tuple[Check, ...] = (check_run_dir, check_layout, check_context_parallel, check_data, check_eval_sets,
                            check_reward_fn, check_env_fn, check_gpu_stack, check_ports,
                            check_loggers)
COSTLY: tuple[Check, ...] = (check_model, check_fp8_shapes, check_checkpoint_space)


def run_preflight(cfg: Config, where: str = LOCAL) -> list[str]:
    """One line per failed check, [] when the run may start. The costly checks run when the cheap ones pass."""
    failures = [msg for check in CHEAP if (msg := check(cfg, where))]
    if not failures:
        failures = [msg for check in COSTLY if (msg := check(cfg, where))]
    return [" ".join(m.split()) for m in failures]  # one line each, whatever a library's message held
