"""Both directions of the core error <-> gRPC status mapping (services/rpc/status.py): what a
servicer sends is what the frontend and the public client read back."""
from __future__ import annotations

import grpc
import pytest

from pagedserve.client import GenerationError
from services.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.rpc.status import StatusError, code_of, core_error, status_of


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
