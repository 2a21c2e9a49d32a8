"""The model families the worker serves: one class each, chosen by ModelArchConfig.family
(services/worker/model_config.py SUPPORTED maps each Hugging Face model_type to its family)."""
from __future__ import annotations

from services.worker.models.bert import BertModel
from services.worker.models.gemma import GemmaForCausalLM
from services.worker.models.gpt_oss import GptOssForCausalLM
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.moe import MoeForCausalLM

FAMILIES = {"llama": LlamaForCausalLM, "gemma": GemmaForCausalLM, "moe": MoeForCausalLM, "gpt_oss": GptOssForCausalLM,
            "bert": BertModel}


def model_class(family: str) -> type[LlamaForCausalLM]:
    return FAMILIES[family]
