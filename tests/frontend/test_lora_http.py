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


KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loras")


@pytest.fixture(scope="module")
def adapters(tiny_llama, lora_dir):
    return {"sql": str(make_lora(lora_dir / "sql", tiny_llama, rank=8, seed=1)),
            "chat": str(make_lora(lora_dir / "chat", tiny_llama, rank=4, seed=2, targets=("q_proj", "v_proj")))}


@pytest.fixture(scope="module")
def served(tiny_llama, adapters, lora_dir):
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    yield from serve(tiny_llama, {"lora_modules": modules, "lora_dir": str(lora_dir), "api_key": KEY},
                     {"enable_lora": True, "lora_modules": modules, "max_cpu_loras": 1})  # others load on demand


def openai_client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


def test_openai_client_names_the_adapter_as_its_model(served, tiny_llama, adapters):
    client = openai_client(served)
    llm = make_llm(tiny_llama, dtype="float32", enable_lora=True, num_gpu_blocks=64)
    for model in (str(tiny_llama), "sql", "chat"):
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
        lora = LoRARequest(model, 1, adapters[model]) if model in adapters else None
        want = llm.generate([PROMPT], greedy(8, logprobs=1), use_tqdm=False, lora_request=lora)[0].outputs[0]
        assert got.choices[0].logprobs.token_logprobs == [lp.logprob for lp in want.logprobs], model
        assert got.choices[0].text == want.text, model
        assert got.model == model  # the response names the adapter (vLLM's behaviour)


def test_models_lists_the_adapters_under_their_base(served, tiny_llama, adapters):
    client = openai_client(served)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {str(tiny_llama), "sql", "chat"}
    assert models["sql"].parent == str(tiny_llama) and models["sql"].root == adapters["sql"]
    assert client.models.retrieve("chat").parent == str(tiny_llama)
    status, body = raw(served.url + "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}, AUTH)
    assert status == 404 and b"nope" in body


def test_metrics_name_the_adapters_running(served):
    """While a streamed request runs under "sql": vllm:lora_requests_info lists it as running, and its
    per-adapter gauge counts it; after it ends, nothing runs under an adapter."""
    client = openai_client(served)
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    status, body = raw(served.url + "/metrics", headers=AUTH)
    stream.close()
    text = body.decode()
    assert status == 200
    assert metric(text, "vllm:lora_requests_info", running_lora_adapters="sql", waiting_lora_adapters="") > 0
    assert metric(text, "pagedserve:lora_num_requests_running", lora_name="sql") == 1
    poll(lambda: 'running_lora_adapters=""' in raw(served.url + "/metrics", headers=AUTH)[1].decode(), 10, "the adapter idle")


def test_adapters_load_and_unload_at_run_time(served, tiny_llama, adapters, lora_dir, tmp_path):
    """Behind the API key; a path outside --lora-dir and bad adapters are 400s naming the problem; a loaded
    adapter serves with its bits, and so do the --lora-modules ones (the worker holds one: each other one loads
    on demand); unloading it while a request runs under it is refused (that request
    finishes), then it unloads and its name is a 404."""
    load = served.url + "/v1/load_lora_adapter"
    late = make_lora(lora_dir / "late", tiny_llama, rank=8, seed=9)
    assert raw(load, {"lora_name": "late", "lora_path": str(late)})[0] == 401
    outside = make_lora(tmp_path / "outside", tiny_llama, rank=8, seed=9)
    big = make_lora(lora_dir / "big", tiny_llama, rank=64, seed=9)
    head = make_lora(lora_dir / "head", tiny_llama, rank=8, seed=9)
    (head / "adapter_config.json").write_text((head / "adapter_config.json").read_text().replace(
        '"q_proj"', '"lm_head"'))
    for path, named in ((outside, "lora_path"), (big, "r:"), (head, "target_modules"),
                        (lora_dir / "nowhere", "lora_path")):
        status, body = raw(load, {"lora_name": "bad", "lora_path": str(path)}, AUTH)
        assert status == 400 and named in body.decode(), (path, body)
    status, body = raw(load, {"lora_name": "late", "lora_path": "late"}, AUTH)  # relative to --lora-dir
    assert status == 200, body
    client = openai_client(served)
    got = client.completions.create(model="late", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    llm = make_llm(tiny_llama, dtype="float32", enable_lora=True, num_gpu_blocks=64)
    want = llm.generate([PROMPT], greedy(6, logprobs=1), use_tqdm=False,
                        lora_request=LoRARequest("late", 1, str(late)))[0].outputs[0]
    assert got.choices[0].logprobs.token_logprobs == [lp.logprob for lp in want.logprobs]
    assert {m.id for m in client.models.list().data} == {str(tiny_llama), "sql", "chat", "late"}
    paths = {**adapters, "late": str(late)}  # three adapters on a worker that holds one: each loads on demand
    for model in ("sql", "late", "chat", "sql"):
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
        want = llm.generate([PROMPT], greedy(4, logprobs=1), use_tqdm=False,
                            lora_request=LoRARequest(model, 1, paths[model]))[0].outputs[0]
        assert got.choices[0].logprobs.token_logprobs == [lp.logprob for lp in want.logprobs], model
    unload = served.url + "/v1/unload_lora_adapter"
    stream = client.completions.create(model="late", prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    status, body = raw(unload, {"lora_name": "late"}, AUTH)
    assert status == 400 and b"running" in body
    text += "".join(chunk.choices[0].text for chunk in chunks)
    assert text == llm.generate([PROMPT], greedy(60), use_tqdm=False,
                                lora_request=LoRARequest("late", 1, str(late)))[0].outputs[0].text
    status, body = poll(lambda: (r := raw(unload, {"lora_name": "late"}, AUTH))[0] == 200 and r, 10, "unloaded")
    assert raw(served.url + "/v1/completions", {"model": "late", "prompt": "hi", "max_tokens": 2}, AUTH)[0] == 404


def test_a_restarted_worker_serves_the_adapters_loaded_at_run_time(served, tiny_llama, lora_dir):
    """A worker that registers again (restarted under its id, holding only its --lora-modules) still serves an
    adapter loaded at run time before it: the scheduler's step names the adapter's folder, and it loads it."""
    again = make_lora(lora_dir / "again", tiny_llama, rank=8, seed=11)
    assert raw(served.url + "/v1/load_lora_adapter", {"lora_name": "again", "lora_path": "again"}, AUTH)[0] == 200
    cluster = served.cluster
    old = cluster.workers["w0"]

    async def restart():
        old.registration.cancel()
        new = await cluster.add_worker("w0")
        await cluster.wait_for(lambda s: [w.address for w in s.workers] == [f"127.0.0.1:{new.port}"])
        await old.stop(None)
        return new
    new = served.run(restart())
    assert "again" not in new.worker.lora_names()
    got = openai_client(served).completions.create(model="again", prompt=PROMPT, max_tokens=4, temperature=0,
                                                   logprobs=1)
    llm = make_llm(tiny_llama, dtype="float32", enable_lora=True, num_gpu_blocks=64)
    want = llm.generate([PROMPT], greedy(4, logprobs=1), use_tqdm=False,
                        lora_request=LoRARequest("again", 1, str(again)))[0].outputs[0]
    assert got.choices[0].logprobs.token_logprobs == [lp.logprob for lp in want.logprobs]
    assert "again" in new.worker.lora_names()
