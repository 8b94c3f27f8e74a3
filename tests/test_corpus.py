"""Local corpora through ``datasets``: text / JSON Lines / parquet give the same tokens, the token cache is hit
on the second run, a local tokenizer.json (trained here, no hub) trains the model, bad inputs say what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lightning_galv.demo import corpus as C
from lightning_galv.demo.corpus import (DEFAULT_CORPUS, ByteCorpus, TokenWindows, check_vocab, load_tokenizer,
                                        load_tokens, tokenize_corpus)

LINES = DEFAULT_CORPUS.read_text(encoding="utf-8").split("\n")[:120]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _write_three(folder: Path) -> dict[str, Path]:
    """The same rows as a text file (one per line), JSON Lines and parquet (column "body", plus another)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    txt, jsonl, parquet = folder / "c.txt", folder / "c.jsonl", folder / "c.parquet"
    txt.write_text("\n".join(LINES), encoding="utf-8")
    jsonl.write_text("".join(json.dumps({"id": i, "body": line}) + "\n" for i, line in enumerate(LINES)))
    pq.write_table(pa.table({"id": list(range(len(LINES))), "body": LINES}), parquet)
    return {"txt": txt, "jsonl": jsonl, "parquet": parquet}


def test_text_jsonl_and_parquet_of_the_same_rows_give_identical_token_windows(tmp_path: Path) -> None:
    files = _write_three(tmp_path / "data")
    streams = {k: load_tokens(p, text_field="body", cache_dir=tmp_path / "cache") for k, p in files.items()}
    expected = torch.tensor(list("\n".join(LINES).encode("utf-8")), dtype=torch.long)
    for k, s in streams.items():
        assert torch.equal(s, expected), k
    windows = {k: torch.stack([w[i] for i in range(len(w))]) for k, w in
               ((k, TokenWindows(s, 32)) for k, s in streams.items())}
    assert len(list(TokenWindows(streams["txt"], 32))) == len(windows["txt"])  # iteration ends
    assert windows["txt"].shape[0] > 100
    assert torch.equal(windows["txt"], windows["jsonl"]) and torch.equal(windows["txt"], windows["parquet"])
    # a folder and a glob resolve to the files in it, sorted
    assert torch.equal(load_tokens(str(tmp_path / "data" / "*.jsonl"), text_field="body",
                                   cache_dir=tmp_path / "cache"), expected)
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "a.parquet").write_bytes(files["parquet"].read_bytes())
    assert torch.equal(load_tokens(tmp_path / "only", text_field="body", cache_dir=tmp_path / "cache"), expected)


def test_the_shipped_corpus_gives_the_same_byte_stream_as_before_the_cache(tmp_path: Path) -> None:
    """The byte tokenizer's stream is the UTF-8 of the rows joined by newlines: what ByteCorpus always fed the
    recipes (so their losses, tests and benchmarks see the same tokens)."""
    from datasets import load_dataset

    ds = load_dataset("text", data_files=[str(DEFAULT_CORPUS)], split="train", cache_dir=str(tmp_path / "hf"))
    before = torch.tensor(list("\n".join(ds["text"]).encode("utf-8")), dtype=torch.long)
    assert torch.equal(load_tokens([DEFAULT_CORPUS], cache_dir=tmp_path / "cache"), before)
    assert torch.equal(C.load_byte_tokens([DEFAULT_CORPUS]), before)  # the default cache folder too


