"""Evaluation off the trainer's path (``mrl.rollout.evaluation``): the pass@k estimator against a brute-force
count, the sets' config, and the loop's own ``run`` with the real controller and rollout side on a fake
engine whose evaluation completions take far longer than a step: the steps do not wait for them, the
results arrive tagged with the weight versions that generated them, and reach metrics.jsonl and the PNG."""

from __future__ import annotations

import itertools
import json
import math
import time
import types
from fractions import Fraction

import pytest
import torch.distributed

from mrl.rollout.evaluation import EvalResult, pass_at_k
from tests.conftest import one_rank_gloo_world
from tests.fakes.fake_sglang import FakeSGLang, FakeState


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_completion(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_exact_where_the_binomials_overflow_a_float():
    n, c, k = 2000, 3, 100  # C(2000, 100) ~ 1e180 ... C(2000, 1000) overflows a float
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(5000, 1, 2500) == pytest.approx(0.5, rel=1e-12)
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_eval_sets_config_refuses_what_it_cannot_measure():
    from mrl.config.load import compose
    from mrl.config.moved import MovedKeyError

    cfg = compose(["train.eval_sets.0.n=8", "train.eval_sets.0.k=[1,4,8]"])
    s = cfg.train.eval_sets[0]
    assert (s.name, s.source, s.greedy, s.n, s.k) == ("heldout", "heldout", True, 8, [1, 4, 8])
    two = compose(["train.eval_sets=[{name: a},{name: b, source: b.jsonl, n: 2, k: [2], greedy: false}]"])
    assert [x.name for x in two.train.eval_sets] == ["a", "b"] and two.train.eval_sets[1].max_prompts == 32
    assert [x.name for x in two.train.eval_files] == ["b"]
    for bad, msg in [(["train.eval_sets.0.n=2", "train.eval_sets.0.k=[4]"], r"k: must be distinct values in \[1, n=2"),
                     (["train.eval_sets.0.greedy=false"], "measures nothing"),
                     (["train.eval_sets.0.n=2", "train.eval_sets.0.temperature=0"], "temperature: must be > 0"),
                     (["train.eval_sets=[{name: a},{name: a}]"], r"names must be unique, \['a'\] repeat"),
                     (["train.eval_sets.0.name=a b"], "name: must be letters"),
                     (["train.eval_max_inflight=0"], "train.eval_max_inflight: must be >= 1")]:
        with pytest.raises(ValueError, match=msg):
            compose(bad)
    with pytest.raises(MovedKeyError, match="train.eval_prompts was removed: .*train.eval_sets.<i>.max_prompts"):
        compose(["train.eval_prompts=8"])


def test_a_missing_eval_file_fails_the_preflight(tmp_path):
    from mrl.config.load import compose
    from mrl.preflight import check_eval_sets

    cfg = compose([f"run_dir={tmp_path}/run", f"train.eval_sets=[{{name: gsm, source: {tmp_path}/none.jsonl}}]"])
    msg = check_eval_sets(cfg, "local")
    assert msg.startswith("train.eval_sets[gsm].source: ") and "No such file" in msg and "none.jsonl" in msg, msg
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "p", "answer": "a"}) + "\n")
    cfg = compose([f"run_dir={tmp_path}/run", f"train.eval_sets=[{{name: bad, source: {tmp_path}/bad.jsonl}}]"])
    msg = check_eval_sets(cfg, "local")
    assert msg.startswith("train.eval_sets[bad].source: no usable rows") and "missing_key" in msg, msg
    (tmp_path / "ok.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    cfg = compose([f"run_dir={tmp_path}/run", f"train.eval_sets=[{{name: ok, source: {tmp_path}/ok.jsonl}}]"])
    assert check_eval_sets(cfg, "local") is None


def test_the_console_line_names_the_versions_of_a_mixed_evaluation():
    from mrl.metrics import eval_line

    r = EvalResult(name="gsm", step=4, version=5, version_max=7, metrics={"greedy_pass_at_1": 0.5, "pass_at_4": 0.75},
                   prompts=8, completions=40, failed=1, mixed=0.25, seconds=3.0)
    line = eval_line(r, step_now=6)
    assert line.startswith("eval gsm step 4 (v5-7): greedy pass@1 0.500  pass@4 0.750")
    assert "25% of completions span a weight sync" in line and "1 completions failed" in line and "step 6" in line
    assert r.row()["eval/gsm/pass_at_4"] == 0.75 and r.row()["eval/gsm/version_max"] == 7.0


# -- the loop does not wait -----------------------------------------------------------------------------
EVAL_TOKENS = 150  # per evaluation completion, one fake-engine tick each: far longer than a step
STEPS = 6


class _Policy:
    lora = None
    version = types.SimpleNamespace(synced=lambda v: None)

    def rl_step(self, batch, normalizer):
        time.sleep(0.03)
        return {"loss": 0.0}


class _Channel:
    """The weight push: the fake engine's weights take the new version, as a real sync's would."""
    pauses_engines, engines, dropped, adapter = True, [], [], None

    def __init__(self, state: FakeState):
        self.state = state

    def sync(self, version):
        self.state.weight_version = version
        return types.SimpleNamespace(dropped_engines=[], bytes_sent=0, bytes_in_place=None, phase_seconds={},
                                     repaired_from_disk=[])

    def close(self):
        pass


def test_the_loop_does_not_wait_for_evaluation(tmp_path, ckpt_dir):
    from mrl.config.load import compose
    from mrl.rollout.service import LocalRollout
    from mrl.startup import StartupClock
    from mrl.trainer.controller import Controller
    from mrl.trainer.loop import Loop, NonFiniteSteps
    from mrl.trainer.phases import StepPhases
    from mrl.trainer.state import LoopState

    with one_rank_gloo_world(), FakeSGLang(state=FakeState(tick_s=0.004)) as srv:
        torch.distributed.init_process_group("gloo")  # the end-of-run wait is a round of broadcasts
        cfg = compose([f"run_dir={tmp_path}", f"model.hf_path={ckpt_dir['tiny']}", f"engine.urls=[{srv.url}]",
                       f"train.steps={STEPS}", "train.prompts_per_step=2", "train.max_inflight_groups=4",
                       "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=3", "train.replay=false",
                       "train.eval_every=2", "train.eval_max_inflight=2", "train.max_staleness=8",
                       "train.eval_sets.0.max_prompts=3", "train.eval_sets.0.n=3", "train.eval_sets.0.k=[1,3]",
                       f"train.eval_sets.0.max_new_tokens={EVAL_TOKENS}", "engine.max_restarts=0",
                       "train.save_hf=false", "logger=[tensorboard]"])
        duties = Controller(cfg, LoopState())
        duties.rollout = LocalRollout(cfg, ckpt_dir["tiny"], [srv.url], None, {
            "eos": None, "vocab_size": 512, "buffered": [], "prompt_index": 0, "redo_prompts": []})
        duties.codec = None
        loop = Loop.__new__(Loop)  # no model, no process group: the trainer's side is a stub
        loop.cfg, loop.clock, loop.step, loop.version, loop.saves = cfg, StartupClock(), 0, 0, None
        loop.policy, loop.duties, loop.syncer, loop.nonfinite = _Policy(), duties, _Channel(srv.st), NonFiniteSteps(0)
        loop.phases = StepPhases()
        loop.warm_start = lambda: None
        loop.connect_engines = lambda: duties.start_producing(cfg.train.max_inflight_groups, 0, 0)
        loop.take_batch = lambda: (duties.take_batch(loop.version), 1.0, {})
        loop.verify_engines = dict
        loop.maybe_checkpoint = lambda: False
        finished = []
        end = duties.finish_evaluations
        duties.finish_evaluations = lambda w: (finished.append(time.perf_counter()), end(w))[1]
        t0 = time.perf_counter()
        loop.run()
        rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "step_seconds" in r]
    evals = [r for r in rows if "eval/heldout/pass_at_3" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # the whole loop took less time than its first evaluation alone (submitted before step 1): no step
    # waited for it; each step's eval phase is the submission and collection only
    one_completion = EVAL_TOKENS * 0.004
    assert finished[0] - t0 < evals[0]["eval/heldout/seconds"], (finished[0] - t0, evals[0])
    assert all(r.get("eval_seconds", 0.0) < 0.25 for r in steps), [r.get("eval_seconds") for r in steps]
    # the first evaluation (before step 1, on v0) and the last step's (skipped while the first ran, then
    # waited for at the run's end) are reported at the steps they measured, with their versions
    assert [r["step"] for r in evals] == [0, STEPS], evals
    first, last = evals
    assert first["eval/heldout/version"] == 0 and first["eval/heldout/version_max"] > 0  # syncs landed mid-way
    assert first["eval/heldout/mixed"] > 0
    assert last["eval/heldout/version"] == STEPS and last["eval/heldout/version_max"] == STEPS
    for r in evals:
        assert r["eval/heldout/seconds"] > one_completion and r["eval/heldout/failed"] == 0
        assert 0.0 <= r["eval/heldout/pass_at_1"] <= r["eval/heldout/pass_at_3"] <= 1.0
        assert r["eval/accuracy"] == r["eval/heldout/greedy_pass_at_1"]
    assert (tmp_path / "curves.png").is_file()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["eval/heldout/pass_at_3"]["first"] == first["eval/heldout/pass_at_3"]


def test_each_set_gets_a_panel_of_its_pass_rates_in_order_of_k():
    from mrl.metrics import eval_panels

    rows = [{"step": 0, "eval/a/pass_at_10": 0.5, "eval/a/greedy_pass_at_1": 0.2, "eval/a/pass_at_4": 0.4,
             "eval/a/version": 1.0, "eval/accuracy": 0.2}, {"step": 2, "eval/b/greedy_pass_at_1": 0.1}]
    assert eval_panels(rows) == [(("eval/a/greedy_pass_at_1", "eval/a/pass_at_4", "eval/a/pass_at_10"),
                                  "eval a (x: step measured)"),
                                 (("eval/b/greedy_pass_at_1",), "eval b (x: step measured)")]
