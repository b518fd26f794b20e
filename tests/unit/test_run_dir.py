"""Whoever can write the run directory controls the run: it is created 0700 and refused when another user owns
it or others can write it; the loop state is JSON (loading a checkpoint runs no code); no ``torch.load`` in
mrl unpickles arbitrary objects; engine announcements are followed only to hosts of the job, from files of
this user.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.reliability
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")


def test_run_dir_is_private_and_refused_when_others_can_write_it(tmp_path, reliability):
    from mrl.cluster.rundir import UnsafeRunDir, secure_run_dir

    fresh = tmp_path / "a" / "run"
    secure_run_dir(str(fresh))
    assert (fresh.stat().st_mode & 0o777) == 0o700
    secure_run_dir(str(fresh))  # an existing private one is fine
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode, who in ((0o775, "its group"), (0o757, "others")):
        shared.chmod(mode)
        with pytest.raises(UnsafeRunDir, match=f"run_dir={shared} is writable by {who}"):
            secure_run_dir(str(shared))
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)
    else:
        foreign = pathlib.Path("/")  # root's
    with pytest.raises(UnsafeRunDir, match=f"run_dir={foreign} is owned by .*uid {os.stat(foreign).st_uid}"):
        secure_run_dir(str(foreign))

    shared.chmod(0o777)
    p = subprocess.run([MRL, "train", f"run_dir={shared}"], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 2, p.stderr[-2000:]  # the preflight's refusal: before anything is written or started
    assert f"[mrl] run_dir={shared} is writable by others (mode 0777)" in p.stderr, p.stderr[-2000:]
    assert not (shared / "config.yaml").exists()
    reliability.record(category="bad_input", name="world-writable run directory", survived=True,
                       injected="mrl train run_dir=<a 0777 directory>", expected="exit 2 naming the path",
                       message=p.stderr.strip().splitlines()[-1].replace(str(tmp_path), "<tmp>"))


def test_loop_state_is_json_and_pickles_are_not_loaded(tmp_path, reliability):
    from mrl.data import Prompt
    from mrl.rollout.buffer import Group
    from mrl.rollout.sample import Sample
    from mrl.trainer.state import LoopState, latest_checkpoint, state_from_json, state_to_json

    routes = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    s = Sample(prompt_ids=[1, 2], group_id=3, index=0, max_new_tokens=4, response_ids=[5], response_logprobs=[-0.5],
               versions=[7], routes=routes, finish_reason="stop", metadata={"turns": [1, 2]})
    state = LoopState(step=4, version=5, prompt_index=9, history=[{"reward": 0.5, "grad_norm": float("nan")}],
                      buffered=[Group(prompt=Prompt(id="p1", text="t", answer="a", meta={"k": 1}), samples=[s],
                                      rewards=[1.0], texts=["x"])])
    text = json.dumps(state_to_json(state))
    back = state_from_json(json.loads(text))
    assert isinstance(back, LoopState) and back.step == 4 and back.prompt_index == 9
    g = back.buffered[0]
    assert g.prompt == state.buffered[0].prompt and g.rewards == [1.0]
    assert g.samples[0].routes.dtype == np.uint8 and np.array_equal(g.samples[0].routes, routes)
    assert g.samples[0].response_logprobs == [-0.5] and g.samples[0].metadata == {"turns": [1, 2]}
    with pytest.raises(ValueError, match="unknown type 'Popen'"):
        state_from_json({"__type__": "Popen", "args": ["sh"]})
    with pytest.raises(ValueError, match="only numbers are stored"):
        state_from_json({"__ndarray__": "|O", "shape": [1], "data": ""})

    from mrl.config.load import compose

    cfg = compose([f"run_dir={tmp_path}"])
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_2" / "loop_state.pkl").write_bytes(b"cos\nsystem\n(S'touch /tmp/x'\ntR.")
    with pytest.raises(ValueError, match=r"hold a pickled loop state \(loop_state.pkl"):
        latest_checkpoint(cfg)
    (tmp_path / "checkpoints" / "step_3").mkdir()
    (tmp_path / "checkpoints" / "step_3" / "loop_state.json").write_text(text)
    assert latest_checkpoint(cfg) == str(tmp_path / "checkpoints" / "step_3")
    reliability.record(category="bad_input", name="pickled loop state in a checkpoint", survived=True,
                       injected="checkpoints/step_2/loop_state.pkl holding a pickle that runs a command",
                       expected="never unpickled: resume refuses it naming the file", message="ValueError")


def test_no_torch_load_in_mrl_unpickles_objects():
    """``torch.load`` without ``weights_only=True`` runs code a checkpoint file names."""
    offenders = []
    for path in pathlib.Path(REPO, "mrl").rglob("*.py"):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.load(" in line and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{no}: {line.strip()}")
    assert not offenders, offenders


def test_engine_announcements_only_for_hosts_of_the_job(tmp_path, reliability):
    from mrl.cluster.engines import UntrustedEngineURL, announce, job_addresses, read_urls

    allowed = job_addresses()
    assert "127.0.0.1" in allowed
    d = tmp_path / "engines"
    announce(str(d), "node0-engine0", "http://127.0.0.1:30000")
    assert read_urls(str(d), allowed) == {"node0-engine0": "http://127.0.0.1:30000"}
    announce(str(d), "evil-engine0", "http://203.0.113.7:30000")  # TEST-NET-3: no host of this job
    with pytest.raises(UntrustedEngineURL, match=r"evil-engine0.url: engine http://203.0.113.7:30000 is not on a "
                                                 r"host of this job"):
        read_urls(str(d), allowed)
    os.remove(d / "evil-engine0.url")
    announce(str(d), "odd-engine0", "file:///etc/passwd")
    with pytest.raises(UntrustedEngineURL, match="is not an engine URL"):
        read_urls(str(d), allowed)
    os.remove(d / "odd-engine0.url")
    (d / "node0-engine0.url").chmod(0o666)
    with pytest.raises(UntrustedEngineURL, match="only a file of uid"):
        read_urls(str(d), allowed)
    (d / "node0-engine0.url").chmod(0o644)
    d.chmod(0o777)
    with pytest.raises(UntrustedEngineURL, match=f"engine.url_dir {d}: owned by uid"):
        read_urls(str(d), allowed)
    reliability.record(category="bad_input", name="engine URL file naming a foreign host", survived=True,
                       injected="<engine_url_dir>/evil-engine0.url = http://203.0.113.7:30000",
                       expected="refused naming the file and the URL", message="UntrustedEngineURL")
