"""An encoder served from a GGUF file alone (BERT as llama.cpp's converter writes it, tests/gguf_files.py):
the file's WordPiece vocabulary gives the folder's token ids, its pooling type is the one used, and its
vectors are the folder's: the same bits where the file is F32, within the rounding of its weights where
it is F16 or Q8_0. A type the encoder loader does not serve is refused, naming the tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.core.errors import InvalidArgument
from services.core.tokenizer import Tokenizer
from tests.conftest import make_llm
from tests.gguf_files import write_bert_gguf
from tests.engine.test_pooling import cosines

TEXTS = ["the quick brown fox", "Hello World, this is a LONGER sentence: with punctuation!", "a",
         "Café naïve ünïcode 中文 and zzqx", "Paged attention keeps the KV cache in blocks. " * 6]


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("bert_wordpiece")


@pytest.fixture(scope="module")
def folder_vectors(folder):
    llm = make_llm(folder, dtype="float32", max_num_batched_tokens=256)
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])


def embed_file(path) -> np.ndarray:
    llm = make_llm(path, dtype="float32", max_num_batched_tokens=256)
    assert llm.engine.info.task == "embed"  # from the file: an encoder embeds
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])


def test_the_files_vocabulary_gives_the_folders_ids(folder, tmp_path):
    path = write_bert_gguf(folder, tmp_path / "bert.gguf")
    ours, theirs = Tokenizer(path), Tokenizer(folder)
    for text in TEXTS:
        assert ours.encode_pooling(text) == theirs.encode_pooling(text)
    assert ours.encode_pooling(TEXTS[0], TEXTS[1]) == theirs.encode_pooling(TEXTS[0], TEXTS[1])
    assert ours.special_token_id("sep_token") == theirs.special_token_id("sep_token")  # token type 1 starts after it


def test_f32_file_gives_the_folders_bits(folder, folder_vectors, tmp_path):
    vectors = embed_file(write_bert_gguf(folder, tmp_path / "bert-f32.gguf", "f32"))
    assert vectors.tobytes() == folder_vectors.tobytes()


def test_f16_file_pools_as_the_file_says(folder, tmp_path):
    """bert.pooling_type 2 (CLS) where the folder's modules.json says mean: the file's pooling is used."""
    from transformers import AutoModel, AutoTokenizer

    vectors = embed_file(write_bert_gguf(folder, tmp_path / "bert-f16.gguf", "f16", pooling="cls"))
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        cls = [torch.nn.functional.normalize(model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0], dim=-1)
               .numpy() for t in TEXTS]
    assert cosines(vectors, cls).min() >= 0.99999


def test_q8_0_file_within_its_rounding(folder, folder_vectors, tmp_path):
    vectors = embed_file(write_bert_gguf(folder, tmp_path / "bert-q8_0.gguf", "q8_0"))
    # Q8_0 rounds each weight to 8 bits a block of 32: 0.99995 on this model, not the 0.99999 of F16
    assert cosines(vectors, folder_vectors).min() >= 0.9999
    assert not np.array_equal(vectors, folder_vectors)


def test_a_type_not_served_is_refused_naming_the_tensor(folder, tmp_path):
    with pytest.raises(InvalidArgument) as error:
        make_llm(write_bert_gguf(folder, tmp_path / "bert-q4_0.gguf", "q4_0"), dtype="float32")
    assert error.value.field == "model"
    assert "token_embd.weight is Q4_0" in str(error.value) and "F32, F16, BF16, Q8_0" in str(error.value)
