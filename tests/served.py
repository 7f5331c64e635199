"""`qwenchat serve` in-process on a free port, for the tests of the server and its clients."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING

import httpx
import uvicorn

from qwenchat.serve import ServedModel, build_app, listen

if TYPE_CHECKING:
    from openai import OpenAI


class Running:
    """A server on a free port, in a background thread."""

    def __init__(self, model: ServedModel, api_key: str | None = None):
        self.lines: list[str] = []
        self.model = model
        app, self.service = build_app(model, api_key, self.lines.append)
        sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def client(self, key: str = "none") -> OpenAI:
        from openai import OpenAI  # (the tests' client; benchmark aids need only httpx)

        return OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=20)

    def post(self, path: str, body: object, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, timeout=20, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.service.close()
