"""pagedserve: a paged-attention LLM server as three gRPC services, deterministic by default.

The public Python API:

    from pagedserve import LLM, SamplingParams        # the in-process engine (no server)
    from pagedserve import Client, AsyncClient        # the public gRPC API of a running server

Each name is imported when first asked for, so `import pagedserve.v1.generate_pb2` (the
generated code of the public proto, whose package `pagedserve.v1` puts it here) pulls in
neither torch nor grpc.
"""
from __future__ import annotations

import importlib

_HOMES = {
    "LLM": "pagedserve.llm",
    "SamplingParams": "services.core.sampling_params",
    "LoRARequest": "services.core.lora",
    "RequestOutput": "services.core.outputs",
    "CompletionOutput": "services.core.outputs",
    **{name: "pagedserve.client" for name in (
        "Client", "AsyncClient", "GenerationError", "Result", "Sample", "Delta", "Logprob", "ModelInfo",
        "Stream", "AsyncStream", "BatchStream", "AsyncBatchStream", "build_request")},
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
