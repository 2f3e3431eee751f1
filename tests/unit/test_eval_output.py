"""What the eval prints: one progress bar (on a terminal) and one summary line per checkpoint, no line per request.

The requests go through the real stack (the `openai` client, its HTTP library, uvicorn in `background_server`)
to a stub OpenAI-compatible app standing in for the engine, so the test needs no model and runs in seconds.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from fastapi import FastAPI, Request  # module level: FastAPI resolves the route's annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from posttrain.evaluation.client import CheckpointProgress
from posttrain.serve.server import HTTP_LOGGERS


def stub_app(received: list[str]):
    """Chat completions as a server answers them: `n` choices, or an SSE stream ending with a usage chunk. The
    engine process's close() is recorded in `received` as "release"."""
    app = FastAPI()
    app.state.served = SimpleNamespace(core=SimpleNamespace(close=lambda: received.append("release")))
    head = {"id": "c", "created": 0, "model": "stub"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        received.append("stream" if body.get("stream") else f"chat n={body.get('n') or 1} max={body['max_tokens']}")
        if not body.get("stream"):
            choices = [{"index": i, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                       for i in range(body.get("n") or 1)]
            return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "o"}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}]
        lines = [f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', **c})}\n\n" for c in chunks]
        return StreamingResponse(iter(lines + ["data: [DONE]\n\n"]), media_type="text/event-stream")

    return app


@pytest.fixture
def fresh_loggers():
    """The HTTP loggers as a new process has them (NOTSET), restored afterwards."""
    from posttrain.cli import QUIET_LOGGERS

    names = HTTP_LOGGERS + ("matplotlib",) + tuple(QUIET_LOGGERS)
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.NOTSET)
    yield
    for n, level in saved.items():
        logging.getLogger(n).setLevel(level)


@pytest.fixture
def stub_server(monkeypatch):
    """`background_server` serving the stub app instead of an engine; returns the requests it received and the
    models it resolved."""
    from posttrain.serve import server

    received: list[str] = []
    api = types.ModuleType("posttrain.serve.api")
    api.create_app = lambda core, tokenizer, name, root, api_key: stub_app(received)
    monkeypatch.setitem(sys.modules, "posttrain.serve.api", api)
    resolved = []  # the server resolves each model once
    monkeypatch.setattr(server, "resolve_model", lambda location: (resolved.append(location), (location, "stub"))[1])

    monkeypatch.setattr(server, "start_engine", lambda opts, weights: (None, None))
    return received, resolved


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stub_suites():
    from posttrain.evaluation.suites import Suite

    def exact(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    rows = [{"messages": [{"role": "user", "content": f"say ok {i}"}], "answer": "ok"} for i in range(5)]
    return [Suite("echo", rows, exact, ("answer",)), Suite("arith", rows[:4], exact, ("answer",), samples=3)]


def test_eval_logs_one_summary_per_checkpoint_and_no_request_lines(fresh_loggers, stub_server, monkeypatch, caplog,
                                                                   capsys, tmp_path):
    from posttrain.evaluation import scorecard

    received, resolved = stub_server
    monkeypatch.setattr(scorecard, "verify_artifact", lambda d: {"stage": d.name})
    monkeypatch.setattr(scorecard, "weight_files", lambda d: [])
    suites = stub_suites()
    eval_cfg = SimpleNamespace(latency=SimpleNamespace(requests=2, max_tokens=2), concurrency=4, max_new_tokens=None)
    serve_cfg = OmegaConf.create({"api_key": None, "dtype": "float32", "max_batch": 4, "max_len": 64,
                                  "backend": "posttrain"})
    total = scorecard.requests_of(suites, eval_cfg)
    assert total == 5 + 2 * 4 + 2
    caplog.set_level(logging.DEBUG - 5)  # every record any logger lets through, down to uvicorn's TRACE
    for stage in ("pretrain", "dpo"):
        row = scorecard.score_checkpoint(tmp_path / stage, suites, eval_cfg, serve_cfg)
        assert (row["echo"], row["arith"], row["arith_pass@1"], row["latency"]["requests"]) == (1.0, 1.0, 1.0, 2)
    # every request of both checkpoints went through the HTTP stack, and each server released its engine on exit
    assert received.count("release") == 2 and len(received) == 2 * total + 2
    assert sum(r.startswith("chat") for r in received) == 2 * (5 + 4 + 4)
    # the eval verified each checkpoint's weights itself and served its model/ directory: no second hash
    assert resolved == [str(tmp_path / "pretrain" / "model"), str(tmp_path / "dpo" / "model")]
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: no bar, no line per request
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert [m.split(":")[0] for m in messages] == ["base", "eval base", "dpo", "eval dpo"], messages[:6]
    assert messages[1].startswith(f"eval base: {total}/{total} requests in ")
    assert messages[1].endswith("s; echo 1.000, arith 1.000 (pass@1 1.000)")
    for name in HTTP_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() >= logging.WARNING, name


def test_every_suites_greedy_requests_go_out_together_each_with_its_own_reply_budget(stub_server, monkeypatch,
                                                                                      tmp_path):
    """The server batches whatever requests are waiting, so a checkpoint's greedy requests go out at once, suite by
    suite only in order: suites sent one after another would decode as many batches, each as long as its longest
    reply. Each request still carries its own suite's max_new_tokens, and each suite scores its own replies."""
    from posttrain.evaluation import scorecard

    received, _ = stub_server
    monkeypatch.setattr(scorecard, "verify_artifact", lambda d: {"stage": d.name})
    monkeypatch.setattr(scorecard, "weight_files", lambda d: [])
    echo, arith = stub_suites()
    echo.max_new_tokens, arith.max_new_tokens = 5, 7
    eval_cfg = SimpleNamespace(latency=SimpleNamespace(requests=0, max_tokens=2), concurrency=16, max_new_tokens=None)
    serve_cfg = OmegaConf.create({"api_key": None, "dtype": "float32", "max_batch": 16, "max_len": 64,
                                  "backend": "posttrain"})
    row = scorecard.score_checkpoint(tmp_path / "sft", [arith, echo], eval_cfg, serve_cfg)
    assert (row["arith_n"], row["echo_n"], row["arith_pass@1"]) == (4, 5, 1.0)
    chats = [r for r in received if r.startswith("chat")]
    greedy, sampled = chats[:9], chats[9:]  # the sampled suite (arith) comes first, its samples after every greedy
    assert sorted(greedy) == sorted(["chat n=1 max=7"] * 4 + ["chat n=1 max=5"] * 5), chats
    assert sampled == ["chat n=3 max=7"] * 4, chats


def test_progress_on_a_terminal_is_one_bar_redrawn_in_place(caplog):
    caplog.set_level(logging.INFO, logger="posttrain")
    terminal = Terminal()
    progress = CheckpointProgress("sft", 40, stream=terminal)
    for stage, requests in (("echo", 10), ("arith", 20), ("latency", 10)):
        progress.stage(stage)
        for _ in range(requests):
            progress.update(1)
    line = progress.close()
    assert "eval sft" in terminal.getvalue() and "\n" not in terminal.getvalue()  # one line, cleared at the end
    assert line.startswith("eval sft: 40/40 requests in ")
    assert [r.getMessage() for r in caplog.records if r.name == "posttrain"] == [line]


def test_eval_logging_setup_holds_back_http_and_library_notes(fresh_loggers, monkeypatch):
    from posttrain.cli import QUIET_LOGGERS, setup_logging
    from posttrain.evaluation.run import quiet_eval_output

    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)  # leave the test session's root handlers be
    setup_logging()
    for name in HTTP_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, name
    for name, level in QUIET_LOGGERS.items():
        assert logging.getLogger(name).getEffectiveLevel() == level, name
    for name in HTTP_LOGGERS + ("matplotlib",):
        logging.getLogger(name).setLevel(logging.NOTSET)
    quiet_eval_output()  # what `evaluate` runs first, for callers other than the command line
    for name in HTTP_LOGGERS + ("matplotlib",):
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, name


