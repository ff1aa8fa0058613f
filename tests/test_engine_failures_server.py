"""A request whose step fails gets a 500 carrying the reason from the server, and the server goes on:
/health stays ok, the next request is answered (in process: Starlette's TestClient, the real EngineLoop)."""

from __future__ import annotations

import time

import pytest

import mtlqwen.runtime.sampling as sampling_mod
from frontend_fixtures import write_tiny_chat_checkpoint


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("chat"))


def test_a_failing_request_is_a_500_and_the_server_serves_on(chat_ckpt, monkeypatch):
    from starlette.testclient import TestClient  # noqa: PLC0415

    import mtlqwen  # noqa: PLC0415
    from mtlqwen.frontends.engine_loop import EngineLoop  # noqa: PLC0415
    from mtlqwen.frontends.metrics import Metrics  # noqa: PLC0415
    from mtlqwen.frontends.server_app import ServerConfig, build_app  # noqa: PLC0415
    from mtlqwen.runtime import Engine  # noqa: PLC0415

    real = sampling_mod.sample

    def faulty(logits, params, seeds, indices):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("std::bad_cast")
        return real(logits, params, seeds, indices)

    monkeypatch.setattr(sampling_mod, "sample", faulty)
    tok = mtlqwen.load_tokenizer(chat_ckpt)
    build = lambda: (Engine(chat_ckpt, tokenizer=tok, slots=2, step_tokens=64, block_tokens=16, num_blocks=40), tok)  # noqa: E731
    loop = EngineLoop(build, Metrics("tiny"))
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "temperature": 0}
    with TestClient(build_app(loop, ServerConfig(served_names=("tiny",), slots=2))) as client:
        for _ in range(600):  # the engine thread loads the model
            if loop.state != "loading":
                break
            time.sleep(0.1)
        assert loop.state == "ok", loop.error
        ok = client.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        bad = client.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 666})
        assert bad.status_code == 500
        assert "std::bad_cast" in bad.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
