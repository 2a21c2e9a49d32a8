"""A client that leaves while its request is still queued aborts it at once, streamed or not: the
only running slot (max_num_seqs 1) is held by a long request, so the others wait. A real scheduler,
worker and frontend (tiny random model), HTTP over real sockets, /metrics as a user reads it."""
from __future__ import annotations

import json
import socket
import time

import pytest

from test_http_api import metric, raw
from test_http_cluster import HttpCluster, serve

MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def served(model_dir):
    yield from serve(model_dir("llama", "tiny", max_position_embeddings=MAX_MODEL_LEN), max_num_seqs=1)


def send(port: int, path: str, body: dict) -> socket.socket:
    """A request on its own connection, left open (the caller reads or closes it)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))
    return sock


def queue_counts(served: HttpCluster) -> tuple[float, float]:
    text = raw(served.url + "/metrics")[1].decode()
    return metric(text, "pagedserve:num_requests_waiting"), metric(text, "pagedserve:num_requests_running")


def wait_counts(served: HttpCluster, want: tuple[float, float], timeout: float) -> float:
    """Seconds until /metrics shows (waiting, running) == want."""
    start = time.monotonic()
    while (got := queue_counts(served)) != want:
        assert time.monotonic() - start < timeout, f"(waiting, running) is still {got}, not {want}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_http_clients_that_leave_while_queued_abort_their_requests_at_once(served):
    """Before: they stayed waiting until the slot was free, then ran to the end, logged as 200 (the
    Responses and Messages APIs until they took chat's route skeleton, issue 46)."""
    port = served.frontend.http.port
    occupant = send(port, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 8,
                                              "temperature": 0, "ignore_eos": True, "stream": True})
    received = b""
    while b"data: " not in received:  # it runs
        received += occupant.recv(65536)
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16, "temperature": 0}
    leaving = [send(port, "/v1/chat/completions", {**chat, "stream": stream}) for stream in (False, True)]
    # the Responses and Messages APIs share the route skeleton (respond.py): they leave the queue as well
    leaving += [send(port, "/v1/responses", {"input": "Hello there", "max_output_tokens": 16, "temperature": 0}),
                send(port, "/v1/messages", {**chat, "model": served.frontend.core.model_id, "stream": True})]
    wait_counts(served, (4, 1), timeout=30)
    for sock in leaving:
        sock.close()
    assert wait_counts(served, (0, 1), timeout=10) < 3  # aborted, not run after the occupant
    occupant.setblocking(False)
    try:
        while chunk := occupant.recv(1 << 20):  # what has arrived so far
            received = received[-16:] + chunk
            assert b"[DONE]" not in received, "the occupant finished first: the test proves nothing"
    except BlockingIOError:
        pass
    occupant.close()
    served.run(served.cluster.wait_idle(timeout=60), timeout=90)
