"""The public Python API is the `pagedserve` package; `services` keeps the old names as aliases."""
from __future__ import annotations

import subprocess
import sys

import pagedserve


def test_the_public_names_import_from_pagedserve():
    from pagedserve import LLM, AsyncClient, Client, SamplingParams  # noqa: F401
    from pagedserve.client import Client as client_module_client
    from pagedserve.llm import LLM as llm_module_llm

    assert Client is client_module_client and LLM is llm_module_llm
    assert SamplingParams(max_tokens=3, temperature=0).max_tokens == 3
    assert set(pagedserve.__all__) >= {"LLM", "SamplingParams", "Client", "AsyncClient", "GenerationError"}


def test_services_keeps_the_old_names_as_aliases():
    from services import LLM, SamplingParams

    assert LLM is pagedserve.LLM and SamplingParams is pagedserve.SamplingParams


def test_the_generated_code_imports_without_the_engine_or_grpc():
    """`pagedserve.v1` is what clients in Python import for the proto alone: the package's
    own names must not drag torch (or grpc) in with it."""
    code = ("import sys; import pagedserve.v1.generate_pb2, pagedserve.internal.v1.worker_pb2; "
            "print(sorted(m for m in ('torch', 'grpc', 'services.worker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
