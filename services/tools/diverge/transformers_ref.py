"""Hugging Face transformers as the outside reference: fp32 greedy `generate`, then one
teacher-forced forward over prompt + output for the chosen tokens' logprobs and top-2 margins."""
from __future__ import annotations

from pathlib import Path

import torch

from services.tools.diverge.compare import Sample


class TransformersReference:
    def __init__(self, model_path: str | Path):
        from transformers import AutoModelForCausalLM  # only this variant needs it

        path = Path(model_path)
        where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name} if path.is_file() else \
            {"pretrained_model_name_or_path": str(path)}  # a GGUF file: transformers dequantizes it
        self.model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id

    def greedy(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> Sample:
        self.model.generation_config.eos_token_id = None if ignore_eos else self.eos
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        return self.scored(prompt, out)

    def scored(self, prompt: list[int], tokens: list[int]) -> Sample:
        """`tokens` with transformers' logprob of each and its top-2 margin there."""
        if not tokens:
            return Sample(token_ids=[], logprobs=[], margins=[])
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        logprobs = torch.log_softmax(logits, -1)
        top = logprobs.topk(2, -1).values
        chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        return Sample(token_ids=list(tokens), logprobs=chosen.tolist(), margins=(top[:, 0] - top[:, 1]).tolist())
