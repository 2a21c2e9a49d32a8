"""The GGUF tokenizer (services/core/gguf_tokenizer.py) against llama.cpp's own (llama-server's /tokenize),
per pre-tokenizer name, on tests/core/test_gguf_tokenizer.py's text set and its vocabulary learned without
any split (its merges cross every regex's cuts, so a different cut shows in the ids).

    python bench/gguf_tokenizer_llamacpp.py --llama-cpp-dir LLAMA_CPP/build/bin [gpt-4o qwen35 ...]

Prints, per name, how many texts give the same ids, and each text that does not with both id lists.
A tiny random llama carries the vocabulary (llama-server loads a model to tokenize).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402

NAMES = ("gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o", "deepseek-v3")


def unsplit_folder(out: Path) -> Path:
    """A tiny random llama whose tokenizer.json is the test's unsplit vocabulary (its size the model's)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from services.tools.make_model import make_model
    from services.tools.make_tokenizer import CORPUS_PATH, SPECIAL_TOKENS
    from tests.core.test_gguf_tokenizer import TEXTS

    folder = make_model(out, arch="llama", size="tiny", vocab_size=1500)
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS_PATH.read_text().splitlines() + TEXTS * 20, trainers.BpeTrainer(
        vocab_size=1500, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def llama_cpp_ids(port: int, text: str) -> list[int]:
    body = json.dumps({"content": text, "add_special": False, "parse_special": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as answer:
        return json.loads(answer.read())["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=NAMES)
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-server (default: $LLAMA_CPP_DIR)")
    args = parser.parse_args()
    from services.core.tokenizer import Tokenizer
    from tests.core.test_gguf_tokenizer import TEXTS
    from tests.gguf_files import write_gguf

    server_bin, why = llamacpp.binary(args.llama_cpp_dir, "llama-server")
    if server_bin is None:
        sys.exit(why)
    tmp = Path(tempfile.mkdtemp(prefix="gguf-tokenizer-"))
    folder = unsplit_folder(tmp / "model")
    for name in args.names:
        path = write_gguf(folder, tmp / f"{name}.gguf", pre=name)
        ours = Tokenizer(path)
        same = 0
        with llamacpp.Server(server_bin, path, 1, slots=1, ctx_per_slot=256) as server:
            for text in TEXTS:
                theirs, mine = llama_cpp_ids(server.port, text), ours.encode(text, add_special_tokens=False)
                same += theirs == mine
                if theirs != mine:
                    print(f"{name}: differs on {text!r}\n  engine    {mine}\n  llama.cpp {theirs}")
        print(f"{name}: {same}/{len(TEXTS)} texts give the same ids")


if __name__ == "__main__":
    main()
