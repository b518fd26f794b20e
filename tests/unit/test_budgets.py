"""Per-row and per-sample response budgets of JSONL datasets (``max_new_tokens``), against the fake server."""

import asyncio

import pytest

from mrl.data.prompt import Prompt
from mrl.sglang.client import EngineClient
from mrl.rollout.manager import RolloutManager
from mrl.rollout.producer import row_budget
from mrl.rollout.sample import SamplingSpec
from tests.fakes.fake_sglang import FakeSGLang
from tests.unit.test_rollout_fake import PROMPT


def _p(budget) -> Prompt:
    return Prompt(id="p7", text="x", answer="y", meta={} if budget is None else {"max_new_tokens": budget})


def test_row_budget_forms():
    assert row_budget(_p(None), 4) is None
    assert row_budget(_p(12), 4) == 12
    assert row_budget(_p([3, 40]), 4) == [3, 40, 3, 40]  # repeated over the group
    assert row_budget(_p([5, 6, 7, 8, 9]), 2) == [5, 6]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True, [], [4, 0], [4, "5"]])
def test_row_budget_rejects_bad_values_naming_the_prompt(bad):
    with pytest.raises(ValueError, match=r"prompt p7: max_new_tokens must be a positive integer"):
        row_budget(_p(bad), 4)


def test_per_sample_budgets_set_each_sample_length():
    async def go(srv):
        mgr = RolloutManager([EngineClient(srv.url)], sampling=SamplingSpec(max_new_tokens=64, ignore_eos=True))
        return await mgr.generate_group(PROMPT, n=3, group_id=0, max_new_tokens=[2, 9, 5])

    with FakeSGLang() as srv:
        samples = asyncio.run(go(srv))
    assert [len(s.response_ids) for s in samples] == [2, 9, 5]
    assert all(s.finish_reason == "length" and s.error is None for s in samples)
    with pytest.raises(ValueError, match="2 per-sample max_new_tokens for 3 samples"):
        asyncio.run(RolloutManager([EngineClient("http://127.0.0.1:1")], sampling=SamplingSpec()).generate_group(
            PROMPT, n=3, group_id=1, max_new_tokens=[1, 2]))


def test_jsonl_rows_with_a_bad_budget_are_skipped_and_counted(tmp_path):
    from mrl.data import JsonlDataset

    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a", "answer": "x", "max_new_tokens": 8},
            {"prompt": "b", "answer": "x", "max_new_tokens": [8, 256, 8, 8]},
            {"prompt": "c", "answer": "x", "max_new_tokens": 0},
            {"prompt": "d", "answer": "x", "max_new_tokens": [4, "5"]},
            {"prompt": "e", "answer": "x"}]
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    ds = JsonlDataset(str(path), shuffle=False)
    assert [p.text for p in (ds[i] for i in range(len(ds)))] == ["a", "b", "e"]
    assert ds.stats.skipped == {"wrong_type": 2} and ds.stats.first_lines["wrong_type"] == [3, 4]
    assert [row_budget(ds[i], 4) for i in range(3)] == [8, [8, 256, 8, 8], None]
