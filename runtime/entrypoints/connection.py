"""The HTTP/1.1 connection: uvicorn's h11 protocol with a deadline for each request's head (a
slowloris client sending a header byte now and then is cut off; uvicorn's keep-alive timer
restarts on every byte), and JSON error bodies for the protocol errors it answers itself."""
from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.entrypoints.errors import APIError

HEADER_TIMEOUT_S = 30.0  # --header-timeout


class GuardedH11Protocol(H11Protocol):
    """A connection must send a whole request head within `header_timeout_s` of opening, or of
    its previous response; else it gets a 408 and is closed."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_deadline is not None and not self._waiting_for_head():
            self._head_deadline.cancel()
            self._head_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._waiting_for_head():
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or not self._waiting_for_head():
            return
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # an idle keep-alive connection: nothing was asked
            return
        self.logger.warning("a request's head took longer than %g s (--header-timeout): "
                            "connection closed", self.header_timeout_s)
        self._send_error(APIError(408, f"the request's headers did not arrive within "
                                  f"{self.header_timeout_s:g} s (--header-timeout)"))

    def send_400_response(self, msg: str) -> None:
        self._send_error(APIError(400, f"invalid HTTP request: {msg}"))

    def _send_error(self, error: APIError) -> None:
        """`error` as a JSON body (OpenAI's shape: the path may not be known yet), then close.
        Written as raw bytes: the h11 state machine may already be in its error state."""
        body = json.dumps(error.body()).encode()
        head = (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n")
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()
