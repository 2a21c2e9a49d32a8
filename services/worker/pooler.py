"""A pooling worker's output for each pooling sequence whose prompt a step finished
(services/core/pooling.py says what pooling is and how it is chosen).

- embed: the last layer's hidden states pooled (CLS, mean or last token), L2-normalised where the
  model asks, as fp32;
- score: an encoder's classification head over its first token (sigmoid of one label, softmax of
  several: a cross-encoder's relevance), or a decoder reranker's P(yes) from the last token's logits
  of the "yes" and "no" tokens (Qwen3-Reranker: softmax over [no, yes]).

Each sequence is pooled from its own rows alone, one at a time, so its output has the same bits
whatever else the step ran (rule 4); a last-token pool reads one row, so it is the same chunked or not.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from services.core.errors import InvalidArgument
from services.core.pooling import PoolingSpec, is_encoder_folder, pooling_spec
from services.core.tokenizer import Tokenizer


class Pooler:
    def __init__(self, model, task: str, spec: PoolingSpec, yes_no: tuple[int, int] | None = None):
        """yes_no: a decoder reranker's ("yes", "no") token ids (task score without a classification head)."""
        self.model, self.task, self.spec, self.yes_no = model, task, spec, yes_no
        self.encoder = getattr(model, "encoder", False)
        if task == "score" and not self.encoder and yes_no is None:
            raise InvalidArgument("task", "score with a decoder needs the tokens 'yes' and 'no' in its vocabulary "
                                          "(a Qwen3-Reranker-style model)")

    @property
    def whole(self) -> bool:
        """Whether a sequence must run its whole prompt in one step (WorkerInfo.pooling_whole)."""
        return self.encoder or (self.task == "embed" and self.spec.whole)

    @torch.inference_mode()
    def pool(self, hidden: torch.Tensor, first_row: int, last_row: int, start: int) -> list[float]:
        """One sequence's output from its rows [first_row, last_row] of this step (its prompt from
        position `start` on)."""
        if self.whole and start != 0:
            raise InvalidArgument("step", f"this model pools a whole input in one step; this one started at {start}")
        if self.task == "score":
            return self._score(hidden, first_row, last_row)
        mode = self.spec.mode
        if mode == "cls":
            vector = hidden[first_row]
        elif mode == "mean":
            vector = hidden[first_row:last_row + 1].float().mean(dim=0)
        else:
            vector = hidden[last_row]
        vector = vector.float()
        if self.spec.normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector.tolist()

    def _score(self, hidden: torch.Tensor, first_row: int, last_row: int) -> list[float]:
        if self.encoder:
            logits = self.model.classify(hidden[first_row:first_row + 1])[0]
            scores = torch.sigmoid(logits) if logits.shape[0] == 1 else torch.softmax(logits, dim=-1)
            return scores.tolist()
        logits = self.model.compute_logits(hidden[last_row:last_row + 1])[0]
        yes, no = self.yes_no
        pair = torch.stack([logits[no], logits[yes]])
        return [float(torch.softmax(pair, dim=-1)[1])]


def architectures(model_path: Path) -> tuple[str, ...]:
    """config.json's architectures (a GGUF file alone: BertModel for an encoder's, else none, so a generator
    unless --task says)."""
    if is_encoder_folder(model_path) and Path(model_path).is_file():
        return ("BertModel",)
    path = Path(model_path) / "config.json"
    return tuple(json.loads(path.read_text()).get("architectures") or ()) if path.is_file() else ()


def make_pooler(model, task: str, model_path: Path, tokenizer_path: Path, arch) -> Pooler:
    """The worker's pooler, and an encoder's separator id (where its token type 1 starts)."""
    tokenizer = Tokenizer(tokenizer_path)
    if arch.is_encoder:
        model.sep_token_id = tokenizer.special_token_id("sep_token")
    yes_no = None
    if task == "score" and not arch.is_encoder:
        yes, no = tokenizer.token_id("yes"), tokenizer.token_id("no")  # the vocabulary's pieces, as Qwen3-Reranker
        yes_no = (yes, no) if yes is not None and no is not None else None
    return Pooler(model, task, pooling_spec(model_path, arch.is_encoder), yes_no)
