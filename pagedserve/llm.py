"""`LLM(model).generate(prompts, params)` and `LLM(model).chat(messages, params)`: offline batch
generation in one process; `LLM(model).embed(texts)` and `LLM(model).score(query, documents)` for
a model served as a pooler (services/core/pooling.py)."""
from __future__ import annotations

import itertools
from typing import Sequence as Seq

from tqdm import tqdm

from services.core.config import EngineArgs
from services.core.errors import InvalidArgument
from services.core.lora import LoRARequest
from services.core.outputs import OutputCollector, PoolingOutput, PoolingRequestOutput, RequestOutput
from services.core.pooling import is_encoder_folder, pooling_spec, score_input, shorten
from services.core.sampling_params import SamplingParams
from services.core.tokenizer import Tokenizer
from services.engine import Engine
from services.frontend import tool_calls as chat_tools

Prompt = str | list[int]


class LLM:
    """Every engine argument by vLLM's name, e.g. LLM(model, speculative_config={"method": "ngram",
    "num_speculative_tokens": 4}) (services/core/config.py EngineArgs)."""

    def __init__(self, model: str | None = None, num_workers: int = 1, **engine_args):
        self.args = EngineArgs.from_kwargs(model or "default", **engine_args)
        self.engine = Engine(self.args, num_workers)
        self.tokenizer = Tokenizer(self.engine.tokenizer_path)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the follower processes of a tensor/pipeline parallel worker group (nothing otherwise)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def scheduler(self):
        return self.engine.scheduler

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Outputs in input order. One SamplingParams for all prompts, or one per prompt; likewise one
        LoRARequest (an adapter, loaded on first use; needs LLM(..., enable_lora=True)) or one per prompt
        (None: the base model)."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidArgument("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise InvalidArgument("priority", f"{len(priority)} given for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidArgument("lora_request", f"{len(loras)} given for {len(prompts)} prompts")
        for lora in dict.fromkeys(lr for lr in loras if lr is not None):  # past max_cpu_loras: loaded on demand
            self.engine.load_lora(lora.lora_name, lora.lora_path, lora.lora_int_id or None)
        grammars = next(iter(self.engine.workers.values())).runner.grammars
        for constraint in {sp.structured_outputs for sp in params} - {None}:
            grammars.cache.matcher(constraint)  # an invalid one is refused here, naming the field
        collectors = [self._submit(p, sp, priority[i] if priority else 0, lr.lora_name if lr else "")
                      for i, (p, sp, lr) in enumerate(zip(prompts, params, loras))]
        by_id = {c.output.request_id: c for c in collectors}
        with tqdm(total=len(collectors), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.scheduler.has_unfinished():
                for update in self.engine.step():
                    collector = by_id[update.request_id]
                    was_done = collector.output.finished
                    if collector.apply(update):
                        self.scheduler.stop_sample(update.request_id, update.sample_index)
                    bar.update(int(collector.output.finished and not was_done))
        return [c.output for c in collectors]

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, tools: list[dict] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of chat messages) or a list of them, rendered with the model's
        chat template (or `chat_template`, with `chat_template_kwargs` such as
        `{"enable_thinking": False}`), as vLLM's LLM.chat does; outputs in input order. `tools` are OpenAI function
        definitions, shown to the model as the HTTP API shows them (its chat template's `tools`, or
        the Hermes format); assistant messages may carry OpenAI `tool_calls`, tool messages a
        `tool_call_id`. The output is text: read tool calls from it with
        `services.frontend.tool_calls.plan(tools, "auto", None).parse(output.outputs[0].text)`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        plan = chat_tools.plan(tools, "auto" if tools else "none", None)
        texts = []
        for i, conversation in enumerate(conversations):
            if not conversation:
                raise InvalidArgument(f"messages[{i}]", "a conversation needs at least one message")
            shown, template_tools = chat_tools.template_messages(list(conversation), plan,
                                                                 chat_template or self.tokenizer.template_source)
            texts.append(self.tokenizer.apply_chat_template(shown, add_generation_prompt, template_tools,
                                                            chat_template_kwargs, chat_template))
        outputs = self.generate([self.tokenizer.encode(t, add_special_tokens=False) for t in texts],
                                sampling_params, use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def embed(self, prompts: Prompt | Seq[Prompt], use_tqdm: bool = True,
              dimensions: int | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (text, with the tokenizer's special tokens, or token ids), in
        input order; `dimensions` shortens a Matryoshka model's vectors."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
        inputs = [(p, self.tokenizer.encode_pooling(p)) if isinstance(p, str) else (None, [int(t) for t in p])
                  for p in prompts]
        outputs = self._pool(inputs, use_tqdm, "embed")
        if dimensions is not None:
            spec = pooling_spec(self.engine.model_path, is_encoder_folder(self.engine.model_path))
            for output in outputs:
                output.outputs.data = shorten(output.outputs.data, dimensions, spec)
        return outputs

    def score(self, query: str | Seq[str], documents: str | Seq[str], use_tqdm: bool = True,
              instruction: str | None = None) -> list[PoolingRequestOutput]:
        """The relevance of each document to the query (one query for every document, or one each),
        as vLLM's LLM.score: a cross-encoder's score, or a yes/no decoder reranker's P(yes)
        (`instruction`: its task line, Qwen3-Reranker's default otherwise)."""
        documents = [documents] if isinstance(documents, str) else list(documents)
        queries = [query] * len(documents) if isinstance(query, str) else list(query)
        if len(queries) != len(documents):
            raise InvalidArgument("query", f"{len(queries)} queries for {len(documents)} documents")
        encoder = is_encoder_folder(self.engine.model_path)
        inputs = [(None, score_input(self.tokenizer, encoder, q, d, instruction)) for q, d in zip(queries, documents)]
        return self._pool(inputs, use_tqdm, "score")

    def _pool(self, inputs: list[tuple[str | None, list[int]]], use_tqdm: bool, task: str) -> list[PoolingRequestOutput]:
        if self.engine.info.task != task:
            raise InvalidArgument("task", f"this model is served for {self.engine.info.task}; "
                                          f"LLM(model, task={task!r}) to {task}")
        params = SamplingParams(pooling=task, max_tokens=1)
        outputs = {}
        for text, ids in inputs:
            request_id = str(next(self._ids))
            self.scheduler.add_request(request_id, ids, params)
            outputs[request_id] = PoolingRequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids,
                                                       outputs=PoolingOutput(data=[]), finished=False)
        with tqdm(total=len(outputs), desc=task, unit="req", disable=not use_tqdm) as bar:
            while self.scheduler.has_unfinished():
                for update in self.engine.step():
                    if update.pooled is not None:
                        output = outputs[update.request_id]
                        output.outputs.data, output.finished = update.pooled, True
                        bar.update(1)
        return list(outputs.values())

    def _submit(self, prompt: Prompt, params: SamplingParams, priority: int, lora_name: str = "") -> OutputCollector:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        request_id = str(next(self._ids))
        request = self.scheduler.add_request(request_id, ids, params, priority, lora_name=lora_name)
        return OutputCollector(request_id, text, ids, request.params, self.tokenizer)


def _is_token_ids(prompts) -> bool:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
