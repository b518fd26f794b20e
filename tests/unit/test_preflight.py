"""Preflight (mrl/preflight.py): each bad input of a run is one line naming the field and the value, found
before anything starts; a good config passes. ``mrl train`` with a bad input exits 2 in seconds, leaving no
run directory and no process.

The checks run in this process on composed configs (what ``mrl train`` composes); the end-to-end tests run
the ``mrl`` command itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.reliability
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")
EXPERT = "model.layers.0.mlp.experts.3.down_proj.weight"
ONE_CHECK_S = 5.0  # the bound for one failing check, taken in this process (the CLI adds its start-up)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mrl.config.schema import TinyPreset
    from mrl.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny"), TinyPreset.tiny)


def _copy(tiny: str, tmp_path) -> str:
    dst = tmp_path / "model"
    shutil.copytree(tiny, dst)
    return str(dst)


def _truncated(tiny, tmp_path) -> str:
    path = _copy(tiny, tmp_path)
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 4096)  # a download cut short
    return path


def _edited(tiny, tmp_path, edit) -> str:
    from safetensors.torch import load_file, save_file

    path = _copy(tiny, tmp_path)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return path


def _missing_expert(tiny, tmp_path) -> str:
    return _edited(tiny, tmp_path, lambda t: t.pop(EXPERT))


def _mis_shaped_expert(tiny, tmp_path) -> str:
    return _edited(tiny, tmp_path, lambda t: t.update({EXPERT: t[EXPERT][:, :-1].contiguous()}))


def _missing_norm(tiny, tmp_path) -> str:
    """A tensor only the bridge knows is needed (no sibling shows it is missing)."""
    return _edited(tiny, tmp_path, lambda t: t.pop("model.norm.weight"))


def _no_tokenizer(tiny, tmp_path) -> str:
    path = _copy(tiny, tmp_path)
    os.remove(os.path.join(path, "tokenizer.json"))
    return path


def _jsonl(tmp_path, name: str, rows: list[str]) -> str:
    p = tmp_path / name
    p.write_text("\n".join(rows) + "\n")
    return str(p)


GOOD_ROW = '{"prompt": "2+2=", "answer": "4"}'


def _table(tmp_path, name: str, rows: list[dict]) -> str:
    """``rows`` as a file of the format its extension names, written by ``datasets``."""
    import datasets

    ds, path = datasets.Dataset.from_list(rows), str(tmp_path / name)
    ds.to_parquet(path) if name.endswith(".parquet") else ds.to_json(path)
    return path


def _garbage(tmp_path, name: str) -> str:
    (tmp_path / name).write_text("not a table")
    return str(tmp_path / name)


HF_ROWS = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+4=", "answer": "7"}]


def _listening_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    return s, s.getsockname()[1]


# case -> (setup(tiny, tmp_path) -> overrides, [what the one line must contain])
CASES = {
    "data file missing": (lambda tiny, t: ["data=jsonl", f"data.path={t}/nope.jsonl"],
                          ["data.path=", "nope.jsonl: no such file"]),
    "data file without a usable row": (
        lambda tiny, t: ["data=jsonl", "data.path=" + _jsonl(t, "bad.jsonl", ["{not json", '{"answer": "1"}']),
                         "train.eval_every=0"],
        ["data.path: no usable rows in", "bad.jsonl: 0 rows, 2 skipped (invalid_json: 1 at line 1; "
         "missing_key: 1 at line 2)"]),
    "malformed row under on_bad_row=error": (
        lambda tiny, t: ["data=jsonl", "data.path=" + _jsonl(t, "p.jsonl", [GOOD_ROW, "{not json"]),
                         "data.on_bad_row=error", "train.eval_every=0"],
        ["data.path: ", "p.jsonl:2: invalid_json: "]),
    "eval file missing": (
        lambda tiny, t: ["data=jsonl", "data.path=" + _jsonl(t, "p.jsonl", [GOOD_ROW]),
                         f"data.eval_path={t}/held_out.jsonl"],
        ["data.eval_path=", "held_out.jsonl: no such file"]),
    "eval split missing": (
        lambda tiny, t: ["data=jsonl", "data.path=" + _jsonl(t, "p.jsonl", [GOOD_ROW])],
        ["data.eval_path: not set", "train.eval_every=10"]),
    "data=hf file missing": (lambda tiny, t: ["data=hf", f"data.path={t}/nope.parquet"],
                             ["data.path=", "nope.parquet: no such file"]),
    "data=hf glob matching nothing": (lambda tiny, t: ["data=hf", f"data.path={t}/train-*.parquet"],
                                      ["data.path=", "train-*.parquet: no file matches"]),
    "data=hf file unreadable": (lambda tiny, t: ["data=hf", f"data.path={_garbage(t, 'bad.parquet')}"],
                                ["data.path=", "bad.parquet: cannot be read as parquet: ArrowInvalid"]),
    "data=hf file of an unknown format": (
        lambda tiny, t: ["data=hf", f"data.path={_garbage(t, 'p.csv')}"],
        ["data.path=", "p.csv: cannot tell the format from the extension '.csv'; set data.format"]),
    "data=hf column missing": (
        lambda tiny, t: ["data=hf", "data.path=" + _table(t, "q.parquet", [{"question": "2+2=", "answer": "4"}])],
        ["data.prompt_key=prompt: no column 'prompt' in ", "q.parquet (columns: ['question', 'answer'])"]),
    "data=hf column of another type": (
        lambda tiny, t: ["data=hf", "data.path=" + _table(t, "q.parquet", [{"prompt": 2, "answer": "4"}])],
        ["data.prompt_key=prompt: column 'prompt' of ", "q.parquet holds int64, not text"]),
    "data=hf eval file missing": (
        lambda tiny, t: ["data=hf", "data.path=" + _table(t, "p.parquet", HF_ROWS), f"data.eval_path={t}/e.jsonl"],
        ["data.eval_path=", "e.jsonl: no such file"]),
    "data=hf nothing held out": (
        lambda tiny, t: ["data=hf", "data.path=" + _table(t, "p.parquet", HF_ROWS), "data.eval_fraction=0"],
        ["data.eval_path: not set and data.eval_fraction=0", "(or train.eval_every=0)"]),
    "data=hf every prompt over the budget": (
        lambda tiny, t: ["data=hf", "data.path=" + _table(t, "p.jsonl", HF_ROWS), "data.max_prompt_tokens=1",
                         "data.eval_fraction=0",
                         "train.eval_every=0"],
        ["data.path=", "p.jsonl: no usable prompt in the train split", "0 prompts of 2 rows, 2 skipped (too_long: 2 "
         "at rows 1, 2); prompt budget 1 tokens (data.max_prompt_tokens)"]),
    "data=hf chat messages without a chat template": (
        lambda tiny, t: ["data=hf", "data.messages_key=messages", "train.eval_every=0", "data.path=" + _table(
            t, "c.parquet", [{"messages": [{"role": "user", "content": "hi"}], "answer": "x"}])],
        ["data.messages_key=messages: ", "c.parquet holds chat messages, but the model's tokenizer (",
         ") has no chat template to render them"]),
    "reward fn with the wrong signature": (
        lambda tiny, t: ["reward.fn=tests.unit.preflight_fns.one_arg"],
        ["reward.fn='tests.unit.preflight_fns.one_arg': must accept (prompt, response_text), its signature "
         "is (prompt)"]),
    "reward fn module missing": (lambda tiny, t: ["reward.fn=no_such_pkg.rewards.score"],
                                 ["reward.fn='no_such_pkg.rewards.score': module 'no_such_pkg.rewards' not found"]),
    "env fn not an Environment": (lambda tiny, t: ["rollout.env.fn=tests.unit.preflight_fns.NotAnEnv"],
                                  ["rollout.env.fn='tests.unit.preflight_fns.NotAnEnv': NotAnEnv is not a "
                                   "subclass of mrl.env.Environment"]),
    "env fn args do not fit": (lambda tiny, t: ["rollout.env.fn=tests.unit.preflight_fns.TableEnv",
                                                "+rollout.env.args.tabel=x"],
                               ["rollout.env.fn='tests.unit.preflight_fns.TableEnv': cannot be called with "
                                "rollout.env.args={'tabel': 'x'}", "its signature is (table: str)"]),
    "model dir without config.json": (lambda tiny, t: [f"model.hf_path={t}", "model.make_tiny_if_missing=false"],
                                      ["model.hf_path=", "no config.json there"]),
    "truncated safetensors file": (
        lambda tiny, t: [f"model.hf_path={_truncated(tiny, t)}"],
        ["model.hf_path=", "model.safetensors: not a complete safetensors file", "incomplete metadata"]),
    "model missing one expert tensor": (
        lambda tiny, t: [f"model.hf_path={_missing_expert(tiny, t)}"],
        ["model.hf_path=", f"missing tensors: ['{EXPERT}']"]),
    "model with one expert tensor of another shape": (
        lambda tiny, t: [f"model.hf_path={_mis_shaped_expert(tiny, t)}"],
        ["model.hf_path=", f"mis-shaped tensors: {EXPERT} is [64, 31], its layer's other experts [64, 32]"]),
    "model missing its final norm": (lambda tiny, t: [f"model.hf_path={_missing_norm(tiny, t)}"],
                                     ["model.hf_path=", "missing tensors: ['model.norm.weight']"]),
    "model without a tokenizer": (lambda tiny, t: [f"model.hf_path={_no_tokenizer(tiny, t)}"],
                                  ["model.hf_path=", "tokenizer.json: missing"]),
    "layout that cannot shard the model": (
        lambda tiny, t: ["parallel.world_size=null", "parallel.ep=3"],
        ["parallel.ep: =3 does not divide the model's 8 experts"]),
    "world size that does not fit the layout": (
        lambda tiny, t: ["parallel.world_size=null", "parallel.tp=2", "parallel.ep=3", "parallel.etp=1"],
        ["parallel.tp/pp/cp: world size 3 is not divisible by tp*pp*cp = 2*1*1 = 2"]),
    "run dir under a file": (lambda tiny, t: [f"run_dir={_jsonl(t, 'a_file', [])}/run"],
                             ["run_dir=", "a_file/run: cannot be created:", "a_file is not a directory"]),
    "GPU engines on a host without GPUs": (lambda tiny, t: ["engine=gpu", "model.dtype=bf16"],
                                           ["engine.cpu_mode=false: "]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_bad_input_is_one_line_naming_field_and_value(case, tiny, tmp_path, reliability):
    from mrl.config.load import compose
    from mrl.preflight import run_preflight

    setup, want = CASES[case]
    run_dir = tmp_path / "run"
    extra = setup(tiny, tmp_path)
    overrides = [f"run_dir={run_dir}", *([] if any(o.startswith("model.hf_path=") for o in extra)
                                         else [f"model.hf_path={tiny}"]), *extra]
    cfg = compose(overrides)
    started = time.time()
    t0 = time.perf_counter()
    failures = run_preflight(cfg)
    seconds = time.perf_counter() - t0
    assert len(failures) == 1, failures
    line = failures[0]
    assert "\n" not in line
    for w in want:
        assert w in line, line
    assert seconds < ONE_CHECK_S, (case, seconds)
    assert not run_dir.exists()  # nothing written
    # nothing started (the test session, a subreaper, may still hold earlier tests' orphans)
    assert not [p for p in psutil.Process().children(recursive=True) if p.create_time() >= started - 0.02]
    reliability.record(category="bad_input", name=f"preflight: {case}", survived=True,
                       injected="mrl train " + " ".join(extra).replace(str(tmp_path), "<tmp>").replace(tiny, "<tiny>"),
                       expected="one line naming the field and the value, exit 2, nothing started",
                       message=line.replace(str(tmp_path), "<tmp>").replace(tiny, "<tiny>"),
                       details={"seconds": round(seconds, 3)})


def test_run_dir_others_can_write_is_refused_as_before(tmp_path):
    from mrl.config.load import compose
    from mrl.preflight import check_run_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    msg = check_run_dir(compose([f"run_dir={shared}"]), "local")
    assert msg.startswith(f"run_dir={shared} is writable by others (mode 0777)"), msg


def test_on_a_slurm_trainer_node_the_world_is_torchruns(monkeypatch):
    """``mrl train`` on a node of a multi-node trainer: the world is PET_NNODES * PET_NPROC_PER_NODE, not the
    smallest one the layout fits."""
    from mrl.config.load import compose
    from mrl.preflight import check_layout

    layout = ["parallel.world_size=null", "parallel.tp=2", "parallel.ep=3", "parallel.etp=1"]
    assert check_layout(compose(layout), "local").startswith("parallel.tp/pp/cp: world size 3")  # one machine
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    assert check_layout(compose(layout), "local") is None  # 6 ranks hold tp=2 and ep=3
    assert check_layout(compose(["parallel.world_size=null", "parallel.tp=4"]), "local") == (
        "parallel.tp/pp/cp: world size 6 is not divisible by tp*pp*cp = 4*1*1 = 4 (trainer world size = "
        "PET_NNODES * PET_NPROC_PER_NODE = 2*3)")


def test_a_taken_port_is_named(tmp_path):
    from mrl.config.load import compose
    from mrl.preflight import check_ports

    sock, port = _listening_port()
    with sock:
        cfg = compose([f"+engine.server_args.nccl_port={port}"])
        assert check_ports(cfg, "local") == (f"engine.server_args.nccl_port={port}: an engine's port is not free "
                                             "on this host (Address already in use)")
        assert check_ports(compose([f"+engine.server_args.nccl_port={port}",
                                    "engine.urls=[http://127.0.0.1:1]"]), "local") is None  # none started
    assert check_ports(cfg, "local") is None  # free again


def test_a_tracker_that_is_not_installed_is_named(monkeypatch):
    import importlib.util

    from mrl.config.load import compose
    from mrl.preflight import check_loggers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    msg = check_loggers(compose(["logger=[tensorboard,mlflow]"]), "local")
    assert msg == ("logger=['tensorboard', 'mlflow']: mlflow not installed; pip install 'mrl[tracking]' "
                   "(or drop it from logger)")


def test_a_good_config_passes(tiny, tmp_path):
    """The checks find nothing wrong with a run that works: the tiny model, a JSONL dataset, a user reward fn,
    a multi-turn task's environment."""
    from mrl.config.load import compose
    from mrl.preflight import run_preflight

    rows = _jsonl(tmp_path, "p.jsonl", [GOOD_ROW, "{not json"])  # one bad row: skipped and counted
    table = _table(tmp_path, "p.parquet", HF_ROWS)
    for overrides in ([], ["data=jsonl", f"data.path={rows}", f"data.eval_path={rows}"],
                      ["data=hf", f"data.path={table}", f"data.eval_path={table}"],
                      ["reward.fn=tests.unit.preflight_fns.good"], ["data=lookup"],
                      ["rollout.env.fn=tests.unit.preflight_fns.TableEnv", "+rollout.env.args.table=t"]):
        cfg = compose([f"model.hf_path={tiny}", f"run_dir={tmp_path / 'run'}", *overrides])
        assert run_preflight(cfg) == [], overrides
    assert not (tmp_path / "run").exists()


