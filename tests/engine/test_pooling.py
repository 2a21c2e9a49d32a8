"""Pooling models in process (LLM.embed, LLM.score): parity with sentence-transformers and
transformers in fp32, the same bits alone or batched, chunked or not, and the blocks given back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.core.errors import InvalidArgument
from tests.conftest import make_llm, random_prompts

TEXTS = ["the quick brown fox", "hello world, this is a longer sentence with more words in it", "a",
         "Paged attention keeps the KV cache in blocks. " * 6]
COSINE = 0.99999


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def bert(model_dir):
    return model_dir("bert")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def bert_llm(bert):
    before = rss_bytes()
    llm = make_llm(bert, dtype="float32", max_num_batched_tokens=256)
    llm.rss_growth = rss_bytes() - before  # what making the engine took (test_an_encoder_holds_no_kv_cache)
    return llm


@pytest.fixture(scope="module")
def qwen3(model_dir):
    return model_dir("qwen3", vocab_size=2048)  # its vocabulary has the pieces "yes" and "no"


def test_bert_embeddings_match_sentence_transformers_and_transformers(bert, bert_llm):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    ours = [o.outputs.embedding for o in bert_llm.embed(TEXTS, use_tqdm=False)]
    st = SentenceTransformer(str(bert), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert cosines(ours, st).min() >= COSINE
    tokenizer, model = AutoTokenizer.from_pretrained(bert), AutoModel.from_pretrained(bert).eval()
    with torch.no_grad():
        ref = []
        for text in TEXTS:  # mean over the tokens, normalised, as the folder's modules.json says
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            ref.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy())
    assert cosines(ours, ref).min() >= COSINE
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_token_ids_embed_as_their_text(bert_llm):
    ids = bert_llm.tokenizer.encode_pooling(TEXTS[1])
    assert bert_llm.embed([ids], use_tqdm=False)[0].outputs.embedding == \
        bert_llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding


def test_bert_same_bits_alone_or_in_a_batch_and_blocks_freed(bert_llm):
    prompts = random_prompts(16, 512, min_len=2, max_len=120, seed=3)
    batched = [o.outputs.embedding for o in bert_llm.embed(prompts, use_tqdm=False)]
    for i in (0, 1, 7):
        assert bert_llm.embed([prompts[i]], use_tqdm=False)[0].outputs.embedding == batched[i]
    blocks = bert_llm.scheduler.workers["worker-0"].blocks
    assert blocks.num_free_blocks == bert_llm.engine.info.num_gpu_blocks  # nothing kept after a pooling step


def test_an_encoder_holds_no_kv_cache(bert_llm):
    """It never reads one: its blocks are ids for the scheduler's admission, with no memory behind them (the
    default 1 GiB CPU budget and its swap pool took 1.1 GiB for this tiny model before)."""
    assert bert_llm.engine.info.num_gpu_blocks > 0 and bert_llm.engine.info.num_cpu_blocks == 0
    assert bert_llm.rss_growth < 512 << 20


def test_encoder_input_limits(bert_llm):
    with pytest.raises(InvalidArgument) as error:  # an encoder runs a whole input in one step
        bert_llm.embed([[5] * 300], use_tqdm=False)
    assert error.value.field == "input"
    with pytest.raises(InvalidArgument) as error:
        bert_llm.embed([[5] * 513], use_tqdm=False)
    assert error.value.field == "input"
    with pytest.raises(InvalidArgument) as error:
        bert_llm.generate("hello", use_tqdm=False)
    assert error.value.field == "task"
    with pytest.raises(InvalidArgument) as error:  # a shorter vector only where the model says it may
        bert_llm.embed("hello", use_tqdm=False, dimensions=8)
    assert error.value.field == "dimensions"


def test_a_pooling_worker_refuses_enable_lora(bert):
    with pytest.raises(InvalidArgument) as error:  # adapters serve generation only (docs/guide/embeddings.md)
        make_llm(bert, dtype="float32", enable_lora=True)
    assert error.value.field == "enable_lora" and "embed" in error.value.message


def test_cross_encoder_scores_match_sentence_transformers(model_dir):
    from sentence_transformers import CrossEncoder

    folder = model_dir("bert_classifier")
    llm = make_llm(folder, dtype="float32")
    ours = [o.outputs.score for o in llm.score("the fox", TEXTS, use_tqdm=False)]
    ref = CrossEncoder(str(folder), device="cpu").predict([("the fox", t) for t in TEXTS])
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_decoder_last_token_embedding_exact_chunked_or_batched(qwen3):
    from transformers import AutoModel

    prompts = random_prompts(6, 2048, min_len=3, max_len=90, seed=5)
    whole = make_llm(qwen3, dtype="float32", task="embed")
    ours = [o.outputs.embedding for o in whole.embed(prompts, use_tqdm=False)]
    model = AutoModel.from_pretrained(qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1).numpy()
               for p in prompts]
    assert cosines(ours, ref).min() >= COSINE
    alone = whole.embed([prompts[1]], use_tqdm=False)[0].outputs.embedding
    assert alone == ours[1]
    chunked = make_llm(qwen3, dtype="float32", task="embed", max_num_batched_tokens=16, enable_prefix_caching=True)
    assert [o.outputs.embedding for o in chunked.embed(prompts, use_tqdm=False)] == ours
    assert [o.outputs.embedding for o in chunked.embed(prompts[:2], use_tqdm=False)] == ours[:2]  # prefix-cache hits

    reranker = make_llm(qwen3, dtype="float32", task="score")
    docs = ["paged attention", "the KV cache in blocks", "a fox"]
    scores = [o.outputs.score for o in reranker.score("what is paged attention?", docs, use_tqdm=False)]
    lm = __import__("transformers").AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    tok = reranker.tokenizer
    from services.core.pooling import score_input

    yes, no = tok.token_id("yes"), tok.token_id("no")
    with torch.no_grad():
        for doc, score in zip(docs, scores):
            logits = lm(torch.tensor([score_input(tok, False, "what is paged attention?", doc)])).logits[0, -1]
            assert score == pytest.approx(float(torch.softmax(logits[[no, yes]], -1)[1]), abs=1e-6)


@pytest.mark.slow
def test_xlm_roberta_positions_start_after_the_padding_id(bert, tmp_path):
    """XLM-RoBERTa is BERT's code with its positions offset by pad_token_id + 1 and one token type."""
    import shutil

    import transformers
    from sentence_transformers import SentenceTransformer

    config = transformers.XLMRobertaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, max_position_embeddings=513, type_vocab_size=1,
                                           pad_token_id=0, architectures=["XLMRobertaModel"])
    torch.manual_seed(0)
    transformers.XLMRobertaModel(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json"):
        shutil.copy(bert / name, tmp_path / name)
    for folder in ("1_Pooling", "2_Normalize"):
        shutil.copytree(bert / folder, tmp_path / folder)
    ours = [o.outputs.embedding for o in make_llm(tmp_path, dtype="float32").embed(TEXTS, use_tqdm=False)]
    assert cosines(ours, SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS)).min() >= COSINE
