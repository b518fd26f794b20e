"""Access control of real SGLang engines started by mrl (the session's engines run with keys).

- /generate and every weight-update and flow-control endpoint refuse a request without a key, with a
  wrong key, and with the other key (401); the right key gets through (to a validation error here: every
  probe is malformed, so nothing would change even if the auth were missing);
- the engine is unchanged afterwards, and the client with the run's keys generates;
- the keys are in no engine log, no command line, no client log output, and not in what
  ``EngineClient.server_info`` returns (SGLang's own /server_info does return them).
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
import sglang

from mrl.sglang.client import EngineClient
from mrl.sglang.keys import REDACTED, EngineSecrets

# (endpoint, query): each takes a JSON body; the probes send it malformed, so an authorized probe gets 400/422.
ADMIN = [("/init_weights_update_group", None), ("/update_weights_from_distributed", None),
         ("/update_weights_from_disk", None), ("/update_weights_from_tensor", None),
         ("/destroy_weights_update_group", None), ("/pause_generation", None), ("/continue_generation", None),
         ("/flush_cache", {"timeout": -1}), ("/update_weight_version", None), ("/abort_request", None),
         ("/release_memory_occupation", None), ("/resume_memory_occupation", None)]
NORMAL = [("/generate", None)]


def _post(url: str, endpoint: str, query, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(url + endpoint, params=query, content=b'{"malformed": ', headers=headers, timeout=30).status_code


@pytest.fixture(scope="module")
def keys(engines) -> EngineSecrets:
    s = EngineSecrets.from_env()
    assert s is not None and all(e.secrets == s for e in engines.values())
    return s


@pytest.mark.reliability
@pytest.mark.parametrize("name", ["tp1", "tp2"])
def test_every_endpoint_refuses_a_missing_or_wrong_key(engines, keys, name, reliability):
    url = engines[name].url
    before = httpx.get(url + "/model_info", headers={"Authorization": f"Bearer {keys.api_key}"}, timeout=30).json()
    refused = {"no key": 0, "wrong key": 0, "the other key": 0}
    for (endpoint, query), right, other in [*((ep, keys.admin_api_key, keys.api_key) for ep in ADMIN),
                                           *((ep, keys.api_key, keys.admin_api_key) for ep in NORMAL)]:
        for kind, key in (("no key", None), ("wrong key", "mrl_wrong"), ("wrong key", right + "x"),
                          ("the other key", other)):
            assert _post(url, endpoint, query, key) == 401, f"{endpoint} accepted key {key and key[:6]}"
            refused[kind] += 1
        code = _post(url, endpoint, query, right)  # authorized, then refused as malformed
        assert code in (400, 422), f"{endpoint}: HTTP {code}"
    for get in ("/model_info", "/server_info", "/v1/loads"):
        assert httpx.get(url + get, timeout=30).status_code == 401, get
        refused["no key"] += 1
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # always open (liveness probes)
    after = httpx.get(url + "/model_info", headers={"Authorization": f"Bearer {keys.api_key}"}, timeout=30).json()
    assert after["weight_version"] == before["weight_version"]

    async def go():
        c = EngineClient(url)  # the run's keys, from $MRL_ENGINE_KEYS_FILE
        out = await c.generate([1, 17, 42], {"max_new_tokens": 2, "temperature": 0.0}, rid=f"access-{name}")
        await c.close()
        return out

    assert len(asyncio.run(go()).output_ids) == 2  # not paused, still serving
    reliability.record(
        category="access", name=f"real SGLang engine, {name}", survived=True,
        injected=f"{len(ADMIN)} admin and {len(NORMAL)} generation endpoints x (no key, wrong key, key + 'x', "
                 "the other key), 3 info GETs without a key",
        expected="every request 401, engine unchanged; the right key passes authentication",
        message="HTTP 401 ({'error': 'Unauthorized'})", details={"refused": refused, "accepted_wrongly": 0,
                                                               "requests": sum(refused.values())})


def test_keys_appear_in_no_log_or_command_line(engines, keys, caplog, capfd):
    async def go(url):
        c = EngineClient(url)
        info = await c.server_info()
        await c.generate([1, 2, 3], {"max_new_tokens": 1}, rid="access-log")
        await c.close()
        return info

    url = engines["tp1"].url
    with caplog.at_level(logging.DEBUG):
        info = asyncio.run(go(url))
    raw = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {keys.api_key}"}, timeout=30).json()
    assert raw["admin_api_key"] == keys.admin_api_key  # SGLang hands the admin key to api-key holders...
    assert "api_key" not in info and info["version"] == sglang.__version__  # ...mrl's client drops it
    out = capfd.readouterr()
    texts = {"client log": caplog.text, "stdout": out.out, "stderr": out.err, "server_info": repr(info)}
    for e in engines.values():
        with open(e.log_path) as f:
            texts[e.log_path] = log = f.read()
        assert f"api_key='{REDACTED}'" in log and f"admin_api_key='{REDACTED}'" in log  # SGLang logged them
        for pid in e.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    texts[f"cmdline {pid}"] = f.read().decode(errors="replace")
            except FileNotFoundError:
                continue
    for where, text in texts.items():
        assert keys.api_key not in text and keys.admin_api_key not in text, f"a key leaked into {where}"
