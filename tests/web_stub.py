"""A loopback server that replays the web search providers' documented answers (tests/fixtures/web/*.json).

It checks the key where each provider expects it (a wrong or missing one gets the provider's refusal), reads the
number of results asked for (the normal answer is clipped to it), and answers by the server's ``mode`` or, for
one query, by a word in it (``nothing-at-all`` → the empty answer, ``few-results`` → two results). ``hits``
counts the requests it received; ``delay`` holds every answer back that many seconds.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

FIXTURES = Path(__file__).parent / "fixtures" / "web"
QUERY_MODES = {"nothing-at-all": "empty", "few-results": "few"}


def fixture_of(provider: str) -> dict:
    name = "serpapi" if provider.startswith("serpapi") else provider
    return json.loads((FIXTURES / f"{name}.json").read_text())


class WebStub:
    def __init__(self, provider: str, key: str, mode: str = "normal"):
        self.provider, self.key, self.mode = provider, key, mode
        self.fixture = fixture_of(provider)
        self.hits = 0
        self.delay = 0.0
        self.seen: list[dict] = []  # what each request asked: query, n, and the raw request
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._answer(None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(length) or b"null"))

            def _answer(self, body):
                stub.hits += 1
                params = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
                query, n, key = stub._read(params, body, self.headers)
                stub.seen.append({"query": query, "n": n, "params": params, "body": body})
                if stub.delay:
                    time.sleep(stub.delay)
                mode = stub.mode
                for word, m in QUERY_MODES.items():
                    if query and word in query and mode == "normal":
                        mode = m
                if key != stub.key:
                    mode = "unauthorized"
                answer = stub.fixture[mode]
                payload = json.loads(json.dumps(answer["body"]).replace("{query}", query or ""))
                if mode == "normal" and n:
                    stub._clip(payload, n)
                data = json.dumps(payload).encode() if mode != "garbage" else b"<html>"
                self.send_response(answer["status"])
                self.send_header("Content-Type", "application/json")
                for name, value in answer.get("headers", {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError):  # the client gave up waiting (the slow tests)
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/search"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _read(self, params: dict, body, headers) -> tuple[str, int, str]:
        p = self.provider
        if p == "serper":
            return body.get("q"), int(body.get("num", 10)), headers.get("X-API-KEY")
        if p.startswith("serpapi"):
            n = params.get("num") or params.get("count") or 10
            return params.get("q"), int(n), params.get("api_key")
        if p == "brave":
            return params.get("q"), int(params.get("count", 20)), headers.get("X-Subscription-Token")
        auth = headers.get("Authorization") or ""
        return body.get("query"), int(body.get("max_results", 5)), auth.removeprefix("Bearer ")

    def _clip(self, payload: dict, n: int) -> None:
        for path in (("organic",), ("organic_results",), ("web", "results"), ("results",)):
            node = payload
            for part in path[:-1]:
                node = node.get(part, {})
            if isinstance(node.get(path[-1]), list):
                node[path[-1]] = node[path[-1]][:n]

    def __enter__(self) -> WebStub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
