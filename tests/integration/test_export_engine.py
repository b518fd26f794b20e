"""A stock SGLang engine (CPU mode, fp32) started on ``mrl export``'s output reproduces the trainer's greedy
continuations: the exported checkpoint is the trained model as an inference server sees it."""

from __future__ import annotations

import asyncio
import json

from mrl.engine.launcher import Engine
from mrl.sglang.client import EngineClient
from mrl.sglang.keys import ensure_run_secrets
from tests.conftest import run_torchrun
from tests.distributed.test_export import mrl_export

NEW = 8


def test_an_engine_on_the_export_gives_the_trainers_greedy_output(ckpt_dir, tmp_path):
    run = tmp_path / "run"
    r = run_torchrun("tests.jobs.export_run", ["--hf", ckpt_dir["tiny"], "--run-dir", str(run), "--greedy", str(NEW)],
                     1, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    r = mrl_export(run, tmp_path / "out")
    assert r.returncode == 0, r.stderr[-4000:]
    want = json.loads((run / "greedy.json").read_text())

    keys = ensure_run_secrets(str(tmp_path / "keys"))
    engine = Engine(model_path=str(tmp_path / "out"), tp=1, log_dir=str(tmp_path / "logs"), name="export",
                    secrets=keys)
    engine.start()
    try:
        engine.wait_healthy(timeout=600)

        async def greedy() -> list[list[int]]:
            client = EngineClient(engine.url, api_key=keys.api_key, admin_key=keys.admin_api_key)
            try:
                spec = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
                return [(await client.generate(p, spec, rid=f"p{i}", return_logprob=False)).output_ids
                        for i, p in enumerate(want["prompts"])]
            finally:
                await client.close()

        got = asyncio.run(greedy())
    finally:
        engine.stop()
    assert got == want["greedy"], (got, want["greedy"])
