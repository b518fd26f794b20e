"""Engine keys: the 0600 keys file, its discovery by child processes, redaction, the launcher's command line,
and a client that authenticates with the right key per endpoint (fake server applying SGLang's auth rules)."""

import asyncio
import os
import stat
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from mrl.sglang import keys as sec
from mrl.sglang.client import EngineClient
from mrl.engine.launcher import Engine, pump_log
from mrl.sglang.protocol import EngineHTTPError
from mrl.sglang.keys import ENV_VAR, EngineSecrets, ensure_run_secrets
from tests.fakes.fake_sglang import FakeSGLang


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def no_run_keys(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_keys_file_is_private_and_never_printed(tmp_path):
    s = EngineSecrets.generate().write(str(tmp_path / "secrets" / sec.FILENAME))
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "secrets").st_mode) == 0o700
    assert os.listdir(tmp_path / "secrets") == [sec.FILENAME]  # no temp file left behind
    assert EngineSecrets.load(s.path) == s and s.api_key != s.admin_api_key
    assert s.api_key.startswith("mrl_") and len(s.api_key) > 40  # never '-...': argparse would take it for a flag
    for text in (repr(s), str(s), f"{s}", repr([s])):
        assert s.api_key not in text and s.admin_api_key not in text and sec.REDACTED in text
    assert s.redact(f"api_key='{s.api_key}', admin_api_key='{s.admin_api_key}'") == \
        f"api_key='{sec.REDACTED}', admin_api_key='{sec.REDACTED}'"
    with pytest.raises(FileExistsError):
        EngineSecrets.generate().write(s.path)


def test_load_refuses_a_readable_or_malformed_file(tmp_path):
    s = EngineSecrets.generate().write(str(tmp_path / sec.FILENAME))
    os.chmod(s.path, 0o644)
    with pytest.raises(PermissionError, match="0600"):
        EngineSecrets.load(s.path)
    bad = tmp_path / "bad.yaml"
    for body in ("api-key: x\n", 'api-key: "-x"\nadmin-api-key: "y"\n', "api-key: 123\nadmin-api-key: 123\n"):
        bad.write_text(body)
        os.chmod(bad, 0o600)
        with pytest.raises(ValueError, match="engine keys file"):
            EngineSecrets.load(str(bad))


def test_run_secrets_are_shared_through_the_run_dir_and_the_env(tmp_path, no_run_keys):
    s = ensure_run_secrets(str(tmp_path))
    assert s.path == str(tmp_path / "secrets" / sec.FILENAME) and os.environ[ENV_VAR] == s.path
    assert ensure_run_secrets() == s  # later calls (and children, through the env) get the same keys
    code = "from mrl.sglang.keys import EngineSecrets as S; s = S.from_env(); print(s.path, s == S.load(s.path))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [s.path, "True"] and s.api_key not in out
    os.environ.pop(ENV_VAR)
    assert ensure_run_secrets(str(tmp_path)) == s  # another node or a restart of the run: the same file


def test_without_a_run_dir_the_keys_live_in_a_private_temp_dir(no_run_keys):
    s = ensure_run_secrets()
    assert os.environ[ENV_VAR] == s.path and stat.S_IMODE(os.stat(os.path.dirname(s.path)).st_mode) == 0o700


def test_engine_command_names_the_file_never_the_keys(tmp_path):
    s = EngineSecrets.generate().write(str(tmp_path / sec.FILENAME))
    e = Engine(model_path="/m", port=31000, secrets=s)
    cmd = " ".join(e.command())
    assert f"--config {s.path}" in cmd and s.api_key not in cmd and s.admin_api_key not in cmd
    assert s.api_key not in repr(e) and e.host == "127.0.0.1"  # loopback unless told otherwise
    for k in ("api_key", "admin_api_key", "config"):
        with pytest.raises(ValueError, match="engine.server_args"):
            Engine(model_path="/m", port=1, server_args={k: "x"})


