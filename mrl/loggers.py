"""Experiment trackers behind ``MetricsLog`` (``logger=[tensorboard,wandb,mlflow]``), rank 0 only.

    loggers = make_loggers(cfg, resuming=bool(history))   # one per name in cfg.logger
    for lg in loggers:
        lg.log_config(config_dict(cfg))
        lg.log_metrics(step, {"train/reward": 0.5})
        lg.log_image("curves", "run/curves.png")
        lg.close()

Each tracker gets the resolved config, every scalar ``MetricsLog`` records (under the names TensorBoard shows,
with the trainer's step) and the curves. W&B and MLflow are optional (``pip install 'mrl[tracking]'``) and
imported only when listed. A resumed run (``train.resume``) continues the tracker runs it logged to before:
their ids are kept in ``<run_dir>/trackers.json``.
"""

from __future__ import annotations

import abc
import json
import os
import queue
import threading
import time
from typing import Any

from mrl.log import get_logger

EXTRA_HINT = "pip install 'mrl[tracking]'"
IDS_FILE = "trackers.json"
log = get_logger(__name__)


class Logger(abc.ABC):
    """One tracker. Scalars are keyed by name with the trainer's step; images are files (PNG). Every tracker
    takes scalars; the other methods are optional (a tracker without them ignores them)."""

    name = ""

    def log_config(self, config: dict[str, Any]) -> None:
        """The run's resolved config (nested dicts)."""

    @abc.abstractmethod
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Scalars of one step, by their tracker name (``mrl.metrics.tracker_key``)."""

    def log_histogram(self, key: str, values, step: int) -> None:
        """A distribution (e.g. sample staleness); trackers without histograms ignore it."""

    def log_image(self, key: str, path: str) -> None:
        """An image file, logged once (the curves at the end of the run)."""

    def close(self) -> None:
        """Flush and end the tracker's run."""


def _require(module: str, logger: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"logger={logger}: the {module} package is not installed ({e}); {EXTRA_HINT}") from None


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (the config's own key paths)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_dict(cfg) -> dict[str, Any]:
    """The resolved config as plain nested dicts (enums as their values)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


class TensorBoardLogger(Logger):
    name = "tensorboard"

    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, "tb"))

    def log_config(self, config: dict[str, Any]) -> None:
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def log_histogram(self, key: str, values, step: int) -> None:
        self.writer.add_histogram(key, values, step)

    def log_image(self, key: str, path: str) -> None:
        from matplotlib.image import imread

        self.writer.add_image(key, imread(path)[..., :3], dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


def _run_name(cfg) -> str:
    return cfg.tracking.run_name or os.path.basename(os.path.abspath(cfg.run_dir))


class WandbLogger(Logger):
    """A W&B run in ``tracking.project``; offline (``tracking.offline`` or ``WANDB_MODE=offline``) its files
    stay under ``run_dir/wandb`` (``$WANDB_DIR`` when set) for ``wandb sync``. Every scalar is logged with
    the trainer's step as its x axis (``step``): the warm start's steps and the RL steps restart from 0 and 1,
    which W&B's own step, always increasing, could not take."""

    name = "wandb"

    def __init__(self, cfg, run_id: str | None):
        wandb = _require("wandb", self.name)
        self.wandb = wandb
        self.run = wandb.init(project=cfg.tracking.project, name=_run_name(cfg), id=run_id,
                              resume="allow" if run_id else None,
                              dir=os.environ.get("WANDB_DIR") or cfg.run_dir,
                              mode="offline" if cfg.tracking.offline else None, reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @property
    def run_id(self) -> str:
        return self.run.id

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"step": step, **metrics})

    def log_histogram(self, key: str, values, step: int) -> None:
        self.run.log({"step": step, key: self.wandb.Histogram(values)})

    def log_image(self, key: str, path: str) -> None:
        self.run.log({key: self.wandb.Image(path)})

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # W&B's service process (wandb-core) ends with the run, not at interpreter exit


