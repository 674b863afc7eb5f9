"""A TCP port of srun's that its step's tasks connect to, each connection served by a thread.

srun listens for its tasks twice: their output streams and exit records (command.StepIO) and,
under `--mpi=pmi2`, their PMI start-up (pmi.PmiServer). Both take every address of the host
(tasks on other nodes connect), any number of connections at once, and must stop listening
for good when the step ends: srun's resident helper (srun/helper.py) runs step after step in
one process and would otherwise keep a thread and a port per step.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class Listener:
    """Listens on a free port of every address; `serve(conn)` runs in a thread per connection."""

    def __init__(self, serve: Callable[[socket.socket], None], *, name: str) -> None:
        self.serve = serve
        self.server = socket.create_server(("", 0), backlog=1024)
        self.port = int(self.server.getsockname()[1])
        self._closing = False
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening and end the accept thread.  Closing the socket alone does not wake
        a thread blocked in accept() on Linux; shutdown() does."""
        self._closing = True
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.server.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()
