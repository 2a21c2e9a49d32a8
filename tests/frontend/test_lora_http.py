"""LoRA adapters over the services (scheduler, worker, HTTP frontend, in process): a request names its
adapter as its model, with the official openai client; /v1/models lists the adapters under their base."""
from __future__ import annotations

import openai
import pytest

from services.core.lora import LoRARequest
from services.tools.make_lora import make_lora
from test_http_api import metric, raw
from test_http_cluster import serve
from tests.conftest import greedy, make_llm
from tests.waits import poll

PROMPT = [5, 17, 99, 230, 41, 8, 300, 12, 77]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("loras")
    return {"sql": str(make_lora(out / "sql", tiny_llama, rank=8, seed=1)),
            "chat": str(make_lora(out / "chat", tiny_llama, rank=4, seed=2, targets=("q_proj", "v_proj")))}


@pytest.fixture(scope="module")
def served(tiny_llama, adapters):
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    yield from serve(tiny_llama, {"lora_modules": modules}, {"enable_lora": True, "lora_modules": modules})


def test_openai_client_names_the_adapter_as_its_model(served, tiny_llama, adapters):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    llm = make_llm(tiny_llama, dtype="float32", enable_lora=True, num_gpu_blocks=64)
    for model in (str(tiny_llama), "sql", "chat"):
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
        lora = LoRARequest(model, 1, adapters[model]) if model in adapters else None
        want = llm.generate([PROMPT], greedy(8, logprobs=1), use_tqdm=False, lora_request=lora)[0].outputs[0]
        assert got.choices[0].logprobs.token_logprobs == [lp.logprob for lp in want.logprobs], model
        assert got.choices[0].text == want.text, model


def test_models_lists_the_adapters_under_their_base(served, tiny_llama, adapters):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {str(tiny_llama), "sql", "chat"}
    assert models["sql"].parent == str(tiny_llama) and models["sql"].root == adapters["sql"]
    assert client.models.retrieve("chat").parent == str(tiny_llama)
    status, body = raw(served.url + "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and b"nope" in body


def test_metrics_name_the_adapters_running(served):
    """While a streamed request runs under "sql": vllm:lora_requests_info lists it as running, and its
    per-adapter gauge counts it; after it ends, nothing runs under an adapter."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    status, body = raw(served.url + "/metrics")
    stream.close()
    text = body.decode()
    assert status == 200
    assert metric(text, "vllm:lora_requests_info", running_lora_adapters="sql", waiting_lora_adapters="") > 0
    assert metric(text, "pagedserve:lora_num_requests_running", lora_name="sql") == 1
    poll(lambda: 'running_lora_adapters=""' in raw(served.url + "/metrics")[1].decode(), 10, "the adapter idle")
