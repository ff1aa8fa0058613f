"""`mtlqwen run-batch`: an OpenAI Batch API input file run offline through the server's own routes (vLLM's
`run-batch`), one output line per input line, in input order.

Results are written in input order as soon as every earlier line has its own, so a batch stopped midway keeps what
was written. Input: JSON lines `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}` (also
/v1/completions, /v1/messages, /v1/responses). Output, OpenAI's batch output format: `{"id": "batch_req_...",
"custom_id": ..., "response": {"status_code": ..., "request_id": ..., "body": {...}}, "error": null}`, a request
the server refused carrying its error body and status like any answer; a line that is not such a request has
`response` null and `error` {"code", "message"}.

The app (server_app.py) runs in this process under its lifespan, and the requests reach it through httpx's ASGI
transport, at most the server's capacity in flight (slots + queue), so every request is batched by the one engine
exactly as served; a 429 from a request of several choices is retried once others finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import uuid

from .args import add_quiet_arg
from .server import add_app_args, app_config, build_served_app
from .terminal import Bar, progress_enabled

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
RETRY_S = 0.05  # between tries of a request refused for capacity


def register(subparsers) -> None:
    r = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch file (JSON lines of requests) offline through the server's routes",
        description="Run an OpenAI Batch API input file (JSON lines with custom_id, method, url, body) through the "
                    "server's routes in this process, every request batched by one engine, and write OpenAI's batch "
                    "output lines in input order. Takes serve's flags (model, engine, template, sampling defaults).")
    r.add_argument("--input-file", "-i", required=True, metavar="FILE",
                   help="the requests, one JSON object a line; - reads standard input")
    r.add_argument("--output-file", "-o", required=True, metavar="FILE",
                   help="where the results go, a line each; - writes standard output")
    add_app_args(r)
    add_quiet_arg(r)
    r.set_defaults(func=cmd_run_batch)


def read_lines(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()  # noqa: SIM115
    return [line for line in text.splitlines() if line.strip()]


def check_line(line: str) -> tuple[str | None, dict | None, str | None]:
    """(custom_id, the request {url, body}, None), or (custom_id if readable, None, why the line is no request)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, None, f"the line is not JSON: {e}"
    if not isinstance(obj, dict):
        return None, None, "the line is not a JSON object"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, None, "'custom_id' must be a non-empty string"
    if obj.get("method", "POST") != "POST":
        return cid, None, f"'method' must be POST, got {obj.get('method')!r}"
    if obj.get("url") not in URLS:
        return cid, None, f"'url' must be one of {', '.join(URLS)}, got {obj.get('url')!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return cid, None, "'body' must be a JSON object"
    if body.get("stream"):
        return cid, None, "a batch request cannot stream"
    return cid, {"url": obj["url"], "body": body}, None


def result_line(cid, status: int | None = None, body=None, error: str | None = None) -> str:
    out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": cid,
           "response": None if status is None else {"status_code": status, "request_id": uuid.uuid4().hex, "body": body},
           "error": None if error is None else {"code": "invalid_request", "message": error}}
    return json.dumps(out, ensure_ascii=False)


class InOrder:
    """Results written as soon as every line before them has its own (a batch stopped midway keeps what it wrote);
    the output opened at the first write (an engine that does not start leaves no file)."""

    def __init__(self, path: str, n: int):
        self.path, self.results, self.next, self.out = path, [None] * n, 0, None
        self.answered = 0

    def put(self, i: int, line: str, answered: bool) -> None:
        self.results[i] = line
        self.answered += answered
        if self.out is None:
            self.out = sys.stdout if self.path == "-" else open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        while self.next < len(self.results) and self.results[self.next] is not None:
            self.out.write(self.results[self.next] + "\n")
            self.results[self.next] = ""  # written: not held any longer
            self.next += 1
        self.out.flush()

    def close(self, ran: bool) -> None:
        """ran: the batch ran to its end (an empty one then still writes its empty output)."""
        if self.out is None and ran and self.path != "-":
            self.out = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        if self.out is not None and self.out is not sys.stdout:
            self.out.close()


async def run(app, loop, lines: list[str], capacity: int, sink: InOrder, bar=None) -> None:
    """Each line's result into sink: the app started under its lifespan, the engine loaded, then at most
    `capacity` requests in flight."""
    import httpx  # noqa: PLC0415

    done = [0]
    async with app.router.lifespan_context(app):
        while loop.state == "loading":
            await asyncio.sleep(0.02)
        if loop.state != "ok":  # a checkpoint that does not load: one line, as for the other commands
            raise ValueError(f"the engine did not start: {loop.error}")
        gate = asyncio.Semaphore(capacity)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://run-batch",
                                     timeout=None) as client:
            async def one(i: int, line: str) -> None:
                cid, req, why = check_line(line)
                if req is None:
                    sink.put(i, result_line(cid, error=why), False)
                else:
                    async with gate:
                        while True:
                            r = await client.post(req["url"], json=req["body"])
                            if r.status_code != 429 or r.json().get("error", {}).get("code") != "queue_full":
                                break
                            await asyncio.sleep(RETRY_S)
                    sink.put(i, result_line(cid, r.status_code, r.json()), r.status_code == 200)
                done[0] += 1
                if bar is not None:
                    bar.update(done[0], len(lines))

            await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))


def cmd_run_batch(args) -> int:
    if getattr(args, "tensor_parallel", False):
        raise ValueError("run-batch does not run under --tensor-parallel")
    lines = read_lines(args.input_file)  # a missing file fails here, before the model loads
    where = os.path.dirname(os.path.abspath(args.output_file))
    if args.output_file != "-" and not (os.path.isdir(where) and os.access(where, os.W_OK)):
        raise ValueError(f"cannot write {args.output_file}: {where} is not a writable directory")
    cfg, engine_kw = app_config(args, api_key=None)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app, loop = build_served_app(args, cfg, engine_kw, logging.getLogger("mtlqwen.serve"))
    bar = Bar("requests", unit="req", enabled=progress_enabled(args.quiet) and bool(lines))
    sink = InOrder(args.output_file, len(lines))
    t0, ran = time.perf_counter(), False
    try:
        asyncio.run(run(app, loop, lines, cfg.slots + cfg.max_queue, sink, bar))
        ran = True
    finally:
        bar.close()
        sink.close(ran)
    print(f"run-batch: {len(lines)} requests, {sink.answered} answered, {len(lines) - sink.answered} failed, in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