def test_every_built_in_checkpoint_passes_the_model_check(ckpt_dir):
    """No false alarm from the header-only expert check or the bridge's: each family's tiny checkpoint (dense
    first layers, shared experts, MoE every 2nd layer, multi-token-prediction layers) passes."""
    from mrl.config.load import compose
    from mrl.preflight import check_model

    for preset, path in sorted(ckpt_dir.items()):
        assert check_model(compose([f"model.hf_path={path}", "model.make_tiny_if_missing=false"]), "local") is None, \
            preset


def _leftovers(marker: str) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if marker in " ".join(p.info["cmdline"] or []):
            out.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])}")
    return out


def test_mrl_train_with_a_missing_data_file_exits_2_at_once(tmp_path, reliability):
    """The issue's example: before, 36 s, a trainer and an engine started and a torchrun dump."""
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    p = subprocess.run([MRL, "train", "data=jsonl", "data.path=/nonexistent.jsonl", f"run_dir={run_dir}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.splitlines() == ["[mrl] data.path=/nonexistent.jsonl: no such file"], p.stderr[-3000:]
    assert p.stdout == ""
    assert seconds < 15, seconds  # 5 s is the goal; a loaded CI box starts Python slowly
    assert not run_dir.exists()
    assert not _leftovers(str(tmp_path))
    reliability.record(category="bad_input", name="mrl train data.path=/nonexistent.jsonl", survived=True,
                       injected="mrl train data=jsonl data.path=/nonexistent.jsonl",
                       expected="exit 2 with one line, no run directory, no process", message=p.stderr.strip(),
                       details={"seconds": round(seconds, 2)})


def test_mrl_check_runs_the_preflight_alone(tiny, tmp_path):
    """``mrl check``: 0 for a good config, 2 and one line for a truncated checkpoint; nothing written either way."""
    run_dir = tmp_path / "run"
    args = [MRL, "check", f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok = subprocess.run([*args, f"model.hf_path={tiny}"], capture_output=True, text=True, timeout=120, cwd=REPO,
                        env=env)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "[mrl] preflight passed" in ok.stdout
    bad = _truncated(tiny, tmp_path)
    t0 = time.perf_counter()
    p = subprocess.run([*args, f"model.hf_path={bad}"], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=env)
    seconds = time.perf_counter() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(p.stderr.splitlines()) == 1 and "not a complete safetensors file" in p.stderr, p.stderr[-3000:]
    assert seconds < 15, seconds
    assert not run_dir.exists()


def test_mrl_launch_runs_the_preflight_before_writing_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run([MRL, "launch", "cluster=slurm_cpu", f"run_dir={run_dir}", "data=jsonl",
                        f"data.path={tmp_path}/nope.jsonl", "--dry-run"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.splitlines() == [f"[mrl] data.path={tmp_path}/nope.jsonl: no such file"], p.stderr[-3000:]
    assert not run_dir.exists()


def test_a_run_dir_without_room_for_one_checkpoint_is_refused(tiny, tmp_path, monkeypatch):
    """Every run saves at its end: a filesystem with less room than one checkpoint (a lower bound from
    config.json) fails before anything starts, naming the free space, the need and train.optimizer_checkpoint;
    with room, or for a LoRA run (adapters only), nothing is said."""
    import shutil
    from collections import namedtuple

    from mrl.config.load import compose
    from mrl.megatron.memory import checkpoint_bytes
    from mrl.models import get_bridge
    from mrl.preflight import check_checkpoint_space

    cfg = compose([f"model.hf_path={tiny}", f"run_dir={tmp_path / 'run'}"])
    b = get_bridge(tiny, json_config=True)
    params, need = checkpoint_bytes(b, dtype=cfg.model.dtype, optimizer_states_dtype=cfg.train.optimizer_states_dtype,
                                    padded_vocab=b.padded_vocab(cfg.model.vocab_divisible_by, 1),
                                    optimizer_checkpoint="dp_reshardable")
    assert need == params * (4 + 8)  # fp32 weights (their own master) + two fp32 moments
    usage = namedtuple("usage", "total used free")
    seen = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: seen.append(p) or usage(1 << 40, 0, need - 1))
    msg = check_checkpoint_space(cfg, "local")
    assert msg and f"run_dir={tmp_path / 'run'}" in msg and "train.optimizer_checkpoint=dp_reshardable" in msg
    assert seen == [str(tmp_path)]  # the nearest directory that exists
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, need))
    assert check_checkpoint_space(cfg, "local") is None
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 0))
    assert check_checkpoint_space(compose([f"model.hf_path={tiny}", f"run_dir={tmp_path / 'run'}",
                                           "model.lora.rank=4"]), "local") is None
    assert check_checkpoint_space(cfg, "submit") is None  # checked on the nodes, where run_dir lives


def test_mini_batches_that_do_not_split_a_dp_share_are_refused():
    from mrl.config.load import compose
    from mrl.preflight import check_layout

    base = ["train.prompts_per_step=4", "rollout.n_samples_per_prompt=3", "parallel=ep2"]  # 12 samples, dp=2
    assert check_layout(compose([*base, "algo.mini_batches=3"]), "local") is None
    assert check_layout(compose([*base, "algo.mini_batches=4"]), "local") == (
        "algo.mini_batches: is 4, but a step's 12 samples (train.prompts_per_step * rollout.n_samples_per_prompt) "
        "over 2 DP rank(s) do not split into 4 equal mini-batches per rank; choose a divisor of 6")
