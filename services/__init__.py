"""pagedserve: a paged-attention LLM server as three gRPC services, deterministic by default."""
from services.core.outputs import CompletionOutput, RequestOutput
from services.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name):  # import the engine (torch) only when asked
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    raise AttributeError(name)
