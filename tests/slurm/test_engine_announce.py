"""`mrl engine` with engine.url_dir: every engine announced as <dir>/<host>-engine<i>.url once healthy
(URL naming this host, server on all interfaces), withdrawn on stop. SGLang replaced by a fake Engine."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

from mrl import cli
from mrl.cluster.engines import read_urls
from mrl.config.load import compose

STARTED: list["FakeEngine"] = []


class FakeEngine:
    def __init__(self, *, name: str, host: str, log_dir: str, **_):
        self.name, self.host, self.port, self.log_path = name, host, 31000 + len(STARTED), f"{log_dir}/{name}.log"
        self.stopped = False
        STARTED.append(self)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self):
        return self

    def wait_healthy(self):
        return self

    def stop(self):
        self.stopped = True


def serve_until_urls(monkeypatch, tmp_path, overrides: list[str], want: int) -> dict[str, str]:
    """Run cli.engine in this (main) thread; a helper thread waits for ``want`` announcements, reads them
    and sends SIGTERM."""
    monkeypatch.setattr("mrl.engine.launcher.Engine", FakeEngine)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"]}')
    cfg = compose([f"model.hf_path={tmp_path}/model", f"run_dir={tmp_path}", *overrides])
    seen: dict[str, str] = {}
    serving = threading.Event()  # cleared once cli.engine returns: a late SIGTERM would kill pytest itself

    def watch():
        deadline = time.monotonic() + 10
        while len(read_urls(str(tmp_path / "engines"))) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # no further announcement comes
        seen.update(read_urls(str(tmp_path / "engines")))
        if serving.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    old = signal.getsignal(signal.SIGTERM)
    STARTED.clear()
    serving.set()
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        assert cli.engine(cfg) == 0
    finally:
        serving.clear()
        watcher.join()
        signal.signal(signal.SIGTERM, old)
    assert all(e.stopped for e in STARTED)
    return seen


def test_engines_announce_and_withdraw(monkeypatch, tmp_path):
    monkeypatch.setenv("MRL_ENGINE_HOST", "node7")
    seen = serve_until_urls(monkeypatch, tmp_path, [f"engine.url_dir={tmp_path}/engines",
                                                    "engine.count=2"], want=2)
    host = socket.gethostname()
    assert seen == {f"{host}-engine0": "http://node7:31000", f"{host}-engine1": "http://node7:31001"}
    # bound to this node's own interface (MRL_ENGINE_HOST here), never 0.0.0.0: reachable from the job only
    assert [e.host for e in STARTED] == ["node7", "node7"]
    assert read_urls(str(tmp_path / "engines")) == {}  # withdrawn on stop


def test_local_engines_stay_on_loopback_and_announce_nothing(monkeypatch, tmp_path):
    seen = serve_until_urls(monkeypatch, tmp_path, [], want=0)
    assert seen == {} and [(e.name, e.host) for e in STARTED] == [("engine0", "127.0.0.1")]
