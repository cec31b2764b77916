"""Hostile input against the live server: every request below gets a 4xx with an error body of
the route's shape, and a normal request right after it still works."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ANTHROPIC = {"x-api-key": API_KEY}
BIG = 2**64 + 1
INT64_MAX = 2**63 - 1
LONE_SURROGATE = '"hi \\ud800"'  # JSON text: the escape decodes to an unpaired surrogate


def _deep_schema(depth: int) -> str:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


DEEP_SCHEMA = _deep_schema(450)  # JSON text: the body's own depth check cannot see inside it


def raw(text: str) -> bytes:
    return text.encode()


def _chat(content: str) -> str:
    return '{"messages": [{"role": "user", "content": %s}]}' % content


# (path, body: a JSON value or raw bytes, status, the error's param or None)
CORPUS = [
    # 1. seeds beyond int64 (the core seeds sample i with seed + i)
    ("/v1/completions", {"prompt": "hi", "n": 2, "seed": 2**64 - 1, "temperature": 1,
                         "max_tokens": 4}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, 400, "seed"),
    # 2. integers above 2**64 anywhere a number goes
    ("/v1/completions", {"prompt": "hi", "max_tokens": BIG}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": BIG}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "priority": BIG}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [BIG]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [BIG]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", json.loads(_chat('"hi"')) | {"n": BIG}, 400, "n"),
    ("/detokenize", {"tokens": [BIG]}, 400, "tokens"),
    # 3. lone surrogates, on every route that takes text
    ("/v1/completions", raw('{"prompt": %s}' % LONE_SURROGATE), 400, "prompt"),
    ("/v1/chat/completions", raw(_chat(LONE_SURROGATE)), 400, "messages"),
    ("/v1/messages", raw('{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", '
                         '"content": %s}]}' % LONE_SURROGATE), 400, None),
    ("/tokenize", raw('{"prompt": %s}' % LONE_SURROGATE), 400, "prompt"),
    ("/v1/completions", raw('{"prompt": "hi", "stop": [%s]}' % LONE_SURROGATE), 400, "stop"),
    # 5. requests that can never fit: 400, not 503 (a client would retry forever)
    ("/v1/completions", {"prompt": "hi", "n": 10000, "max_tokens": 1}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "best_of": 10000, "max_tokens": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": ["hi"] * 2000, "max_tokens": 1}, 400, "prompt"),
    # 6. budgets: zero, beyond the context, infinite temperature
    ("/v1/chat/completions", json.loads(_chat('"hi"')) | {"max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", json.loads(_chat('"hi"')) | {"max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 10**6,
                      "messages": [{"role": "user", "content": "hi"}]}, 400, None),
    ("/v1/completions", raw('{"prompt": "hi", "temperature": 1e999}'), 400, "temperature"),
    ("/v1/completions", raw('{"prompt": "hi", "top_p": NaN}'), 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 1e308}, 400, "presence_penalty"),
    # 9. booleans are not token ids; empty prompts and conversations are refused by the schema
    ("/v1/completions", {"prompt": [[False]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [True, 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": []}, 400, None),
    # 8. bodies that are not JSON, or JSON nested too deep
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", b'{"prompt": ', 400, None),
    ("/v1/completions", raw('{"prompt": "hi", "x": ' + "[" * 100 + "]" * 100 + "}"), 400, "x"),
    ("/v1/completions", raw('{"prompt": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}"), 400,
     None),
    ("/v1/messages", raw('{"metadata": ' + "{\"a\": " * 100 + "1" + "}" * 100 + "}"), 400,
     None),
    # and a few of our own
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", json.loads(_chat('[{"type": "image_url"}]')), 400, "messages"),
    ("/v1/completions", [1, 2, 3], 400, None),
    # 10. issue 36: JSON nested deep inside strings, keys that are not int64 token ids, content
    # of the wrong shape, grammars that allow no output or pass the server's limits
    ("/v1/completions", {"prompt": "hi", "guided_json": DEEP_SCHEMA}, 400, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": DEEP_SCHEMA}}, 400,
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": '{"a": ' + "[" * 500 + "]" * 500 + "}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"function": "f"}]}]}, 400,
     "messages"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
    *[("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": content}]}]}, 400, None)
      for content in (5, ["a", "b"], {"text": "a"})],
    ("/v1/completions", {"prompt": "hi", "guided_grammar": "root ::= root"}, 400,
     "guided_grammar"),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": "root ::= []"}, 400,
     "guided_grammar"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": [f"{i:07d}" for i in range(200_000)]},
     400, "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["w"] * 2000}, 400, "bad_words"),
    # fields that would be silently ignored: refused
    ("/v1/completions", {"prompt": "hi", "priority": 5}, 400, "priority"),  # fcfs server
    ("/v1/completions", {"prompt": "hi", "length_penalty": 2.0}, 400, "length_penalty"),
    ("/v1/completions", {"prompt": "hi", "spaces_between_special_tokens": False}, 400,
     "spaces_between_special_tokens"),
    ("/v1/chat/completions", json.loads(_chat('"hi"')) | {"parallel_tool_calls": 0}, 400,
     "parallel_tool_calls"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "no_such_field": 1,
                      "messages": [{"role": "user", "content": "hi"}]}, 400, None),
]


def _ids(case) -> str:
    path, body, _, param = case
    return f"{path}:{param}:{len(json.dumps(body) if not isinstance(body, bytes) else body)}"


def _send(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    headers = {**(ANTHROPIC if path.startswith("/v1/messages") else AUTH), **(headers or {})}
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, timeout=60,
                          headers={**headers, "Content-Type": "application/json"})
    return httpx.post(server.url + path, json=body, timeout=60, headers=headers)


def assert_error_shape(reply: httpx.Response, path: str) -> dict:
    assert reply.headers["content-type"] == "application/json", reply.text
    body = reply.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"], body
    return body["error"]


def assert_still_serving(server) -> None:
    ok = _send(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"], ok.text
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("path, body, status, param", CORPUS, ids=[_ids(c) for c in CORPUS])
def test_hostile_request_is_refused(tiny_server, path, body, status, param):
    reply = _send(tiny_server, path, body)
    assert reply.status_code == status, reply.text
    error = assert_error_shape(reply, path)
    if param is not None:
        assert error["param"] == param, error
    assert_still_serving(tiny_server)


def test_largest_seed_and_n_do_not_overflow(tiny_server):
    """The core seeds sample i with seed + i: int64's largest seed with n > 1 still works."""
    body = {"prompt": "hi", "n": 3, "seed": INT64_MAX, "temperature": 1, "max_tokens": 4}
    first, again = (_send(tiny_server, "/v1/completions", body) for _ in range(2))
    assert first.status_code == 200, first.text
    assert [c["text"] for c in first.json()["choices"]] == \
        [c["text"] for c in again.json()["choices"]]  # seeded: the same samples twice
    assert_still_serving(tiny_server)


