"""`runtime chat`: talk to a model in this process, or to a running server (`--url`).

Replies stream as they are generated. On a terminal, prompt_toolkit gives line editing and a
history (--history-file, default ~/.cache/runtime/chat_history); otherwise lines are read from
stdin. `/clear` forgets the conversation, `/exit` (or Ctrl-D) leaves, and Ctrl-C stops the
reply being written while keeping the conversation.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, Iterator

from runtime.cli.engine_args import (add_engine_args, add_sampling_args, engine_kwargs,
                                     sampling_kwargs)
from runtime.plugins.paths import cache_dir

Messages = list[dict[str, str]]
HISTORY_FILE = str(cache_dir("chat_history"))
HELP = "/clear forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops a reply."


def add_chat_parser(subparsers: Any) -> None:
    c = subparsers.add_parser("chat", help="an interactive chat with a model or a server",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--url", default=None,
                   help="chat with a running OpenAI-compatible server, e.g. "
                        "http://127.0.0.1:8000/v1 (default: load the model here)")
    c.add_argument("--api-key", default=None,
                   help="the server's key (default: OPENAI_API_KEY, else RUNTIME_API_KEY)")
    c.add_argument("--model-name", default=None,
                   help="with --url: the served model to ask (default: the server's first)")
    c.add_argument("--system", default=None, help="a system prompt")
    c.add_argument("--history-file", default=HISTORY_FILE,
                   help="where a terminal session keeps its input history (default: %(default)s)")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=chat_command)


class LocalChat:
    """Replies from an `LLM` in this process, streamed step by step."""

    def __init__(self, args: argparse.Namespace) -> None:
        from runtime import LLM, SamplingParams
        self.llm = LLM(**engine_kwargs(args))
        defaults = self.llm.engine.processor.sampling_defaults
        self.params = SamplingParams(**sampling_kwargs(args, defaults))

    def stream(self, messages: Messages) -> Iterator[str]:
        engine = self.llm.engine
        ids = self.llm.apply_chat_template(messages)
        request_id = engine.add_request({"prompt_token_ids": ids}, self.params)
        sent = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id == request_id:
                        text = output.outputs[0].text
                        yield text[sent:]
                        sent = len(text)
        finally:
            if engine.has_unfinished_requests():
                engine.abort_request(request_id)
                while engine.has_unfinished_requests():
                    engine.step()


class RemoteChat:
    """Replies from an OpenAI-compatible server's /chat/completions, as server-sent events."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url = args.url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get(
            "RUNTIME_API_KEY")
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.model = args.model_name or self._first_model()
        self.body = sampling_kwargs(args, {})  # the server fills in its own defaults

    def _open(self, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass  # not an OpenAI-style error body: show it as it came
            raise ValueError(f"{self.url}{path}: HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise ValueError(f"cannot reach {self.url}: {e.reason}") from None

    def _first_model(self) -> str:
        with self._open("/models") as reply:
            return json.load(reply)["data"][0]["id"]

    def stream(self, messages: Messages) -> Iterator[str]:
        body = {**self.body, "model": self.model, "messages": messages, "stream": True}
        with self._open("/chat/completions", body) as reply:
            for line in reply:
                line = line.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ValueError(event["error"].get("message", str(event["error"])))
                for choice in event.get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""


def _line_reader(history_file: str) -> Callable[[], str]:
    """prompt_toolkit with editing and history on a terminal; plain stdin lines otherwise."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        os.makedirs(os.path.dirname(os.path.abspath(history_file)), exist_ok=True)
        session = PromptSession(history=FileHistory(history_file))
        return lambda: session.prompt("> ")

    def read() -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")
    return read


def run_chat(chat: LocalChat | RemoteChat, system: str | None,
             read: Callable[[], str]) -> int:
    """The conversation loop; returns the exit code."""
    first: Messages = [{"role": "system", "content": system}] if system else []
    messages = list(first)
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = read().strip()
        except EOFError:
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as a shell does
            continue
        if line == "/exit":
            return 0
        if line == "/clear":
            messages = list(first)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        reply: list[str] = []
        pieces = chat.stream(messages)
        try:
            with _ctrl_c_stops() as stopped:
                for piece in pieces:
                    reply.append(piece)
                    print(piece, end="", flush=True)
                    if stopped.is_set():
                        print(" [stopped]", end="", flush=True)
                        break
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        finally:
            pieces.close()  # a stopped reply's request is aborted
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply).strip()})


@contextlib.contextmanager
def _ctrl_c_stops() -> Iterator[threading.Event]:
    """While a reply streams, Ctrl-C (SIGINT) only sets the returned event: the reply stops
    between two tokens, with the engine in a clean state, and the conversation goes on."""
    stopped = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stopped.set())
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)


def chat_command(args: argparse.Namespace) -> int:
    chat = RemoteChat(args) if args.url else LocalChat(args)
    return run_chat(chat, args.system, _line_reader(args.history_file))
