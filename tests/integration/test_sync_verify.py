"""``weight_sync.verify`` against a real SGLang CPU engine: a trainer holding the engine's weights passes the
probe (fp32: differences ~1e-6), an engine that is not on the trainer's weights stops the run naming it, and
an engine that cannot be asked is reported, not fatal (the next sync drops a dead one)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.reliability


def test_verify_passes_equal_weights_and_stops_on_an_engine_with_other_weights(engines, ckpt_dir, tmp_path,
                                                                              reliability):
    """On the session's TP1 engine, which holds the tiny checkpoint (tests that change it put it back)."""
    engine = engines["tp1"]
    out = tmp_path / "res.json"
    r = run_torchrun("tests.integration.test_sync_verify", [ckpt_dir["tiny"], engine.url, str(out)], 1, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["same"][engine.url] <= 1e-3, res
    assert list(res["unreachable"]) == ["http://127.0.0.1:9"], res
    msg = res["other"]
    assert msg.startswith(f"SyncMismatch: weight sync v2: engines ['{engine.url}'] disagree with the trainer on a "
                          "fixed probe: max |logprob difference| "), msg
    assert "> weight_sync.verify_tol=0.001" in msg and "their weights are not the trainer's" in msg
    reliability.record(category="fault", name="engine not on the trainer's weights after a sync", survived=True,
                       injected="trainer weights changed (final norm x1.5) without a sync, then weight_sync.verify",
                       expected="SyncMismatch on every rank naming the engine and the difference",
                       message=msg.replace(engine.url, "<engine>"))


def _worker(hf: str, url: str, out: str) -> None:
    import argparse

    import torch

    from mrl.jobs.common import add_layout_args, load_model
    from mrl.megatron.parallel import destroy
    from mrl.weight_sync.checks import SyncMismatch, verify_engines
    from mrl.sglang.endpoint import EngineEndpoint

    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    m = load_model(ap.parse_args(["--hf", hf]))
    engines = [EngineEndpoint(url, 1), EngineEndpoint("http://127.0.0.1:9", 1)]  # nothing listens on port 9
    same, unreachable = verify_engines(m.model, m.layout, engines, vocab_size=m.bridge.vocab_size, tol=1e-3,
                                       version="1")
    with torch.no_grad():
        dict(m.model.named_parameters())["decoder.final_layernorm.weight"].mul_(1.5)
    try:
        verify_engines(m.model, m.layout, engines[:1], vocab_size=m.bridge.vocab_size, tol=1e-3, version="2")
        other = "not refused"
    except SyncMismatch as e:
        other = f"SyncMismatch: {e}"
    with open(out, "w") as f:
        json.dump({"same": same, "unreachable": unreachable, "other": other}, f)
    destroy()


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
