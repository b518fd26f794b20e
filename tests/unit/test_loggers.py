"""Experiment trackers (mrl/loggers.py) behind MetricsLog: ``logger=[tensorboard,wandb,mlflow]``, offline.

Each tracker's files are read back (TensorBoard's event file, W&B's offline run file, MLflow's file store
through MlflowClient) and every scalar compared with ``metrics.jsonl``; each also got the config and the
curves. No engine is started: MetricsLog is driven as the loop's controller drives it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import struct
import sys
import time
from collections import Counter

import pytest

SFT = [(0, 2.5), (1, 2.0)]  # warm start: its steps restart from 0, below the RL steps already logged by then
STEPS = 4


def _drive(cfg, history=None, steps=range(1, STEPS + 1)):
    from mrl.metrics import MetricsLog

    log = MetricsLog(cfg.run_dir, total=STEPS, history=history, cfg=cfg)
    if history is None:
        for step, nll in SFT:
            log.scalar("sft/nll", nll, step)
    for s in steps:
        log.step(s, {"reward": 0.1 * s, "routing_disagreement": 0.01 * s, "sync_seconds": 0.5 + s,
                     "step_seconds": float("nan") if s == 2 else 1.0},
                 staleness=Counter({0: 3, 1: 1}), extra={"rollout/served_by_engine": {"e0": s}})
        if s % 2 == 0:
            log.scalar("eval/accuracy", 0.25 * s, s)
    log.close(cfg)
    return log


def _expected(run_dir) -> dict[tuple[str, int], float]:
    """Every scalar of metrics.jsonl under the trackers' name: {(key, step): value}."""
    from mrl.metrics import tracker_key

    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            step = row.pop("step")
            scalar_row = len(row) == 1  # MetricsLog.scalar: the key as given
            for k, v in row.items():
                if isinstance(v, (int, float)):
                    out[(k if scalar_row else tracker_key(k), step)] = float(v)
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


def _compare(got: dict[tuple[str, int], float], want: dict[tuple[str, int], float], who: str) -> None:
    assert set(got) == set(want), (who, sorted(set(want) ^ set(got))[:10])
    bad = [(k, got[k], want[k]) for k in want if not _same(got[k], want[k])]
    assert not bad, (who, bad[:5])


