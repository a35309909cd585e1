"""What a rank prints, line by line, to the driver: its fds 1 and 2 captured and forwarded."""

from __future__ import annotations

import codecs
import os
import re
import sys
import threading

from airflow_provider_torchdist.spark.node.channel_client import ChannelClient
from airflow_provider_torchdist.spark.wire.logsafe import escape_controls

_LINE_END = re.compile(r"(\r\n|\r|\n)")


class OutputCapture:
    """Sends every line written to fds 1 and 2 (by Python, C code or children) to the driver.

    Lines of any length pass whole. ``\\r`` ends a line too, so progress-bar redraws become
    readable lines instead of one giant line. If the channel breaks, lines go to the original
    stderr instead, after a notice that says so.
    """

    def __init__(self, client: ChannelClient | None, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._fallback_noted = False

    def start(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, name in ((1, "out"), (2, "err")):
            self._saved[fd] = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(target=self._pump, args=(read_end, name), daemon=True)
            thread.start()
            self._threads.append(thread)
        # Python buffers a pipe in blocks; the log should follow the training as it happens.
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)

    def stop(self, timeout: float = 5.0) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes our pipe's last write end, so the pump sees EOF
        for thread in self._threads:
            thread.join(timeout)
        for saved in self._saved.values():
            os.close(saved)
        self._saved.clear()

    def _emit(self, stream: str, text: str) -> None:
        if self._client is not None and self._client.line(stream, text):
            return
        out = self._saved.get(2)
        if out is None:
            return
        if not self._fallback_noted:
            self._fallback_noted = True
            why = self._client.broken if self._client else "not connected"
            os.write(
                out, f"[torchdist] log channel to the driver is down ({why}); output follows here\n".encode()
            )
        # Escaped here too: this lands in the executor's log (spark-submit's output on the embedded
        # master), which no one else escapes.
        os.write(out, f"{self._prefix} {escape_controls(text)}\n".encode(errors="replace"))

    def _pump(self, read_end: int, stream: str) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        last_redraw = None
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(65536)
                pending += decoder.decode(data or b"", final=not data)
                # Hold a trailing \r back: it may be the first half of \r\n.
                cut = len(pending) - 1 if data and pending.endswith("\r") else len(pending)
                parts = _LINE_END.split(pending[:cut])
                pending = parts.pop() + pending[cut:]
                for text, end in zip(parts[::2], parts[1::2], strict=True):
                    if end == "\r":
                        # A progress-bar redraw: one line per change, not one per refresh.
                        if text and text != last_redraw:
                            self._emit(stream, text)
                        last_redraw = text
                    elif text:
                        self._emit(stream, text)
                if not data:
                    if pending:
                        self._emit(stream, pending)
                    return
