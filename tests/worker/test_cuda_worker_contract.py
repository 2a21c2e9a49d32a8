"""What a worker asks of CUDA, checked on a CPU-only torch with the CUDA calls stubbed at their
boundary (torch.cuda.*, CUDA allocations, pinned host memory): the KV cache sized from the device's
free memory, a pinned swap pool, swaps as asynchronous copies on copy streams ordered against the
compute stream, and `--device cuda:N`. (The kernels' launch grids: tests/kernels/test_launch_grid.py.)
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from services.core.errors import InvalidArgument
from services.worker.__main__ import build_configs, parse_args
from services.worker.kv_cache import CUDA_MEMORY_FRACTION, KVCache, block_bytes, num_blocks_for
from services.worker.loader import resolve_quantization
from services.worker.model_config import ModelArchConfig
from services.worker.worker import pick_device

CFG = ModelArchConfig.from_dict(dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, intermediate_size=128, num_hidden_layers=3, vocab_size=512))
GPU = torch.device("cuda", 1)


class FakeStream:
    def __init__(self, log: list, name: str, device=None):
        self.log, self.name, self.device = log, name, torch.device(device) if device is not None else GPU

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device that is the CPU underneath: 'cuda' tensors are CPU tensors, pinning is recorded,
    and streams log what waits for what and which copies run on them."""
    log, calls = [], dict(pinned=[], devices=[], mem_get_info=[], set_device=[])
    compute = FakeStream(log, "compute")
    active = [compute]
    streams = iter(["swap-out stream", "swap-in stream"])
    real_zeros, real_copy = torch.zeros, torch.Tensor.copy_

    def zeros(*shape, device=None, pin_memory=False, **kwargs):
        calls["devices"].append(torch.device(device) if device is not None else torch.device("cpu"))
        calls["pinned"].append(pin_memory)
        return real_zeros(*shape, **kwargs)

    def copy_(self, src, non_blocking=False):
        log.append(f"copy on {active[-1].name}" + (" (async)" if non_blocking else ""))
        return real_copy(self, src, non_blocking=non_blocking)

    @contextlib.contextmanager
    def stream(s):
        active.append(s)
        yield
        active.pop()

    def mem_get_info(device=None):
        calls["mem_get_info"].append(device)
        return 8 << 30, 80 << 30

    current = [0]
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (calls["set_device"].append(d),
                                                             current.__setitem__(0, torch.device(d).index)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, next(streams), device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log, calls


def test_kv_cache_takes_a_share_of_the_devices_free_memory(fake_cuda):
    _, calls = fake_cuda
    per_block = block_bytes(CFG, 16, torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 2 * 16 * 2  # K and V, layers, block size, KV heads, head dim, bf16 bytes
    assert num_blocks_for(CFG, 16, torch.bfloat16, GPU, None, None) == int((8 << 30) * CUDA_MEMORY_FRACTION) // per_block
    assert calls["mem_get_info"] == [GPU], "the worker's own GPU, not the current one"
    assert num_blocks_for(CFG, 16, torch.bfloat16, GPU, None, 1 << 20) == (1 << 20) // per_block
    assert num_blocks_for(CFG, 16, torch.bfloat16, GPU, 77, None) == 77
    assert calls["mem_get_info"] == [GPU], "an explicit budget or block count asks the device nothing"


def test_the_swap_pool_is_pinned_and_swaps_are_async_copies_on_copy_streams(fake_cuda):
    log, calls = fake_cuda
    cache = KVCache(CFG, num_blocks=8, num_cpu_blocks=4, block_size=16, dtype=torch.bfloat16, device=GPU)
    num_tensors = 2 * CFG.num_layers
    assert calls["devices"] == [GPU] * num_tensors + [torch.device("cpu")] * num_tensors
    assert calls["pinned"] == [False] * num_tensors + [True] * num_tensors
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape).to(k.dtype))
        v.copy_(torch.randn(v.shape).to(v.dtype))
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    log.clear()

    cache.swap_out([(3, 0), (5, 1)])
    copies = 2 * 2 * CFG.num_layers  # blocks x (K, V) x layers
    assert log == ["swap-out stream waits for compute"] + ["copy on swap-out stream (async)"] * copies + \
        ["compute waits for swap-out stream"]
    for k, v in cache.layers:  # the scheduler gives blocks 3 and 5 to other sequences
        k[3:6].zero_()
        v[3:6].zero_()
    log.clear()
    cache.swap_in([(0, 7), (1, 3)])
    assert log == ["swap-in stream waits for compute"] + ["copy on swap-in stream (async)"] * copies + \
        ["compute waits for swap-in stream"]
    for (k, v), (k0, v0) in zip(cache.layers, before):
        assert torch.equal(k[7], k0[3]) and torch.equal(v[7], v0[3])
        assert torch.equal(k[3], k0[5]) and torch.equal(v[3], v0[5])
    log.clear()
    cache.swap_out([])
    assert log == [], "an empty swap touches no stream"


