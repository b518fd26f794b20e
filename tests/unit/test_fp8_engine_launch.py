"""FP8 engines start from the run's block-FP8 export of ``model.hf_path`` (mrl.engine.fp8_model): made once,
reused by later starts of the run, redone when partial or of another source; ``start_job_engines`` hands its
path to the engines with ``--quantization fp8``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors import safe_open

from mrl.config.load import compose
from mrl.engine import fp8_model
from mrl.engine.fp8_model import FP8_DIR, MARKER, ensure_fp8_model
from mrl.quant.export import export_fp8


@pytest.fixture
def counted(monkeypatch):
    calls = []

    def export(src, dst, **kw):
        calls.append(dst)
        return export_fp8(src, dst, **kw)

    monkeypatch.setattr(fp8_model, "export_fp8", export)
    return calls


def test_exported_once_then_reused(ckpt_dir, tmp_path, counted):
    run = str(tmp_path / "run")
    path = ensure_fp8_model(ckpt_dir["tiny_gpu"], run, log=lambda *_: None)
    assert path == os.path.join(run, FP8_DIR) and len(counted) == 1
    assert counted[0].endswith(".partial") and not os.path.exists(counted[0])  # renamed when whole
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert str(f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype()) == "F8_E4M3"
    mtime = os.path.getmtime(os.path.join(path, MARKER))
    assert ensure_fp8_model(ckpt_dir["tiny_gpu"], run, log=lambda *_: None) == path  # a resumed run
    assert len(counted) == 1 and os.path.getmtime(os.path.join(path, MARKER)) == mtime


def test_partial_export_is_redone(ckpt_dir, tmp_path, counted):
    run = tmp_path / "run"
    (run / f"{FP8_DIR}.partial").mkdir(parents=True)  # a job killed mid-export
    (run / f"{FP8_DIR}.partial" / "model-00001.safetensors.partial").write_bytes(b"x")
    (run / FP8_DIR).mkdir()  # and a directory without the marker (written by hand, or an older mrl)
    (run / FP8_DIR / "config.json").write_text("{}")
    path = ensure_fp8_model(ckpt_dir["tiny_gpu"], str(run), log=lambda *_: None)
    assert len(counted) == 1 and os.path.isfile(os.path.join(path, MARKER))
    assert not (run / f"{FP8_DIR}.partial").exists()


def test_another_source_is_exported_again(ckpt_dir, tmp_path, counted):
    src = tmp_path / "model"
    shutil.copytree(ckpt_dir["tiny_gpu"], src)
    run = str(tmp_path / "run")
    ensure_fp8_model(str(src), run, log=lambda *_: None)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))  # model.hf_path changed
    ensure_fp8_model(str(src), run, log=lambda *_: None)
    assert len(counted) == 2
    with open(os.path.join(run, FP8_DIR, "config.json")) as f:
        assert json.load(f)["rms_norm_eps"] == 1e-5


def test_job_engines_start_from_the_export(ckpt_dir, tmp_path, monkeypatch, counted):
    from mrl.engine import launcher

    monkeypatch.setattr(launcher.Engine, "start", lambda self: self)
    run = tmp_path / "run"
    cfg = compose(["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8", "engine.count=2",
                   f"model.hf_path={ckpt_dir['tiny_gpu']}", f"run_dir={run}"])
    engines = launcher.start_job_engines(cfg)
    for e in engines:
        cmd = e.command()
        assert cmd[cmd.index("--model-path") + 1] == str(run / FP8_DIR)
        assert cmd[cmd.index("--quantization") + 1] == "fp8" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    launcher.start_job_engines(cfg)  # a second start of the run (resume)
    assert len(counted) == 1
    plain = compose(["engine=gpu", "model.dtype=bf16", f"model.hf_path={ckpt_dir['tiny_gpu']}", f"run_dir={run}"])
    (e,) = launcher.start_job_engines(plain)
    assert e.model_path == ckpt_dir["tiny_gpu"] and "--quantization" not in e.command()
