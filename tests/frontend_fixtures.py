"""A tiny chat checkpoint for the front-end tests: a random Qwen3.5 small enough for fast CPU steps,
whose vocabulary is exactly a small byte-level tokenizer's (256 byte tokens + ChatML/think specials),
with a Qwen3.5-style chat template. Every id the model can emit decodes to text.

Also helpers to run a real `mtlqwen serve` process on loopback and to wait for it, boundedly.
A plain helper module (not a conftest): tests import it explicitly.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIALS += [f"<|reserved_{i}|>" for i in range(272 - 256 - len(SPECIALS))]  # pad the vocabulary to 272
VOCAB = 256 + len(SPECIALS)
ENDOFTEXT, IM_START, IM_END = 256, 257, 258

TINY_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 2048,
    "eos_token_id": ENDOFTEXT, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}


def _byte_tokenizer():
    """Byte-level BPE with no merges: one token per byte (ids 0..255), then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from mtlqwen.tokenizer import _bytes_to_unicode

    alphabet = sorted(_bytes_to_unicode().items(), key=lambda kv: kv[1])  # (char, byte) in byte order
    vocab = {ch: b for ch, b in alphabet}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    assert tok.token_to_id("<|im_end|>") == IM_END
    return tok


def write_tiny_chat_checkpoint(dest: pathlib.Path, seed: int = 0, eos_reachable: bool = True) -> pathlib.Path:
    """config.json + model.safetensors (mlx-lm naming, float32) + tokenizer files + chat template.
    eos_reachable=False zeroes the end-of-text rows of lm_head, so greedy replies never end early
    (their logit is 0 while the best of the other 270 random logits is positive)."""
    import mlx.core as mx

    from mtlqwen.model.builtin import random_weights
    from mtlqwen.model.config import parse_config
    from tokenizer_fixture import QWEN35_CHAT_TEMPLATE

    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    weights = random_weights(parse_config(dict(TINY_CONFIG)), seed=seed, dtype=mx.float32)
    if not eos_reachable:
        for t in (ENDOFTEXT, IM_END):
            weights["lm_head.weight"][t] = 0
    # mlx-lm layout: conv weights [C, K, 1], names under language_model.
    out = {"language_model." + k: (v[:, :, None] if k.endswith("conv1d.weight") else v) for k, v in weights.items()}
    mx.save_safetensors(str(dest / "model.safetensors"), out, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    _byte_tokenizer().save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    (dest / "chat_template.jinja").write_text(QWEN35_CHAT_TEMPLATE, encoding="utf-8")
    return dest


# ---- the server app in process (starlette's TestClient)

def app_for(ckpt: pathlib.Path, api_key: str | None = None, wrap_engine=None, num_blocks: int = 32,
            prefix_interval: int = 512, served_names: tuple[str, ...] = ("tiny",), **cfg):
    """The serve app over a 2-slot engine of `num_blocks` 16-token blocks on `ckpt`; wrap_engine(engine) may
    stand in for the engine."""
    from mtlqwen.frontends.engine_loop import EngineLoop
    from mtlqwen.frontends.metrics import Metrics
    from mtlqwen.frontends.server_app import ServerConfig, build_app
    from mtlqwen.runtime import Engine
    from mtlqwen.tokenizer import load_tokenizer

    def build():
        tok = load_tokenizer(ckpt)
        engine = Engine(str(ckpt), tokenizer=tok, slots=2, num_blocks=num_blocks, block_tokens=16,
                        prefix_interval=prefix_interval)
        return (wrap_engine(engine) if wrap_engine else engine), tok

    loop = EngineLoop(build, Metrics("tiny"))
    return build_app(loop, ServerConfig(served_names=served_names, slots=2, api_key=api_key, **cfg))


class ScriptedEngine:
    """A real engine (slots, blocks, steps) whose reply to a request seeded with a key of `scripts` is that
    script, `piece` characters a step; the request's real sequence is cancelled when the script ends. Each
    request's prompt ids are kept (`prompts`). Other requests run as they are."""

    def __init__(self, engine, scripts: dict[int, str], piece: int = 7):
        self.engine, self.scripts, self.piece = engine, dict(scripts), piece
        self.running, self.prompts = {}, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, ids, params, request_id=None):
        self.prompts[request_id] = list(ids)
        if params.seed in self.scripts:
            self.running[request_id] = (0, self.scripts[params.seed])
        return self.engine.submit(ids, params, request_id=request_id)

    def step(self):
        from mtlqwen.runtime.outputs import Delta, Output

        out = []
        for d in self.engine.step():
            if d.request_id not in self.running:
                out.append(d)
                continue
            pos, reply = self.running[d.request_id]
            if pos >= len(reply):
                continue  # the cancelled sequence's last event
            end = pos + self.piece
            self.running[d.request_id] = (end, reply)
            if end < len(reply):
                out.append(Delta(d.request_id, [0], reply[pos:end]))
                continue
            self.engine.cancel(d.request_id)
            steps = -(-len(reply) // self.piece)
            done = Output(d.request_id, len(self.prompts[d.request_id]), [0] * steps, reply, "stop")
            out.append(Delta(d.request_id, [0], reply[pos:], finished=True, finish_reason="stop", output=done))
        return out


@contextlib.contextmanager
def scripted_app(dest: pathlib.Path, scripts: dict[int, str], piece: int = 7):
    """The serve app in process (a started TestClient) over a ScriptedEngine on a fresh tiny checkpoint in `dest`
    (128 blocks: byte tokens make long prompts): yields (client, engine)."""
    from starlette.testclient import TestClient

    ckpt = write_tiny_chat_checkpoint(dest, eos_reachable=False)
    engines = []

    def wrap(engine):
        engines.append(ScriptedEngine(engine, scripts, piece))
        return engines[0]

    with TestClient(app_for(ckpt, wrap_engine=wrap, num_blocks=128)) as c:
        wait_ok(c)
        yield c, engines[0]


def wait_ok(client, timeout: float = 60.0) -> None:
    """Until the in-process app's /health says ok (its model loads on the engine thread)."""
    deadline = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout}s: {client.get('/health').text}")
        time.sleep(0.05)


# ---- a real server process on loopback

def _ephemeral_ports() -> range:
    """The kernel's range for outgoing connections' local ports (Linux; a common default elsewhere)."""
    try:
        lo, hi = map(int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


def free_port(pair: bool = False) -> int:
    """A free loopback port p (pair: p + 1 free too, e.g. the ring back-end's ports for 2 ranks), chosen below
    the ephemeral range: a port the kernel hands out itself can be taken by any outgoing connection between
    this check and the server's bind."""
    ephemeral = _ephemeral_ports()
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 32000)
        ports = (p, p + 1) if pair else (p,)
        if any(q in ephemeral for q in ports):
            continue
        socks = [socket.socket() for _ in ports]
        try:
            for s, q in zip(socks, ports):
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free loopback port")


def subprocess_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MTLQWEN_API_KEY",)}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class ServerProcess:
    """`python -m mtlqwen serve ...` on 127.0.0.1:<free port>, its log in a file; stop() always kills it."""

    def __init__(self, args: list[str], log_path: pathlib.Path, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "mtlqwen", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=env or subprocess_env())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_listening(self, timeout: float = 60.0) -> None:
        """Until the port accepts connections (the model may still be loading)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"server not listening after {timeout}s:\n{self.log()}")

    def wait_healthy(self, timeout: float = 60.0) -> None:
        import httpx

        self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
