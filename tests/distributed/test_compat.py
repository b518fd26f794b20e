"""CPU compat guard: the megatron paths mrl runs must go through exactly the shims and call sites
listed in ``mrl/megatron/compat.py``. A megatron upgrade that moves, adds or removes a torch.cuda
call site, or makes a shim unnecessary, fails here instead of silently breaking CPU mode."""

import pytest

from tests.conftest import read_json, run_torchrun

# Shims that the probe cannot reach yet, with the reason.
NOT_PROBED = {
    "paged_stash_stub": "applied only when triton is missing (triton ships with torch 2.9.1 here)",
    "distopt_torch_adam": "TODO(checkpoint-resume): hit by DistributedOptimizer checkpoint loads, probed with resume",
}


@pytest.fixture(scope="module")
def probe_hits(ckpt_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compat")
    merged: dict[str, set[str]] = {}
    applied = {}
    # TP2 x EP2 x ETP2 (DP2, SP, alltoall with uneven gathers) and PP2 (p2p, 1F1B), each with
    # DDP + DistributedOptimizer steps through megatron's schedules
    for name, nproc, args in [("tp2ep2etp2", 4, ["--tp", "2", "--ep", "2", "--etp", "2"]), ("pp2", 2, ["--pp", "2"])]:
        f = out / f"{name}.json"
        r = run_torchrun("tests.jobs.compat_probe", ["--hf", ckpt_dir["stress_a"], "--out", str(f), *args], nproc)
        assert r.returncode == 0, r.stderr[-4000:]
        rep = read_json(f)
        applied = rep["applied"]
        for shim, sites in rep["hits"].items():
            merged.setdefault(shim, set()).update(sites)
    return applied, merged


@pytest.mark.dist
def test_no_unlisted_call_site(probe_hits):
    from mrl.megatron import compat

    _, hits = probe_hits
    unknown = {n: sorted(s - set(compat.SHIMS[n].covers)) for n, s in hits.items() if s - set(compat.SHIMS[n].covers)}
    assert not unknown, f"megatron call sites not listed in mrl/megatron/compat.py: {unknown}"


@pytest.mark.dist
def test_every_listed_site_and_shim_is_still_hit(probe_hits):
    from mrl.megatron import compat

    applied, hits = probe_hits
    for name, shim in compat.SHIMS.items():
        if name in NOT_PROBED:
            continue
        assert applied[name], f"shim {name} was not applied on this CPU box"
        stale = sorted(set(shim.covers) - hits.get(name, set()))
        assert not stale, f"shim {name}: listed sites no longer hit (megatron changed?): {stale}"
        assert hits.get(name), f"shim {name} is applied but never hit"
