"""The worker's sampler and step preparation make every tensor on the logits' (the worker's)
device. `meta` tensors stand in for CUDA ones on a CPU-only torch: any helper tensor made on
the CPU meets a meta tensor and fails, as it would on a GPU worker."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from services.core.sampling_params import SamplingParams
from services.core.step import NewSequence
from services.worker.model_runner import ModelRunner
from services.worker.sampler import SamplingRow, sample, sample_tokens

META = torch.device("meta")
EOS = (2,)


def _rows() -> list[SamplingRow]:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.7, min_p=0.1),
              SamplingParams(temperature=0, logit_bias={3: 2.0}), SamplingParams(temperature=1.0, min_tokens=4)]
    return [SamplingRow(params=p.with_seed(11 + i), sample_index=0, position=20 + i, prompt_token_ids=[5, 6],
                        output_token_ids=[7]) for i, p in enumerate(params)]


def test_sampling_runs_on_the_logits_device():
    rows = _rows()
    tokens = sample_tokens(torch.empty(len(rows), 64, device=META), rows, EOS)
    assert tokens.device == META and tokens.shape == (len(rows),) and tokens.dtype == torch.int64


def test_sample_tokens_are_the_sampled_tokens():
    rows = _rows()
    logits = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(0))
    assert sample_tokens(logits, rows, EOS).tolist() == [token for token, _ in sample(logits, rows, EOS)]


def test_step_preparation_makes_its_tensors_on_the_worker_device():
    kv_cache = SimpleNamespace(block_size=4, num_blocks=16, layers=[])
    model = SimpleNamespace(cfg=SimpleNamespace(eos_token_ids=EOS))
    runner = ModelRunner(model, kv_cache, META)
    params = SamplingParams(max_tokens=4, seed=1)
    scheduled = [runner._add(NewSequence(
        seq_id=seq_id, prompt_token_ids=list(range(3, 3 + n)), output_token_ids=[],
        block_ids=list(range(4 * seq_id, 4 * seq_id + 3)), num_computed_tokens=0, num_scheduled_tokens=n, params=params,
        sample_index=0)) for seq_id, n in ((0, 9), (1, 5))]
    input_ids, _, meta = runner._tensors(runner._prepare(scheduled))
    tensors = [input_ids, meta.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
               *meta.layout]
    assert all(t.device == META for t in tensors)
