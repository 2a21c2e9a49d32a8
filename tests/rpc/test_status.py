"""Both directions of the core error <-> gRPC status mapping (services/rpc/status.py): what a
servicer sends is what the frontend and the public client read back."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pagedserve.client import GenerationError
from services.core.errors import InvalidArgument, ResourceExhausted, Unavailable, UnknownSequence
from services.rpc.status import (TRANSPORT_ERRORS, StatusError, code_of, core_error, scheduler_lost, status_of,
                                 worker_forgot)


@pytest.mark.parametrize("error", [
    InvalidArgument("top_p", "must be in (0, 1], got 2: too large"),
    ResourceExhausted("64 requests pending, the limit is 64"),
    Unavailable("no worker registered"),
])
def test_a_core_error_comes_back_as_itself(error):
    code, details = status_of(error)
    back = core_error(code_of(code.value[0]), details, "scheduler")
    assert type(back) is type(error)
    if isinstance(error, InvalidArgument):  # the field, and a message that holds ": " itself
        assert (back.field, back.message) == (error.field, error.message)
        assert GenerationError(code, details).field == "top_p"
    else:
        assert str(back) == f"scheduler: {error}"


def test_a_status_no_core_error_maps_to_stays_a_status():
    code, details = status_of(RuntimeError("the scheduler failed a step"))
    back = core_error(code, details, "scheduler")
    assert isinstance(back, StatusError) and back.code == grpc.StatusCode.INTERNAL
    assert isinstance(core_error(grpc.StatusCode.DEADLINE_EXCEEDED, "", "scheduler"), Unavailable)
    assert code_of(999) == grpc.StatusCode.UNKNOWN
    assert GenerationError(grpc.StatusCode.INTERNAL, "x: y").field is None


@pytest.mark.parametrize("code, details, lost", [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
    (grpc.StatusCode.UNAVAILABLE, None, True),
    (grpc.StatusCode.INTERNAL, "Internal error from Core", True),   # a scheduler killed mid-step, in gRPC's words
    (grpc.StatusCode.UNKNOWN, "Stream removed", True),
    (grpc.StatusCode.INTERNAL, "RuntimeError: the scheduler failed a step", False),  # the scheduler's own failure
    (grpc.StatusCode.INTERNAL, None, False),  # a code the scheduler reported itself carries no transport phrase
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "64 requests pending, the limit is 64", False),
])
def test_a_scheduler_that_went_away_is_told_from_one_that_refused(code, details, lost):
    assert scheduler_lost(code, details) is lost


def test_a_worker_that_forgot_a_sequence_is_told_from_one_that_failed():
    code, _ = status_of(UnknownSequence("seq-1"))
    assert worker_forgot(code)
    assert not any(worker_forgot(c) for c in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                              grpc.StatusCode.DEADLINE_EXCEEDED))


def test_the_public_client_imports_no_server_module():
    """pagedserve/client.py reads statuses with pagedserve/status.py: a client needs none of services/."""
    script = "import sys, pagedserve.client; print(sorted(m for m in sys.modules if m.split('.')[0] == 'services'))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_statuses_are_classified_only_in_the_status_module():
    """The codes and gRPC's own phrases that decide lost/forgot are read in services/rpc/status.py alone."""
    root = Path(__file__).resolve().parents[2]
    words = ("StatusCode.FAILED_PRECONDITION", *TRANSPORT_ERRORS)
    leaks = [(str(path.relative_to(root)), word) for folder in ("services", "pagedserve")
             for path in (root / folder).rglob("*.py") if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
             and path != root / "services" / "rpc" / "status.py"
             for word in words if word in path.read_text()]
    assert leaks == []
