"""Incremental detokenization: the streamed text is the decoded ids, whole characters only,
cut at a stop string (which is never streamed before it is cut)."""
from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.core.detokenizer import IncrementalDetokenizer
from services.core.sampling_params import SamplingParams
from services.core.tokenizer import Tokenizer


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tiny_llama):
    if request.param == "tiny":
        return Tokenizer(tiny_llama)
    from services.tools.default_model import ensure_default_model

    return Tokenizer(ensure_default_model())


def stream(tokenizer, prompt, ids, chunks, params):
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    pieces, stop, start = [], None, 0
    for size in chunks:
        if start >= len(ids):
            break
        delta = detok.add(ids[start:start + size])
        pieces.append(delta.text)
        stop = stop or delta.stop
        start += size
    if start < len(ids):
        delta = detok.add(ids[start:])
        pieces.append(delta.text)
        stop = stop or delta.stop
    pieces.append(detok.finish())
    return pieces, stop


def expected_text(tokenizer, prompt, ids):
    """The output's text: decoded after the prompt's last tokens (for tokenizers that merge
    spaces), or on its own when the prompt ends inside a character."""
    context = prompt[-6:]
    prefix = tokenizer.decode(context)
    if prefix.endswith("\ufffd"):
        return tokenizer.decode(ids)
    whole = tokenizer.decode(context + ids)
    assert whole.startswith(prefix)
    return whole[len(prefix):]


token_ids = st.lists(st.integers(3, 511), min_size=1, max_size=60)  # ids both vocabularies hold
chunk_sizes = st.lists(st.integers(1, 5), min_size=1, max_size=60)


@settings(max_examples=400, deadline=None)
@given(prompt=st.lists(st.integers(3, 511), min_size=1, max_size=10), ids=token_ids, chunks=chunk_sizes)
def test_streamed_text_is_the_decoded_ids(tokenizer, prompt, ids, chunks):
    pieces, stop = stream(tokenizer, prompt, ids, chunks, SamplingParams())
    assert stop is None
    assert "".join(pieces) == expected_text(tokenizer, prompt, ids)
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # never a split character mid-stream


@settings(max_examples=400, deadline=None)
@given(ids=token_ids, chunks=chunk_sizes, data=st.data())
def test_a_stop_string_cuts_the_text_and_is_never_streamed(tokenizer, ids, chunks, data):
    full = expected_text(tokenizer, [1], ids)
    if len(full) < 2:
        return
    start = data.draw(st.integers(0, len(full) - 2))
    stop = full[start:start + data.draw(st.integers(1, min(4, len(full) - start)))]
    assume("\ufffd" not in stop)  # a stop string is text; U+FFFD only stands for broken bytes
    pieces, matched = stream(tokenizer, [1], ids, chunks, SamplingParams(stop=[stop]))
    assert matched == stop
    assert "".join(pieces) == full[:full.find(stop)]


def test_multibyte_characters_split_across_tokens_arrive_whole(tokenizer):
    text = "你好 🌍 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, _ = stream(tokenizer, [1], ids, [1] * len(ids), SamplingParams())
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