def test_the_second_run_reads_the_token_cache_and_a_changed_file_is_tokenized_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _write_three(tmp_path / "data")
    calls: list[int] = []
    real = C._Encode.__call__

    def counting(self, batch):  # type: ignore[no-untyped-def]
        calls.append(len(batch[self.column]))
        return real(self, batch)

    monkeypatch.setattr(C._Encode, "__call__", counting)
    cache = tmp_path / "cache"
    first = tokenize_corpus(files["jsonl"], text_field="body", cache_dir=cache)
    assert sum(calls) == len(LINES)  # every row tokenized once
    cached = Path(first.cache_files[0]["filename"])
    assert cached.parent == cache / C.TOKENS_FOLDER and cached.name.startswith("tokens-"), cached
    stamp = cached.stat().st_mtime_ns
    calls.clear()
    second = tokenize_corpus(files["jsonl"], text_field="body", cache_dir=cache)
    assert calls == []  # nothing tokenized: read from the cache file
    assert Path(second.cache_files[0]["filename"]) == cached and cached.stat().st_mtime_ns == stamp
    # another text field, tokenizer or file content is another cache file
    with files["jsonl"].open("a") as f:
        f.write(json.dumps({"id": -1, "body": "one more row"}) + "\n")
    os.utime(files["jsonl"], ns=(stamp + 10**9, stamp + 10**9))
    third = tokenize_corpus(files["jsonl"], text_field="body", cache_dir=cache)
    assert sum(calls) == len(LINES) + 1 and Path(third.cache_files[0]["filename"]) != cached


def _train_tokenizer(path: Path, vocab: int = 320) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(DEFAULT_CORPUS)], trainer)
    tok.save(str(path))
    return path


def test_a_local_tokenizer_json_tokenizes_and_the_model_trains_on_it(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    import lightning.pytorch as L

    from lightning_galv.demo.module import CausalLM

    path = _train_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(path)
    assert tok.vocab_size == 320
    stream = load_tokens([DEFAULT_CORPUS], tokenizer=path, cache_dir=tmp_path / "cache")
    raw = load_tokens([DEFAULT_CORPUS], cache_dir=tmp_path / "cache")
    assert 0 <= int(stream.min()) and int(stream.max()) < 320
    assert len(stream) < 0.8 * len(raw)  # merges: fewer tokens than bytes
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(path)).decode(stream[:200].tolist()) == \
        bytes(raw[:len(Tokenizer.from_file(str(path)).decode(stream[:200].tolist()).encode())].tolist()).decode()

    data = ByteCorpus(tokenizer=str(path), seq_len=32, batch_size=4, cache_dir=str(tmp_path / "cache"))
    assert data.vocab_size == 320
    torch.manual_seed(0)
    model = CausalLM(vocab_size=320, dim=32, n_layers=2, n_heads=4, max_seq_len=32, lr=3e-3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    # the model's vocabulary must cover the tokenizer's ids
    small = CausalLM(vocab_size=256, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"vocab_size 256: smaller than the 320 token ids of tokenizer .*"
                                         r"HINT: --model.vocab_size 320"):
        trainer.fit(small, datamodule=ByteCorpus(tokenizer=str(path), seq_len=32, cache_dir=str(tmp_path / "cache")))
    check_vocab(256, load_tokenizer(None))  # bytes fit 256


def test_bad_inputs_say_what_is_wrong_and_what_to_do(tmp_path: Path) -> None:
    files = _write_three(tmp_path / "data")
    with pytest.raises(ValueError, match=r"text field 'text': not a column of .*c\.jsonl; its columns are "
                                         r"\['id', 'body'\]\. HINT: --data.text_field"):
        load_tokens(files["jsonl"], cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"text field 'content': not a column of .*c\.parquet.*\['id', 'body'\]"):
        load_tokens(files["parquet"], text_field="content", cache_dir=tmp_path / "cache")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"d\.csv': unknown extension '\.csv'.*HINT:"):
        load_tokens(tmp_path / "d.csv")
    with pytest.raises(ValueError, match=r"mix formats .*HINT: convert"):
        load_tokens([files["txt"], files["jsonl"]])
    with pytest.raises(ValueError, match=r"not found\. HINT:"):
        load_tokens(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"matches no file\. HINT:"):
        load_tokens(str(tmp_path / "*.parquet"))
    with pytest.raises(ValueError, match=r"tokenizer .*missing.json': file not found\. HINT:"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{}")
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match=r"broken\.json': not a tokenizer\.json .*HINT:"):
        load_tokenizer(tmp_path / "broken.json")
    (tmp_path / "nums.jsonl").write_text(json.dumps({"text": [1, 2]}) + "\n")
    with pytest.raises(TypeError, match=r"text field 'text': a row holds list .*HINT:"):
        load_tokens(tmp_path / "nums.jsonl", cache_dir=tmp_path / "cache")
