"""The engine's own process (posttrain.serve.core) as the HTTP front end sees it: killed under a running server, and
failing to load. Servers run through `background_server` (the evaluator's way) on loopback ports."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from posttrain.config_schema import ServeCfg
from posttrain.serve.server import background_server
from tests.scripted_model import SCRIPT, build_scripted_model

openai = pytest.importorskip("openai")
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # the first three replies (content, reasoning, a tool call): this file needs no calculator round trips
    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "model", script=SCRIPT[:3])


def health(base_url: str) -> int:
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def test_once_the_engine_process_dies_health_and_requests_say_so(model_dir):
    """SIGKILL the engine process (an out-of-memory kill looks the same): /health turns 503 and a request gets a
    503 error object naming the engine process, rather than hanging; the front end keeps answering."""
    opts = ServeCfg(model=str(model_dir), port=0, api_key="k", max_batch=4, max_len=256)
    with background_server(opts) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0, timeout=30)
        reply = client.chat.completions.create(model=server.name, messages=HELLO, max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1 and health(server.base_url) == 200
        engines = [p for p in multiprocessing.active_children() if p.name == "posttrain-engine"]
        assert len(engines) == 1, engines
        os.kill(engines[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while health(server.base_url) != 503:
            assert time.monotonic() < deadline, "health still 200 after the engine process died"
            time.sleep(0.1)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=server.name, messages=HELLO, max_tokens=4, temperature=0)
        assert caught.value.status_code == 503
        assert "engine process" in caught.value.body["message"]
    assert not [p for p in multiprocessing.active_children() if p.name == "posttrain-engine"]


def test_an_engine_that_cannot_load_fails_the_start_naming_the_model(model_dir, tmp_path):
    """Weights the engine cannot read: starting the server raises at once with the model's path and the loader's
    error, and leaves no engine process behind."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    assert json.loads((broken / "config.json").read_text())["model_type"]
    with pytest.raises(RuntimeError, match=f"{broken}: the engine could not load"):
        with background_server(ServeCfg(model=str(broken), port=0, max_batch=2, max_len=64)):
            pass
    assert not [p for p in multiprocessing.active_children() if p.name == "posttrain-engine"]