@pytest.mark.parametrize("method, path, status, anthropic", [
    ("GET", "/no/such/route", 404, False),
    ("GET", "/v1/completions", 405, False),
    ("DELETE", "/v1/messages", 405, True),
    ("GET", "/v1/models/no-such-model", 404, False),
])
def test_routing_errors_have_the_error_shape(tiny_server, method, path, status, anthropic):
    reply = httpx.request(method, tiny_server.url + path, headers={**AUTH, **ANTHROPIC})
    assert reply.status_code == status
    assert_error_shape(reply, "/v1/messages" if anthropic else path)
    if status == 405:
        assert "POST" in reply.headers["allow"]


def test_body_size_limit_is_413(tiny_server):
    body = b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}'  # above the 32 MiB default
    reply = _send(tiny_server, "/v1/completions", body)
    assert reply.status_code == 413
    assert "--max-request-body-bytes" in assert_error_shape(reply, "/v1/completions")["message"]
    assert_still_serving(tiny_server)


def test_client_request_ids_are_labels_not_engine_ids(tiny_server):
    """Two clients sending the same X-Request-Id at once are both served."""
    body = {"prompt": "same id", "max_tokens": 8, "ignore_eos": True}
    replies: list[httpx.Response] = []

    def send() -> None:
        replies.append(_send(tiny_server, "/v1/completions", body, {"X-Request-Id": "dup"}))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert {r.headers["x-request-id"] for r in replies} == {"dup"}
    assert len({r.json()["id"] for r in replies}) == 2