def test_config_dump_holds_no_keys(tmp_path, no_run_keys):
    from mrl.config.load import compose

    s = ensure_run_secrets(str(tmp_path))
    dump = OmegaConf.to_yaml(OmegaConf.structured(compose()))
    assert s.api_key not in dump and s.admin_api_key not in dump and "api_key" not in dump


def test_log_pump_redacts_the_keys(tmp_path):
    s = EngineSecrets.generate()
    r, w = os.pipe()
    with os.fdopen(w, "wb") as f:
        f.write(f"server_args=ServerArgs(api_key='{s.api_key}', admin_api_key='{s.admin_api_key}')\nok\n".encode())
    pump_log(os.fdopen(r, "rb"), open(tmp_path / "log", "wb"), s)
    log = (tmp_path / "log").read_text()
    assert log == f"server_args=ServerArgs(api_key='{sec.REDACTED}', admin_api_key='{sec.REDACTED}')\nok\n"


def test_client_sends_the_right_key_per_endpoint(monkeypatch):
    s = EngineSecrets.generate()
    monkeypatch.setenv(ENV_VAR, "")  # no run keys: only the explicit ones below

    async def go(url, srv):
        c = EngineClient(url, api_key=s.api_key, admin_key=s.admin_api_key)
        await c.generate([1, 2, 3], {"max_new_tokens": 2}, rid="a")
        await c.model_info()
        await c.init_weights_update_group(master_address="127.0.0.1", master_port=1, rank_offset=1,
                                          world_size=2, group_name="g", backend="gloo")
        await c.update_weights_from_distributed(names=["w"], dtypes=["float32"], shapes=[[1]], group_name="g",
                                                weight_version="1")
        await c.pause("abort")
        await c.flush_cache()
        await c.resume()
        await c.update_weight_version("2")
        await c.abort(abort_all=True)
        await c.destroy_weights_update_group("g")
        assert srv.refused == []
        for kw, ep in ((dict(), "/generate"), (dict(api_key="mrl_wrong"), "/generate"),
                       (dict(api_key=s.admin_api_key), "/generate"), (dict(api_key=s.api_key), "/pause_generation")):
            bad = EngineClient(url, **kw)  # api key alone: also sent to the admin endpoints, which refuse it
            with pytest.raises(EngineHTTPError, match="refused this client's") as e:
                await (bad.generate([1], {}, rid="x") if ep == "/generate" else bad.pause("abort"))
            assert e.value.status == 401 and srv.refused[-1] == ep and s.api_key not in str(e.value)
            await bad.close()
        await c.close()

    with FakeSGLang(api_key=s.api_key, admin_api_key=s.admin_api_key) as srv:
        run(go(srv.url, srv))
        assert srv.st.paused is None and srv.st.weight_version == "2"


def test_client_takes_the_run_keys_from_the_env(tmp_path, monkeypatch):
    s = EngineSecrets.generate().write(str(tmp_path / sec.FILENAME))
    monkeypatch.setenv(ENV_VAR, s.path)

    async def go(url):
        c = EngineClient(url)
        await c.generate([1, 2, 3], {"max_new_tokens": 1}, rid="a")
        await c.pause("abort")
        await c.resume()
        await c.close()

    with FakeSGLang(api_key=s.api_key, admin_api_key=s.admin_api_key) as srv:
        run(go(srv.url))
        assert srv.refused == []


def test_cluster_engines_bind_to_the_job_interface(monkeypatch):
    from mrl.sglang.endpoint import interface_address

    monkeypatch.delenv("MRL_ENGINE_HOST", raising=False)
    assert interface_address("127.0.0.1") == "127.0.0.1"  # the interface that routes to the peer
    monkeypatch.setenv("MRL_ENGINE_HOST", "10.1.2.3")
    assert interface_address("127.0.0.1") == "10.1.2.3"
