"""A real uvicorn server in a thread of the test process, for tests that need an API on a
port without Ray (the app gets a fake gateway)."""

from __future__ import annotations

import threading
import time

import uvicorn

from tests.conftest import free_port


class Server:
    """Serves `application` on 127.0.0.1:`port` (a free one by default); stop() and start
    again on the same port."""

    def __init__(self, application, port: int | None = None):
        self.app, self.port = application, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.srv = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.srv.started:
            assert self.thread.is_alive() and time.time() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.srv.should_exit = True
        self.thread.join(10)