def test_cors_preflight_is_answered_without_the_key(tiny_server):
    reply = httpx.options(tiny_server.url + "/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_openapi_describes_what_the_server_sends(tiny_server):
    schema = httpx.get(tiny_server.url + "/openapi.json").json()
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions
    assert {"400", "401", "408", "413", "500", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    assert "content" not in schema["paths"]["/health"]["get"]["responses"]["200"]
    seed = schema["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]
    assert seed["anyOf"][0]["maximum"] == INT64_MAX


def test_large_tokenize_does_not_stall_streams(tiny_server):
    """A 10 MiB /tokenize while 8 streams run: no stream waits more than 1 s for a token."""
    text = ("the quick brown fox jumps over the lazy dog. " * 250_000)[:10 * 2**20]
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    gaps: list[float] = []
    started = threading.Barrier(9)

    def stream() -> None:
        with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as reply:
            last = None
            for line in reply.iter_lines():
                now = time.monotonic()
                if not line.startswith("data:"):
                    continue
                if last is None:
                    started.wait()
                else:
                    gaps.append(now - last)
                last = now

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait()
    reply = httpx.post(tiny_server.url + "/tokenize", json={"prompt": text}, timeout=300)
    for t in threads:
        t.join()
    assert reply.status_code == 200 and reply.json()["count"] > 10**6
    assert len(gaps) > 8 * 300 and max(gaps) < 1.0, max(gaps)


def _raw_exchange(server, data: bytes, trickle: bytes = b"", timeout: float = 60) -> bytes:
    """Send `data` on a fresh connection, then `trickle` one byte a second (a slowloris
    client) until an answer comes; everything the server sent until it closed the
    connection."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        sock.settimeout(1.0)
        received, deadline, sent = b"", time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                chunk = None
            except ConnectionResetError:  # closed while bytes were on their way
                return received
            if chunk == b"":
                return received  # the server closed the connection
            received += chunk or b""
            if sent < len(trickle) and not received:
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
    raise AssertionError(f"the connection stayed open past {timeout} s: {received[:200]!r}")


def _json_reply(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), head
    return status, json.loads(body)


def test_a_body_shorter_than_its_content_length_times_out_with_408(tiny_server):
    body = b'{"prompt": "hi"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) + 100}\r\n\r\n")
    status, error = _json_reply(_raw_exchange(tiny_server, head.encode() + body))
    assert status == 408 and "--body-timeout" in error["error"]["message"], error
    assert_still_serving(tiny_server)


def test_a_slowloris_head_is_cut_off_with_408(tiny_server):
    trickle = b"X-Slow: " + b"a" * 200  # one byte a second, far past --header-timeout
    status, error = _json_reply(_raw_exchange(
        tiny_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", trickle))
    assert status == 408 and "--header-timeout" in error["error"]["message"], error
    assert_still_serving(tiny_server)


def test_protocol_errors_have_a_json_body(tiny_server):
    status, error = _json_reply(_raw_exchange(tiny_server, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and error["error"]["type"] == "invalid_request_error", error


def test_a_client_leaving_a_non_streamed_request_aborts_it_cleanly(tiny_server):
    body = {"prompt": "Leave early", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    assert wait_for(lambda: "the client disconnected; aborted" in tiny_server.log(), 30)
    assert "InvalidStateError" not in tiny_server.log()
    assert_still_serving(tiny_server)
