"""Start and stop unmodified SGLang HTTP servers as child processes.

    with Engine(model_path="runs/models/tiny", tp=1, cpu_mode=True, log_dir="runs/x/engines") as eng:
        eng.wait_healthy()
        ... EngineClient(eng.url) ...

Every server requires the run's keys (``mrl.sglang.keys``): SGLang reads them from the 0600 keys
file (``--config``), so they are on no command line, and its output goes to the log through a filter
that redacts them (SGLang logs its server args, keys included). Servers bind to loopback unless given
``host`` (on clusters: the job's interface, ``interface_address``).

Each server runs in its own process group (``start_new_session``) and dies with its parent
(``PR_SET_PDEATHSIG``; SGLang's scheduler/detokenizer processes do the same towards the server), so no
engine process outlives the launcher even when it crashes. ``stop`` terminates the whole group.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from mrl.process import become_subreaper, child_setup, on_lasting_thread, open_files, reap_zombies
from mrl.engine import cpu_mode, gpu_mode
from mrl.config.lora_engine import LoraEngineSpec
from mrl.sglang.endpoint import EngineEndpoint, free_port
from mrl.sglang.keys import EngineSecrets, ensure_run_secrets


class EngineStartError(RuntimeError):
    pass


def pump_log(src, log, secrets: EngineSecrets) -> None:
    """Copy the server's output to its log line by line, keys redacted (a key never spans lines)."""
    with src, log:
        for line in iter(src.readline, b""):
            log.write(secrets.redact(line.decode(errors="replace")).encode())
            log.flush()


# Set by mrl only: the keys live in the secrets file, never in the config (SGLang reads it via --config).
_RESERVED_SERVER_ARGS = ("api_key", "admin_api_key", "config")


_GRAPH_SIZE_KEYS = {"cuda_graph_max_bs", "cuda_graph_max_bs_decode", "cuda_graph_bs", "cuda_graph_bs_decode",
                    "cuda_graph_config", "disable_cuda_graph", "disable_decode_cuda_graph"}
"""``engine.server_args`` keys that size or switch off the decode CUDA graphs: the user's choice stands."""

_PREFILL_GRAPH_KEYS = {"disable_prefill_cuda_graph", "cuda_graph_backend_prefill", "disable_cuda_graph"}
"""``engine.server_args`` keys that decide SGLang's prefill CUDA graphs: the user's choice stands."""


def server_args_to_cli(args: dict[str, Any]) -> list[str]:
    """``{"enable_dp_attention": True, "mem_fraction_static": 0.8}`` ->
    ``--enable-dp-attention --mem-fraction-static 0.8``."""
    out: list[str] = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False or v is None:
            continue
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


_TORCHRUN_VARS = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"}