def _wandb_records(path: str):
    """The records of a W&B offline run file (``run-<id>.wandb``): W&B's LevelDB-style log (7-byte file
    header, 32 KiB blocks, records split in FULL/FIRST/MIDDLE/LAST chunks) of ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too small for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def _wandb_read(run_dir) -> tuple[dict, dict, list[dict], str]:
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    scalars, config, rows = {}, {}, []
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            rows.append(row)
            for k, v in row.items():  # W&B's own keys (_step, ...), the histogram's and the image's left out
                if k != "step" and not k.startswith(("_", "rollout/staleness/", "curves/")):
                    scalars[(k, row["step"])] = float(v)
    run_id = os.path.basename(path)[len("run-"):-len(".wandb")]
    return scalars, config, rows, run_id


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mrl.config.load import compose

    return compose([f"run_dir={tmp_path / 'run'}", "logger=[tensorboard,wandb,mlflow]", "tracking.offline=true",
                    "tracking.project=mrl-test", "tracking.run_name=offline-check"])


def test_every_tracker_gets_config_metrics_and_curves(offline):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import psutil

    cfg = offline
    started = time.time()
    _drive(cfg)
    # W&B's service process ended with the run (the session may still hold earlier tests' orphans)
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.create_time() >= started - 0.02 and p.status() != psutil.STATUS_ZOMBIE]
    want = _expected(cfg.run_dir)
    assert len(want) == len(SFT) + STEPS * 4 + STEPS // 2  # every scalar: warm start, 4 per step, evals

    # TensorBoard: the event file's scalars, the config as text, the curves as an image
    ea = EventAccumulator(os.path.join(cfg.run_dir, "tb"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    _compare({(tag, e.step): e.value for tag in ea.Tags()["scalars"] for e in ea.Scalars(tag)}, want, "tensorboard")
    assert ea.Tags()["images"] == ["curves"]
    assert "config/text_summary" in ea.Tags()["tensors"]

    # W&B offline run file
    scalars, config, rows, _ = _wandb_read(cfg.run_dir)
    _compare(scalars, want, "wandb")
    assert config["train"]["steps"] == cfg.train.steps and config["logger"] == ["tensorboard", "wandb", "mlflow"]
    assert any(r.get("curves/_type") == "image-file" for r in rows)

    # MLflow file store
    client = MlflowClient(tracking_uri="file:" + os.path.join(cfg.run_dir, "mlruns"))
    exp = client.get_experiment_by_name("mrl-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "offline-check"
    got = {(k, m.step): m.value for k in run.data.metrics for m in client.get_metric_history(run.info.run_id, k)}
    _compare(got, want, "mlflow")
    assert run.data.params["train.steps"] == str(cfg.train.steps)
    assert run.data.params["model.hf_path"] == cfg.model.hf_path
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.json", "curves.png"}


def test_a_resumed_run_continues_its_tracker_runs(offline):
    """A run resumed from a checkpoint (MetricsLog with a history) logs to the W&B and MLflow runs it began."""
    from mlflow.tracking import MlflowClient

    cfg = offline
    first = _drive(cfg, steps=range(1, 3))
    (wandb_first,) = glob.glob(os.path.join(cfg.run_dir, "wandb", "offline-run-*"))
    _drive(cfg, history=first.history, steps=range(3, STEPS + 1))
    # offline-run-<date>_<time>-<run id>[-n]: W&B numbers a second directory of the same second and run
    run_id = re.compile(r"offline-run-\d{8}_\d{6}-([^-]+)")
    wandb_ids = {run_id.match(os.path.basename(p)).group(1)
                 for p in glob.glob(os.path.join(cfg.run_dir, "wandb", "offline-run-*"))}
    assert wandb_ids == {run_id.match(os.path.basename(wandb_first)).group(1)}
    client = MlflowClient(tracking_uri="file:" + os.path.join(cfg.run_dir, "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("mrl-test").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reward")] == list(range(1, STEPS + 1))


def test_unknown_logger_is_one_clear_line():
    from mrl.config.load import compose

    with pytest.raises(ValueError, match=r"^logger: unknown logger 'comet'; choose from \['tensorboard', 'wandb', "
                                         r"'mlflow'\]$"):
        compose(["logger=[tensorboard,comet]"])


def test_a_tracker_not_installed_names_logger_and_extra(tmp_path, monkeypatch):
    from mrl.config.load import compose
    from mrl.loggers import make_loggers

    monkeypatch.setitem(sys.modules, "wandb", None)  # what an install without the extra gives: ImportError
    cfg = compose([f"run_dir={tmp_path}", "logger=[wandb]"])
    with pytest.raises(ImportError, match=r"^logger=wandb: the wandb package is not installed .*; "
                                          r"pip install 'mrl\[tracking\]'$"):
        make_loggers(cfg)


def test_a_failing_tracking_server_neither_stops_nor_holds_the_run(tmp_path, monkeypatch, capsys):
    """MLflow's calls (HTTP to a server) go out from a thread of their own: a server that hangs and then fails
    costs the loop nothing, and its first error is one line."""
    import time

    from mrl.config.load import compose
    from mrl.loggers import MlflowLogger

    cfg = compose([f"run_dir={tmp_path}", "logger=[mlflow]", "tracking.offline=true"])
    lg = MlflowLogger(cfg, None)
    calls = []

    def down(*args, **kwargs):
        calls.append(kwargs)
        time.sleep(0.2)
        raise ConnectionError("tracking server down")

    monkeypatch.setattr(lg.client, "log_batch", down)
    t0 = time.perf_counter()
    for step in range(5):
        lg.log_metrics(step, {"train/reward": 1.0})
    assert time.perf_counter() - t0 < 0.1  # 5 calls of 0.2 s each: none waited for
    lg.close()
    assert len(calls) == 5  # every call was made before close() returned
    err = [line for line in capsys.readouterr().err.splitlines() if "logger=mlflow" in line]
    assert err == ["[mrl] logger=mlflow: ConnectionError: tracking server down (further MLflow errors not shown)"]
