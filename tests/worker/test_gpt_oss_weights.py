"""gpt-oss's checkpoint tensors as the loader reads them: its MXFP4 experts dequantized as transformers does."""
import pytest
import torch

from services.worker.checkpoint_names import dequantize_mxfp4

pytestmark = pytest.mark.slow  # transformers imported, two engines


def test_mxfp4_experts_dequantize_to_transformers_values():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)  # [E, out, in / 32, 16]
    scales = torch.randint(118, 135, (3, 8, 4), dtype=torch.uint8, generator=gen)
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)  # [E, in, out]
    got = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    assert got.shape == (3, 8, 128)
    assert torch.equal(got.transpose(1, 2), want)


def test_a_folder_with_mxfp4_experts_gives_the_bits_of_its_dequantized_folder(model_dir, tmp_path):
    """The Hub's gpt-oss folders store each layer's experts as *_blocks / *_scales: served as the folder
    holding the same experts dequantized (transformers' own conversion writes it)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.conftest import greedy, make_llm

    dense = model_dir("gpt_oss", "tiny")
    tensors = load_file(dense / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    packed, unpacked = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, out = tensors[name].shape
        blocks = torch.randint(0, 256, (experts, out, fan_in // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(120, 124, (experts, out, fan_in // 32), dtype=torch.uint8, generator=gen)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        unpacked[name] = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32).contiguous()
    runs = []
    for kind, weights in (("mxfp4", packed), ("dense", unpacked)):
        folder = shutil.copytree(dense, tmp_path / kind, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights, folder / "model.safetensors")
        outs = make_llm(folder).generate([[5, 6, 7, 8], [9, 10]], greedy(4, logprobs=1), use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert runs[0] == runs[1]