_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@dataclass(kw_only=True)
class Engine:
    """One SGLang server (one DP replica with its own TP/EP)."""

    model_path: str
    tp: int = 1
    ep: int = 1
    dp: int = 1
    """DP inside one server: only with DP attention (weight updates assert dp == 1 otherwise);
    plain data parallelism = several Engines."""
    cpu_mode: bool = True
    cpu_batched_attention: bool = True
    """CPU mode: batched torch_native attention (``mrl.engine.server.cpu_attention``)."""
    memory_saver: bool = False
    """GPU: --enable-memory-saver, so release/resume_memory_occupation really free memory (colocated runs)."""
    base_gpu_id: int = 0
    """GPU: the first of the ``tp * dp`` consecutive GPUs this server takes (``--base-gpu-id``)."""
    mem_fraction_static: float | None = None
    """GPU: share of each GPU's memory for weights and KV cache (null: SGLang's own choice)."""
    attention_backend: str | None = None
    """GPU: null = triton (``gpu_mode.attention_backend``)."""
    sampling_backend: str | None = None
    """GPU: SGLang ``--sampling-backend`` (null: SGLang's default, flashinfer)."""
    dtype: str | None = None
    """GPU: ``--dtype`` (null: the checkpoint's). CPU mode always runs fp32."""
    kv_cache_dtype: str | None = None
    """``--kv-cache-dtype`` (null: the engine's dtype), CPU and GPU."""
    compile_cache_dir: str | None = None
    """GPU: where inductor's and triton's caches live (``gpu_mode.gpu_env``); null: their defaults."""
    moe_kernel_configs: str | None = None
    """GPU: tuned fused-MoE tables (``mrl tune-moe``), merged with SGLang's own into a folder beside the
    log (``moe_tuning.merged_config_dir``) that ``SGLANG_MOE_CONFIG_DIR`` names; null: SGLang's own."""
    quantization: str | None = None
    """GPU: ``--quantization`` (``fp8``: ``model_path`` must be a block-FP8 checkpoint, ``mrl export-fp8``)."""
    load_format: str | None = None
    """``--load-format`` (null: SGLang's ``auto``). ``dummy``: the server reads no weights at start, only
    ``config.json``; they arrive by a weight update (``mrl.weight_sync.named``), e.g. synthetic weights of
    a model whose checkpoint is not on this host's disk. Such an engine loads LoRA adapters from tensors only:
    SGLang 0.5.14's LoRA manager reads adapter files with the load format the server started with."""
    host: str = "127.0.0.1"
    port: int | None = None
    log_dir: str = "runs/engines"
    name: str = "engine0"
    weight_version: str = "0"
    max_running_requests: int = 8
    max_total_tokens: int | None = 4096
    return_routed_experts: bool = True
    server_args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    cpus: list[int] | None = None
    """CPU mode: cores this engine may use (several engines on one box get disjoint sets)."""
    cpu_threads: int | None = None
    """CPU mode: torch/OpenMP threads per TP rank (None: the rank's share of ``cpus``)."""
    lora: LoraEngineSpec | None = None
    """LoRA runs: the adapter pool (``--enable-lora`` and its sizes); adapters are loaded after start
    (``mrl.weight_sync.adapter``)."""
    secrets: EngineSecrets | None = None
    """The run's keys; ``start`` takes ``ensure_run_secrets()`` when None."""
    proc: subprocess.Popen | None = field(default=None, init=False)
    _pump: threading.Thread | None = field(default=None, init=False, repr=False)
    _port_retries: int = field(default=0, init=False, repr=False)
    """Starts left on a fresh port when the one picked for us was taken before the server bound it
    (``free_port`` can only pick a port that is free now: another process, or an SGLang server's own
    internal ports, may take it first). 0 for a port the caller chose."""

    def __post_init__(self) -> None:
        if self.cpu_mode and self.ep > 1:
            raise ValueError("engine.ep: SGLang CPU mode does not support ep > 1 (its native MoE path crashes)")
        if self.cpu_mode and self.quantization:
            raise ValueError(f"engine.quantization={self.quantization}: CPU engines cannot serve it (docs/fp8.md)")
        if self.cpu_mode and self.memory_saver:
            raise ValueError("engine.memory_saver: needs GPUs (torch_memory_saver); not available in CPU mode")
        if self.dp > 1 and not self.server_args.get("enable_dp_attention"):
            raise ValueError("engine.dp > 1 needs server_args.enable_dp_attention (SGLang's weight updates "
                             "assert dp_size == 1 otherwise); for plain data parallelism start more engines")
        if self.lora is not None:
            self.lora.check_engine(cpu_mode=self.cpu_mode, server_args=self.server_args)
        reserved = [k for k in _RESERVED_SERVER_ARGS if k in self.server_args]
        if reserved:
            raise ValueError(f"engine.server_args: {reserved} are set by mrl from the run's keys file "
                             "(mrl.sglang.keys), never from the config")
        if not self.port:
            self.port, self._port_retries = free_port(self.host), 3

    def __hash__(self) -> int:
        return id(self)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> EngineEndpoint:
        return EngineEndpoint(self.url, self.tp)

    @property
    def log_path(self) -> str:
        return os.path.join(self.log_dir, f"{self.name}.log")

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self.port), "--tp-size", str(self.tp),
               "--skip-tokenizer-init", "--weight-version", self.weight_version,
               "--max-running-requests", str(self.max_running_requests), "--skip-server-warmup"]
        if self.ep > 1:
            cmd += ["--ep-size", str(self.ep)]
        if self.dp > 1:
            cmd += ["--dp-size", str(self.dp)]
        if self.memory_saver:
            cmd.append("--enable-memory-saver")
        if self.max_total_tokens:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if self.kv_cache_dtype:
            cmd += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.quantization:
            cmd += ["--quantization", self.quantization]
        if self.load_format:
            cmd += ["--load-format", self.load_format]
        if self.cpu_mode:
            cmd += cpu_mode.CPU_SERVER_ARGS
        else:
            backend = gpu_mode.attention_backend(self.attention_backend)
            cmd += ["--base-gpu-id", str(self.base_gpu_id), "--attention-backend", backend]
            if backend == "fa3" and not _PREFILL_GRAPH_KEYS & set(self.server_args):
                # SGLang 0.5.14's FA3 backend faults while the piecewise prefill graphs are captured; without
                # them it starts and serves (docs/gpu.md)
                cmd.append("--disable-prefill-cuda-graph")
            if self.mem_fraction_static is not None:
                cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
            if self.sampling_backend:
                cmd += ["--sampling-backend", self.sampling_backend]
            if self.dtype:
                cmd += ["--dtype", self.dtype]
            if not _GRAPH_SIZE_KEYS & set(self.server_args):
                # SGLang sizes its decode graphs by the GPU's memory, past what this engine ever runs at once
                # (max_running_requests): the larger graphs would only cost start time and memory
                cmd += ["--cuda-graph-max-bs-decode", str(self.max_running_requests)]
        if self.lora is not None:
            cmd += self.lora.server_args(cpu_mode=self.cpu_mode)
        if self.secrets is not None:
            cmd += ["--config", self.secrets.path]  # the keys file: --api-key, --admin-api-key
        return cmd + server_args_to_cli(self.server_args)

    def environment(self) -> dict[str, str]:
        """The server's environment before the caller's ``env`` and the start's own variables: CPU or GPU
        mode's, with mrl's SGLang patches; on GPUs with tuned fused-MoE tables, a folder of them merged
        with SGLang's own beside the log (``SGLANG_MOE_CONFIG_DIR``)."""
        if self.cpu_mode:
            env = cpu_mode.cpu_env(self.tp, cpus=self.cpus, batched_attention=self.cpu_batched_attention,
                                   threads=self.cpu_threads)
        else:
            env = gpu_mode.gpu_env(compile_cache_dir=self.compile_cache_dir)
            if self.moe_kernel_configs:
                from mrl.engine.moe_tuning import merged_config_dir

                env["SGLANG_MOE_CONFIG_DIR"] = merged_config_dir(
                    os.path.expanduser(self.moe_kernel_configs), os.path.join(self.log_dir, f"{self.name}_moe_configs"))
        return env

    def start(self) -> "Engine":
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        if self.secrets is None:
            self.secrets = ensure_run_secrets()
        os.makedirs(self.log_dir, exist_ok=True)
        if not self.cpu_mode:
            gpu_mode.check_gpu_stack()
        env = self.environment()
        # started from a trainer rank: torchrun's rendezvous variables would make the server's own
        # torch.distributed init join the trainer's store and hang there
        for k in [k for k in env if k in _TORCHRUN_VARS or k.startswith(("TORCHELASTIC_", "PET_"))]:
            del env[k]
        env.update(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.port > 55535:  # SGLang 0.5.14 refuses to start when its gRPC port (--port + 10000) passes 65535
            env.setdefault("SGLANG_GRPC_PORT", str(self.port - 10000))
        cmd = self.command()
        log = open(self.log_path, "ab")
        log.write(self.secrets.redact("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        become_subreaper()  # so that stop() can reap the server's children (see reap_zombies)
        try:
            self.proc = on_lasting_thread(lambda: subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=child_setup(self.cpus if self.cpu_mode else None)))
        except BaseException:
            log.close()
            raise
        self._pump = threading.Thread(target=pump_log, args=(self.proc.stdout, log, self.secrets),
                                      name=f"{self.name}-log", daemon=True)
        self._pump.start()
        _LIVE.add(self)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 300.0) -> "Engine":
        """Poll ``/health_generate`` until 200; raise with the log tail if the server dies or times out."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                if self._pump is not None:
                    self._pump.join(timeout=5)  # the last lines (the error) are still in the pipe
                if self._port_retries and f"('{self.host}', {self.port}): address already in use" in self.log_tail():
                    self._restart_on_a_fresh_port()
                    deadline = time.monotonic() + timeout  # the new server gets its own start-up time
                    continue
                raise EngineStartError(f"{self.name} exited with code {self.proc.returncode} during startup; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health_generate", timeout=10.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EngineStartError(f"{self.name} not healthy after {timeout:.0f}s; log {self.log_path}:\n"
                                       f"{self.log_tail()}")
            time.sleep(0.25)

    def _restart_on_a_fresh_port(self) -> None:
        taken, self._port_retries = self.port, self._port_retries - 1
        self.stop()
        self.proc, self.port = None, free_port(self.host)
        with open(self.log_path, "a") as f:
            f.write(f"[mrl] port {taken} was taken before the server bound it: starting again on {self.port}\n")
        self.start()

    def pids(self) -> list[int]:
        """The server and every process it started (same session) that has not exited (zombies left out)."""
        import psutil

        if self.proc is None:
            return []
        out = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if os.getsid(p.info["pid"]) == self.proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(p.info["pid"])
            except (ProcessLookupError, PermissionError):
                continue
        return out

    def stop(self, timeout: float = 20.0) -> None:
        """End the server at once: SIGKILL to its processes but multiprocessing's resource tracker, which
        then unlinks the shared memory and semaphores they registered and exits by itself; whatever is left
        after ``timeout`` is killed. SGLang ends its own children with SIGKILL too. A SIGTERM instead has it
        drain requests first, or, when a child goes first (a SIGTERM to the group), wait 5 s before its
        cleanup, while the tracker dies of it and the segments stay in /dev/shm. SIGKILL also ends a
        stopped (SIGSTOPped) process."""
        if self.proc is None:
            return
        # SGLang never unlinks the load-report files its schedulers keep there (one per start would pile up)
        leftovers = open_files(self.pids(), "/dev/shm/sglang_loads_")
        deadline = time.monotonic() + timeout
        while (rest := [p for p in self.pids() if not _is_resource_tracker(p)]) or self.alive():
            for pid in rest:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        while self.pids() and time.monotonic() < deadline:  # the trackers' cleanup
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)
        reap_zombies(session=self.proc.pid)  # the server's children, handed to this process when it died
        for path in leftovers:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self._pump is not None:
            self._pump.join(timeout=5)  # EOF once the whole group has exited
        _LIVE.discard(self)

    def kill(self) -> None:
        """For an engine judged dead or hung, which has nothing to finish: ``stop`` with a 10 s bound."""
        self.stop(timeout=10.0)

    def __enter__(self) -> "Engine":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def engines_from_config(eng, model_path: str, *, log_dir: str, names: list[str] | None = None,
                        host: str = "127.0.0.1", lora: LoraEngineSpec | None = None) -> list["Engine"]:
    """The ``count`` servers of an ``EngineConfig`` (not started). On GPUs, engine i takes the ``tp * dp``
    GPUs from ``base_gpu_id + i * tp * dp``; ``base_gpu_id`` null = after the GPUs of the trainer ranks on
    this node. ``lora``: ``mrl.config.lora_engine.lora_engine_spec`` of the run's config (None: LoRA off)."""
    names = names or [f"engine{i}" for i in range(eng.count)]
    per = eng.tp * eng.dp
    base = eng.base_gpu_id if eng.base_gpu_id is not None else gpu_mode.trainer_gpus_on_this_node()
    return [Engine(model_path=model_path, tp=eng.tp, ep=eng.ep, dp=eng.dp, cpu_mode=eng.cpu_mode,
                   cpu_batched_attention=eng.cpu_batched_attention, memory_saver=eng.memory_saver, name=n, host=host,
                   log_dir=log_dir, server_args=dict(eng.server_args),
                   max_running_requests=eng.max_running_requests,
                   max_total_tokens=eng.max_total_tokens or (4096 if eng.cpu_mode else None),
                   base_gpu_id=base + i * per, mem_fraction_static=eng.mem_fraction_static,
                   attention_backend=eng.attention_backend, sampling_backend=eng.sampling_backend, dtype=eng.dtype,
                   kv_cache_dtype=eng.kv_cache_dtype, quantization=eng.quantization, cpu_threads=eng.cpu_threads,
                   lora=lora,
                   compile_cache_dir=eng.compile_cache_dir, moe_kernel_configs=eng.moe_kernel_configs,
                   cpus=list(eng.cpus) if eng.cpus is not None and eng.cpu_mode else None)
            for i, n in enumerate(names)]


def start_job_engines(cfg) -> list["Engine"]:
    """Start the engines of a run's ``cfg.engine`` that the job owns; the caller awaits their health. FP8
    engines start from the run's block-FP8 export of ``model.hf_path`` (made here on the first start)."""
    from mrl.config.lora_engine import lora_engine_spec
    from mrl.engine.fp8_model import engine_model_path

    engines = engines_from_config(cfg.engine, engine_model_path(cfg), log_dir=os.path.join(cfg.run_dir, "engines"),
                                  lora=lora_engine_spec(cfg))
    for e in engines:
        e.start()
    return engines


def stop_all() -> None:
    for eng in list(_LIVE):
        eng.stop(timeout=5.0)


atexit.register(stop_all)