class MlflowLogger(Logger):
    """An MLflow run in the experiment ``tracking.project``, through ``MlflowClient`` (no global active run):
    the config as parameters (key paths) and ``config.json``, each scalar as a metric at the trainer's step,
    the curves as an artifact. Tracking URI: ``tracking.mlflow_tracking_uri``, else a file store in
    ``run_dir/mlruns`` with ``tracking.offline``, else MLflow's own (``$MLFLOW_TRACKING_URI``). MLflow 3
    refuses ``file:`` stores unless ``MLFLOW_ALLOW_FILE_STORE=true``, which is set for a ``file:`` URI."""

    name = "mlflow"
    MAX_PARAMS = 100  # MLflow's limit on parameters in one log_batch
    MAX_METRICS = 1000  # and on metrics
    MAX_PARAM_CHARS = 6000  # a longer value is refused; cut, and the whole config is in config.json
    CLOSE_TIMEOUT_S = 120.0  # the queued calls' last chance at the end of the run

    def __init__(self, cfg, run_id: str | None):
        _require("mlflow", self.name)
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking.mlflow_tracking_uri
        if uri is None and cfg.tracking.offline:
            uri = "file:" + os.path.join(os.path.abspath(cfg.run_dir), "mlruns")
        if uri is not None and uri.startswith("file:"):
            # MLflow 3 keeps its file store working but refuses it unless asked: a file store is what was asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.resumed = run_id is not None
        if run_id is None:
            exp = self.client.get_experiment_by_name(cfg.tracking.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.tracking.project)
            run_id = self.client.create_run(exp_id, run_name=_run_name(cfg),
                                            tags={"mrl.run_dir": os.path.abspath(cfg.run_dir)}).info.run_id
        self.run_id = run_id
        # the calls are HTTP to a tracking server: sent from a thread of their own so that a slow or
        # unreachable server never holds up a training step; the first failure is reported, the run goes on
        self._calls: queue.Queue = queue.Queue()
        self.error: Exception | None = None
        self._sender = threading.Thread(target=self._send, name="mlflow-logger", daemon=True)
        self._sender.start()

    def _send(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args, kwargs = call
            try:
                fn(*args, **kwargs)
            except Exception as e:  # any failure of the tracker: reported once, never the run's
                if self.error is None:
                    log.warning("logger=mlflow: %s: %s (further MLflow errors not shown)", type(e).__name__, e)
                self.error = e

    def _call(self, fn, *args, **kwargs) -> None:
        self._calls.put((fn, (self.run_id, *args), kwargs))

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self._call(self.client.log_dict, config, "config.json")
        if self.resumed:  # MLflow parameters cannot change: the run's first start logged them
            return
        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                  for k, v in sorted(flatten(config).items())]
        params = [Param(p.key, p.value[:self.MAX_PARAM_CHARS]) for p in params]
        for i in range(0, len(params), self.MAX_PARAMS):
            self._call(self.client.log_batch, params=params[i:i + self.MAX_PARAMS])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), self.MAX_METRICS):
            self._call(self.client.log_batch, metrics=batch[i:i + self.MAX_METRICS])

    def log_image(self, key: str, path: str) -> None:
        self._call(self.client.log_artifact, path)

    def close(self) -> None:
        """Send what is queued (at most ``CLOSE_TIMEOUT_S``), then end the MLflow run."""
        self._call(self.client.set_terminated)
        self._calls.put(None)
        self._sender.join(self.CLOSE_TIMEOUT_S)
        if self._sender.is_alive():
            log.warning("logger=mlflow: %d calls not sent within %.0f s of the run's end; the MLflow run lacks them",
                        self._calls.qsize(), self.CLOSE_TIMEOUT_S)


def make_loggers(cfg, *, resuming: bool = False) -> list[Logger]:
    """The trackers of ``cfg.logger``; ``resuming``: continue the tracker runs named in ``trackers.json``."""
    ids_path = os.path.join(cfg.run_dir, IDS_FILE)
    ids: dict[str, str] = {}
    if resuming and os.path.isfile(ids_path):
        with open(ids_path) as f:
            ids = json.load(f)
    out: list[Logger] = []
    for name in cfg.logger:
        if name == "tensorboard":
            out.append(TensorBoardLogger(cfg.run_dir))
        elif name == "wandb":
            out.append(WandbLogger(cfg, ids.get(name)))
        elif name == "mlflow":
            out.append(MlflowLogger(cfg, ids.get(name)))
        else:
            raise ValueError(f"logger: unknown logger {name!r}")
    ids = {lg.name: lg.run_id for lg in out if getattr(lg, "run_id", None)}
    if ids:
        with open(ids_path, "w") as f:
            json.dump(ids, f)
    return out
