"""The implementation of pagedserve: core (plain Python), the frontend, scheduler and worker
services, the wire plumbing (rpc), process management (launch) and tools.

The public API is the `pagedserve` package (`from pagedserve import LLM, SamplingParams`);
`from services import LLM` still works as an alias of it for older code.
"""


def __getattr__(name):  # the old public names, resolved by pagedserve (lazily: torch only when asked)
    import pagedserve

    if name in pagedserve.__all__:
        return getattr(pagedserve, name)
    raise AttributeError(f"module 'services' has no attribute {name!r}")
