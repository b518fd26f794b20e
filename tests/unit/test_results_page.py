"""docs/results.md is generated from the reports (scripts/results_page.py): regenerated here, it must equal the
committed page, so a report added, moved or changed without regenerating the page fails."""

import importlib.util
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _script():
    spec = importlib.util.spec_from_file_location("results_page", os.path.join(ROOT, "scripts", "results_page.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_page_is_what_the_reports_give(tmp_path):
    page = tmp_path / "results.md"
    page.write_text(_script().render())
    committed = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert page.read_text() == committed, "docs/results.md is stale: run python scripts/results_page.py"


def test_every_report_is_on_the_page_and_every_goal_reads_its_report():
    mod = _script()
    page = mod.render()
    reports = os.path.join(ROOT, "bench", "reports")
    for topic in os.listdir(reports):
        for f in os.listdir(os.path.join(reports, topic)):
            assert f"../bench/reports/{topic}/{f}" in page, f
    assert page.count("| met |") + page.count("| **not met** |") == len(mod.GOALS)


def test_meta_reads_the_recorded_date_hardware_and_commit():
    mod = _script()
    d = {"environment": {"date": "2026-11-28 08:06 UTC", "device": "1x NVIDIA H200", "mrl_commit": "3678484"}}
    assert mod.meta(d, "2026-11-27_x.json") == ("2026-11-28", "1x NVIDIA H200", "3678484")
    d = {"environment": {"date": "2026-11-28 09:03 UTC", "device": "CPU (gloo)", "cpu_cores": 2}}
    assert mod.meta(d, "2026-11-28_x.json") == ("2026-11-28", "CPU, 2 cores", "not recorded")
    d = {"hardware": "2x NVIDIA H200 (143771 MiB), 32 CPU cores", "note": "ran it at commit 4d19158."}
    assert mod.meta(d, "2026-11-26_y_2xH200.json") == ("2026-11-26", "2x NVIDIA H200", "4d19158")
    assert mod.meta({}, "2026-11-26_gpu_parity_2xH200.json") == ("2026-11-26", "2x H200", "not recorded")


def test_a_report_of_an_unknown_kind_is_listed_without_figures():
    mod = _script()
    assert mod.kind({"bench": "something new"}, "f.json") not in mod.EXTRACTORS
