"""Keys that left ``rollout:`` for ``engine:``: refused wherever a config can set them (command line, YAML
preset or experiment, a run directory's config.yaml), with one line naming the new key."""

import dataclasses
import os
import subprocess
import sys

import pytest

from mrl.config.engine import EngineConfig
from mrl.config.load import compose, load_resolved
from mrl.config.moved import MOVED, MovedKeyError, REMOVED
from mrl.config.schema import RolloutConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_engine_field_has_its_old_key_and_none_is_left_in_rollout():
    assert sorted(MOVED.values()) == sorted(f"engine.{f.name}" for f in dataclasses.fields(EngineConfig))
    rollout = {f"rollout.{f.name}" for f in dataclasses.fields(RolloutConfig)}
    assert not rollout & (set(MOVED) | set(REMOVED))


@pytest.mark.parametrize("override,message", [
    ("rollout.num_engines=2", "rollout.num_engines moved to engine.count"),
    ("rollout.engine_tp=2", "rollout.engine_tp moved to engine.tp"),
    ("rollout.restart_engines=0", "rollout.restart_engines moved to engine.max_restarts"),
    ("rollout.engine_url_dir=/x", "rollout.engine_url_dir moved to engine.url_dir"),
    ("rollout.cpu_mode=false", "rollout.cpu_mode moved to engine.cpu_mode"),
    ("+rollout.server_args.x=1", "rollout.server_args.x moved to engine.server_args.x"),
    ("~rollout.cpus", "rollout.cpus moved to engine.cpus"),
    ("rollout=gpu_tp8", "rollout=gpu_tp8 moved to engine=gpu_tp8 rollout=long"),
    ("rollout=cpu", "rollout=cpu moved to engine=cpu"),
    ("rollout={engine_dp: 2}", "rollout.engine_dp moved to engine.dp"),  # found in Hydra's error
    ("rollout.client_process=false", "rollout.client_process was removed: the rollout client always runs in "
                                     "its own process"),
])
def test_old_overrides_name_the_new_key(override, message):
    with pytest.raises(MovedKeyError) as e:
        compose([override])
    assert str(e.value) == message


_SEQUENCE = ("algo.correction_level=sequence (the geometric mean of the token ratios) is now sequence_geomean; "
             "sequence_product is the unbiased product of the token ratios")


@pytest.mark.parametrize("override,message", [
    ("algo.correction_level=sequence", _SEQUENCE),
    ("algo.mis_low=0.5", "algo.mis_low was removed: masked IS (algo.correction=mis) rejects only sequences whose "
                         "weight exceeds algo.mis_high, as its paper does; a two-sided band per token is "
                         "algo.correction=icepop (icepop_low/icepop_high)"),
])
def test_renamed_correction_settings_are_refused_naming_what_they_are_now(tmp_path, override, message):
    with pytest.raises(MovedKeyError) as e:
        compose([override])
    assert str(e.value) == message
    key, value = override.split("=")
    (tmp_path / "config.yaml").write_text(f"algo:\n  {key.split('.')[1]}: {value}\n")  # an older run directory
    with pytest.raises(MovedKeyError) as e:
        load_resolved(str(tmp_path / "config.yaml"))
    assert str(e.value) == message


def _old_experiments(tmp_path):
    exp = tmp_path / "conf" / "experiment"
    exp.mkdir(parents=True)
    (exp / "old_key.yaml").write_text("# @package _global_\nrollout:\n  n_samples_per_prompt: 2\n  engine_tp: 2\n")
    (exp / "old_preset.yaml").write_text("# @package _global_\ndefaults:\n  - override /rollout: gpu\n")
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


@pytest.mark.parametrize("experiment,message", [("old_key", "rollout.engine_tp moved to engine.tp"),
                                                ("old_preset", "rollout=gpu moved to engine=gpu")])
def test_yaml_that_sets_an_old_key_names_the_new_one(tmp_path, experiment, message):
    with pytest.raises(MovedKeyError, match=f"^{message}$"):
        compose([_old_experiments(tmp_path), f"+experiment={experiment}"])


def test_a_run_directory_of_old_keys_names_the_new_ones(tmp_path):
    (tmp_path / "config.yaml").write_text("rollout:\n  num_engines: 2\n  temperature: 0.5\n")
    with pytest.raises(MovedKeyError, match="^rollout.num_engines moved to engine.count$"):
        load_resolved(str(tmp_path / "config.yaml"))


NEEDS = {"countdown_opd": "scoring.teacher.hf_path"}
"""Experiments that need a path of the user's (a teacher): refused without it, naming the key."""


@pytest.mark.parametrize("experiment", sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "conf", "experiment"))))
def test_shipped_experiments_compose(experiment, tmp_path):
    if need := NEEDS.get(experiment):
        with pytest.raises(ValueError, match=need):
            compose([f"+experiment={experiment}"])
        compose([f"+experiment={experiment}", f"{need}={tmp_path}"])
    else:
        compose([f"+experiment={experiment}"])


def _mrl(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "mrl", *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_cli_refuses_old_keys_before_anything_starts(tmp_path):
    run = tmp_path / "run"
    for args, message in ((["train", "rollout.num_engines=2"], "rollout.num_engines moved to engine.count"),
                          (["train", _old_experiments(tmp_path), "+experiment=old_key"],
                           "rollout.engine_tp moved to engine.tp")):
        out = _mrl(*args, f"run_dir={run}")
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr == f"[mrl] invalid config: {message}\n"
        assert not run.exists()


def test_the_cli_keeps_hydras_report_of_other_composition_errors():
    out = _mrl("check", "rollout.nope=1")
    assert out.returncode == 1
    assert "Could not override 'rollout.nope'" in out.stderr and "full_key: rollout.nope" in out.stderr
    assert "HYDRA_FULL_ERROR=1 for a complete stack trace" in out.stderr