def test_eval_base_scores_the_chains_base_model_as_the_first_stages_parent(monkeypatch, tmp_path):
    """eval.base: the directory the first stage loaded its model from is served as the row "base", and the first
    stage's changes are paired against it; a chain whose first stage built its model has no base to add."""
    from posttrain.evaluation import scorecard

    served = []

    def fake_score_model(row, model_dir, suites, eval_cfg, serve_cfg, seed):
        served.append((row["checkpoint"], str(model_dir)))
        return dict(row, size_mb=1.0, echo=0.5 if row["checkpoint"] == "base" else 1.0, echo_n=2,
                    echo_ci=(0.0, 1.0), echo_scores=[0.0, 1.0]
                    if row["checkpoint"] == "base" else [1.0, 1.0])

    base = tmp_path / "smollm2"
    base.mkdir()
    run = tmp_path / "run"
    sft = run / "00-sft"
    monkeypatch.setattr(scorecard, "score_model", fake_score_model)
    monkeypatch.setattr(scorecard, "verify_artifact", lambda d: {"stage": "sft"})
    monkeypatch.setattr(scorecard, "build_suites", lambda cfg, seed: [])
    monkeypatch.setattr(scorecard, "read_manifest", lambda d: {"stage": "sft", "parent": None})
    monkeypatch.setattr(scorecard, "manifest_sha256", lambda d: "sha")
    monkeypatch.setattr(scorecard, "base_model", lambda dirs: {"source": "gguf", "location": str(base)})
    monkeypatch.setattr(scorecard, "render_base_model", lambda info: [])
    run.mkdir()
    eval_cfg = OmegaConf.create({"suites": ["echo"], "base": True, "latency": {"requests": 0}})
    serve_cfg = OmegaConf.create({"backend": "vllm"})  # no context check on a stub model
    card = scorecard.write_scorecard(run, [sft], eval_cfg, serve_cfg, 0)
    assert served == [("base", str(base)), ("sft", str(sft / "model"))]
    assert [r["checkpoint"] for r in card["rows"]] == ["base", "sft"] and card["rows"][1]["parent"] == "base"
    assert card["changes"][0]["parent"] == "base" and card["changes"][0]["diff"] == pytest.approx(0.5)
    monkeypatch.setattr(scorecard, "base_model", lambda dirs: {"source": "tiny", "location": None})
    with pytest.raises(ValueError, match="eval.base: this chain's base model was built by its first stage"):
        scorecard.write_scorecard(run, [sft], eval_cfg, serve_cfg, 0)