def test_a_cpu_worker_pins_nothing_and_makes_no_stream(fake_cuda):
    log, calls = fake_cuda
    cache = KVCache(CFG, num_blocks=8, num_cpu_blocks=4, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.copy_streams is None and not any(calls["pinned"])
    cache.swap_out([(1, 0)])
    cache.swap_in([(0, 2)])
    assert not any("stream" in line for line in log)


def test_device_cuda_n_selects_that_gpu(fake_cuda):
    _, calls = fake_cuda
    worker, *_ = build_configs(parse_args(["--device", "cuda:2"]))
    assert worker.device == "cuda:2"
    assert pick_device(worker.device) == torch.device("cuda", 2)
    assert calls["set_device"] == [torch.device("cuda", 2)], "the current device: where Triton launches"
    assert pick_device("cuda") == torch.device("cuda", 2), "plain cuda: the current GPU, named by its index"
    assert pick_device("auto") == torch.device("cuda", 2)
    with pytest.raises(InvalidArgument, match="sees 4 CUDA devices") as refused:
        pick_device("cuda:4")
    assert refused.value.field == "device"


@pytest.mark.parametrize("device", ["cuda:", "cuda:x", "cuda:-1", "gpu", "cuda:1:2"])
def test_a_malformed_device_is_refused_naming_the_field(device):
    with pytest.raises(SystemExit):  # the command line: status 2, the message names --device
        build_configs(parse_args(["--device", device]))


def test_cuda_without_a_gpu_is_refused_naming_the_field():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidArgument) as refused:
        pick_device("cuda:0")
    assert refused.value.field == "device"
    assert pick_device("auto") == torch.device("cpu")


def test_a_gpu_worker_serves_a_folder_with_a_gguf_from_its_dense_weights(tmp_path):
    """The default model's folder holds a GGUF beside its safetensors; the quantized kernels are CPU
    kernels, so on a GPU `--quantization auto` loads the dense weights instead of refusing to start."""
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"")
    assert resolve_quantization("auto", tmp_path, "cpu") == "gguf"
    assert resolve_quantization("auto", tmp_path, "cuda") == "none"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh runs it)")
def test_swaps_on_a_real_gpu_are_bit_exact_through_the_pinned_pool():
    device = pick_device("cuda")
    cache = KVCache(CFG, num_blocks=8, num_cpu_blocks=4, block_size=16, dtype=torch.bfloat16, device=device)
    assert cache.copy_streams is not None and all(k.is_pinned() and v.is_pinned() for k, v in cache.cpu_layers)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, device=device))
        v.copy_(torch.randn(v.shape, device=device))
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    cache.swap_out([(3, 0), (5, 1)])
    for k, v in cache.layers:  # queued on the compute stream after the swap-out: it must wait for the copies
        k[3:6].zero_()
        v[3:6].zero_()
    cache.swap_in([(0, 7), (1, 3)])
    torch.cuda.synchronize()
    for (k, v), (k0, v0) in zip(cache.layers, before):
        assert torch.equal(k[7], k0[3]) and torch.equal(v[7], v0[3])
        assert torch.equal(k[3], k0[5]) and torch.equal(v[3], v0[5])
