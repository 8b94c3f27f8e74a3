"""Local corpora through Hugging Face ``datasets`` (no hub access), tokenized once and cached.

The package ships a small generated corpus (``demo/corpus.txt``) so the demo and recipes run on any
machine. ``files=`` takes your own data instead: text (``.txt``/``.text``/``.md``: one row per line), JSON /
JSON Lines (``.json``/``.jsonl``) or parquet files -- one file, a list, a folder (every supported file under
it) or a glob -- read with ``datasets.load_dataset("text" | "json" | "parquet", data_files=...)``; the text
of a JSON / parquet row is its ``text_field`` column.

Why cached: tokenizing a large corpus takes long and every rank (and every run) needs the same tokens. The
rows are tokenized by ``Dataset.map`` into an Arrow file named by a fingerprint of everything that decides
the tokens (the files' paths, sizes and modification times, the format, the text field, the tokenizer's
content, the separator and :data:`TOKENS_FORMAT`), under ``cache_dir`` (default: the ``datasets`` cache,
``$HF_DATASETS_CACHE``) in ``lightning_galv_tokens/``; the next run with the same inputs reads that file and
tokenizes nothing.

Tokenizers need no hub either: the default is byte-level (UTF-8 bytes, vocabulary 256), or a local
``tokenizer.json`` (the ``tokenizers`` library: ``pip install "lightning_galv[tokenizers]"``). Rows are
joined with ``separator`` ("\\n") into one token stream that is cut into fixed windows; with the byte
tokenizer the stream is exactly the UTF-8 bytes of the rows joined by newlines (what this module produced
before the cache existed, so runs and tests over the shipped corpus see the same tokens).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

DEFAULT_CORPUS = Path(__file__).parent / "corpus.txt"
# file suffix -> the ``datasets`` builder that reads it
BUILDERS: dict[str, str] = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                            ".parquet": "parquet"}
# bumped whenever the cached token layout changes, so an older cache file is never read as a newer one
TOKENS_FORMAT = 1
TOKENS_FOLDER = "lightning_galv_tokens"


class TokenWindows(Dataset):
    """Fixed-length ``[seq_len + 1]`` windows over one long stream of tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:  # also ends iter(): without it, list(windows) would never stop
            raise IndexError(f"window {i}: out of range for {self.n} windows")
        start = (i % self.n) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]


# ---------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CorpusFiles:
    """The resolved input files of a corpus and the one ``datasets`` builder that reads them all."""

    builder: str
    paths: tuple[str, ...]


def _builder_of(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in BUILDERS:
        raise ValueError(f"corpus file {path!r}: unknown extension {suffix or '(none)'!r}, expected one of "
                         f"{sorted(BUILDERS)}. HINT: rename it (a .txt file is read one row per line; .jsonl one "
                         "JSON object per line) or convert it to parquet.")
    return BUILDERS[suffix]


def resolve_files(files: str | Path | Sequence[str | Path]) -> CorpusFiles:
    """Expand ``files`` (a path, a folder, a glob, or a list of these) into existing files of one format.

    A folder contributes every file with a supported suffix under it (recursively, sorted, hidden ones
    skipped); a glob every match (sorted). One format per corpus, because one ``datasets`` builder reads it.
    """
    given = [files] if isinstance(files, (str, Path)) else list(files)
    if not given:
        raise ValueError("corpus files []: empty. HINT: pass a file, a folder or a glob, e.g. --data.files "
                         "data/*.jsonl; leave data.files unset for the shipped corpus.")
    paths: list[str] = []
    for item in given:
        if not isinstance(item, (str, Path)):
            raise TypeError(f"corpus file {item!r}: must be a path string, not {type(item).__name__}. "
                            "HINT: data.files takes a path, a folder, a glob, or a list of them.")
        text = os.path.expanduser(str(item))
        if os.path.isdir(text):
            found = sorted(str(p) for p in Path(text).rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS
                           and not any(part.startswith(".") for part in p.relative_to(text).parts))
            if not found:
                raise ValueError(f"corpus folder {text!r}: no file with a supported extension {sorted(BUILDERS)} "
                                 "in it. HINT: point data.files at the files themselves, or a glob.")
            paths += found
        elif glob.has_magic(text):
            found = sorted(p for p in glob.glob(text, recursive=True) if os.path.isfile(p))
            if not found:
                raise ValueError(f"corpus glob {text!r}: matches no file. HINT: check the pattern (relative "
                                 "paths in a recipe are relative to the recipe file).")
            paths += found
        elif os.path.isfile(text):
            paths.append(text)
        else:
            raise ValueError(f"corpus files [{text!r}]: not found. HINT: pass existing local files, a folder or a "
                             "glob; the hub is not used.")
    builders = {p: _builder_of(p) for p in paths}
    kinds = sorted(set(builders.values()))
    if len(kinds) > 1:
        example = {k: next(p for p, b in builders.items() if b == k) for k in kinds}
        raise ValueError(f"corpus files mix formats {example}: one corpus is read by one datasets builder. "
                         "HINT: convert them to one format (e.g. all .jsonl), or train on one kind.")
    return CorpusFiles(kinds[0], tuple(str(Path(p).resolve()) for p in paths))


# ---------------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download or train."""

    vocab_size: int = 256

    @property
    def fingerprint(self) -> str:
        return "bytes:utf-8"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


@dataclass(frozen=True)
class FileTokenizer:
    """A local ``tokenizer.json`` (Hugging Face ``tokenizers``), loaded on first use; no hub access.

    Special tokens are not added (rows are joined into one stream, not encoded as separate sequences).
    """

    path: str

    @cached_property
    def _tokenizer(self) -> Any:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ValueError(f"tokenizer {self.path!r}: reading a tokenizer.json needs the 'tokenizers' package. "
                             "HINT: pip install \"lightning_galv[tokenizers]\", or leave data.tokenizer unset for "
                             "the byte-level tokenizer.") from exc
        try:
            return Tokenizer.from_file(self.path)
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            raise ValueError(f"tokenizer {self.path!r}: not a tokenizer.json the tokenizers library can read "
                             f"({' '.join(str(exc).split())}). HINT: save one with Tokenizer.save(path).") from exc

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @cached_property
    def fingerprint(self) -> str:
        return "tokenizer.json:" + hashlib.sha256(Path(self.path).read_bytes()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]


Tokenizer = ByteTokenizer | FileTokenizer


def load_tokenizer(tokenizer: str | Path | Tokenizer | None) -> Tokenizer:
    """``None`` -> bytes; a path -> that local ``tokenizer.json``; a tokenizer object as is."""
    if tokenizer is None:
        return ByteTokenizer()
    if isinstance(tokenizer, (ByteTokenizer, FileTokenizer)):
        return tokenizer
    if not isinstance(tokenizer, (str, Path)):
        raise TypeError(f"tokenizer {tokenizer!r}: must be a path to a tokenizer.json or None, not "
                        f"{type(tokenizer).__name__}. HINT: data.tokenizer: path/to/tokenizer.json")
    path = os.path.expanduser(str(tokenizer))
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer {path!r}: file not found. HINT: pass a local tokenizer.json (the hub is not "
                         "used), or leave data.tokenizer unset for the byte-level tokenizer.")
    tok = FileTokenizer(str(Path(path).resolve()))
    tok.vocab_size  # noqa: B018  (fail now on a missing library or a malformed file, not inside map)
    return tok


def check_vocab(model_vocab: int, tokenizer: Tokenizer) -> None:
    """A model whose embedding has fewer rows than the tokenizer has ids would index past it (a crash deep
    in the first step, or worse, on a vocab-sharded embedding): refuse before training."""
    if model_vocab < tokenizer.vocab_size:
        what = "the byte tokenizer" if isinstance(tokenizer, ByteTokenizer) else f"tokenizer {tokenizer.path!r}"
        raise ValueError(f"model vocab_size {model_vocab}: smaller than the {tokenizer.vocab_size} token ids of "
                         f"{what}. HINT: --model.vocab_size {tokenizer.vocab_size} (or larger, e.g. rounded up to "
                         "a multiple of the tensor-parallel degree).")


# ---------------------------------------------------------------------------------------------------
# tokens
# ---------------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """The ``datasets`` cache (``$HF_DATASETS_CACHE``), where the token files go unless told otherwise."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE)


def tokens_fingerprint(corpus: CorpusFiles, text_field: str, tokenizer: Tokenizer, separator: str) -> str:
    """What decides the token stream, hashed: equal inputs share one cache file, a changed file gets a new one.

    Files enter by resolved path, size and modification time (like ``make``): hashing a large corpus's
    content on every run would cost about what the cache saves.
    """
    files = []
    for p in corpus.paths:
        st = os.stat(p)
        files.append([p, st.st_size, st.st_mtime_ns])
    key = {"format": TOKENS_FORMAT, "builder": corpus.builder, "files": files,
           "field": text_field if corpus.builder != "text" else "text", "tokenizer": tokenizer.fingerprint,
           "separator": separator}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class _Encode:
    """The ``Dataset.map`` function: each row's ids followed by the separator's (the last one is dropped
    after flattening, so the stream equals the rows joined by the separator)."""

    tokenizer: Tokenizer
    column: str
    separator_ids: tuple[int, ...] = field(default=())

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        texts = batch[self.column]
        for t in texts:
            if t is not None and not isinstance(t, str):
                raise TypeError(f"text field {self.column!r}: a row holds {type(t).__name__} {str(t)[:60]!r}, not "
                                "text. HINT: --data.text_field names the column with the text.")
        ids = self.tokenizer.encode_batch(["" if t is None else t for t in texts])
        return {"input_ids": [row + list(self.separator_ids) for row in ids]}


def tokenize_corpus(files: str | Path | Sequence[str | Path] | None = None, *, text_field: str = "text",
                    tokenizer: str | Path | Tokenizer | None = None, cache_dir: str | Path | None = None,
                    separator: str = "\n") -> Any:
    """The corpus as a ``datasets.Dataset`` with one ``input_ids`` row per input row (separator appended),
    read from the token cache when it holds these inputs, else tokenized into it."""
    from datasets import Features, Sequence as DSequence, Value, load_dataset

    corpus = resolve_files(files if files is not None else [DEFAULT_CORPUS])
    tok = load_tokenizer(tokenizer)
    ds = load_dataset(corpus.builder, data_files=list(corpus.paths), split="train",
                      cache_dir=None if cache_dir is None else str(cache_dir))
    column = "text" if corpus.builder == "text" else text_field
    if column not in ds.column_names:
        shown = corpus.paths[0] if len(corpus.paths) == 1 else f"{corpus.paths[0]} (and {len(corpus.paths) - 1} more)"
        raise ValueError(f"text field {text_field!r}: not a column of {shown}; its columns are {ds.column_names}. "
                         f"HINT: --data.text_field {ds.column_names[0] if ds.column_names else 'COLUMN'} (the "
                         "column holding the text).")
    fp = tokens_fingerprint(corpus, column, tok, separator)
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir()) / TOKENS_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    sep_ids = tuple(tok.encode_batch([separator])[0]) if separator else ()
    return ds.map(_Encode(tok, column, sep_ids), batched=True, remove_columns=ds.column_names,
                  features=Features({"input_ids": DSequence(Value("int32"))}),
                  cache_file_name=str(folder / f"tokens-{fp}.arrow"), new_fingerprint=fp, load_from_cache_file=True,
                  desc="tokenizing")


def stream_of(tokenized: Any, separator_len: int) -> torch.Tensor:
    """One ``long`` tensor: every row's ids in order, less the separator after the last row."""
    import pyarrow as pa

    column = tokenized.data.column("input_ids")
    values = pa.concat_arrays([c.flatten() for c in column.chunks]) if column.num_chunks else pa.array([], pa.int32())
    out = torch.from_numpy(values.to_numpy(zero_copy_only=False).astype("int64"))
    return out[:len(out) - separator_len] if len(tokenized) and separator_len else out


def load_tokens(files: str | Path | Sequence[str | Path] | None = None, *, text_field: str = "text",
                tokenizer: str | Path | Tokenizer | None = None, cache_dir: str | Path | None = None,
                separator: str = "\n") -> torch.Tensor:
    """The corpus as one stream of token ids (see the module docstring); cached after the first call."""
    tok = load_tokenizer(tokenizer)
    tokenized = tokenize_corpus(files, text_field=text_field, tokenizer=tok, cache_dir=cache_dir, separator=separator)
    return stream_of(tokenized, len(tok.encode_batch([separator])[0]) if separator else 0)


def load_byte_tokens(files: Sequence[str | Path]) -> torch.Tensor:
    """UTF-8 bytes of the files' lines joined by newlines (the byte tokenizer over text files)."""
    return load_tokens(files)


# ---------------------------------------------------------------------------------------------------
# the data module
# ---------------------------------------------------------------------------------------------------
class ByteCorpus(L.LightningDataModule):
    """Train/val split of a local corpus in fixed token windows; byte-level (vocabulary 256) unless
    ``tokenizer`` names a local ``tokenizer.json``.

    (The name predates tokenizer files; recipes name it through the LightningCLI ``data:`` section.)
    ``prepare_data`` (one process per node) fills the token cache, so the ranks' ``setup`` only read it.
    """

    def __init__(self, files: str | list[str] | None = None, seq_len: int = 64, batch_size: int = 8,
                 val_fraction: float = 0.05, num_workers: int = 0, text_field: str = "text",
                 tokenizer: str | None = None, cache_dir: str | None = None) -> None:
        super().__init__()
        self.files = files or [str(DEFAULT_CORPUS)]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.text_field, self.tokenizer, self.cache_dir = text_field, tokenizer, cache_dir
        self.train: Dataset | None = None
        self.val: Dataset | None = None

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``: the model's ``vocab_size`` must be at least this."""
        return self._tokenizer.vocab_size

    def _tokens(self) -> torch.Tensor:
        return load_tokens(self.files, text_field=self.text_field, tokenizer=self._tokenizer, cache_dir=self.cache_dir)

    def _check_model_vocab(self) -> None:
        """The attached model's ``vocab_size`` (a hyper-parameter, when it has one) covers the tokenizer's ids."""
        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        model_vocab = getattr(model, "hparams", {}).get("vocab_size") if model is not None else None
        if isinstance(model_vocab, int):
            check_vocab(model_vocab, self._tokenizer)

    def prepare_data(self) -> None:
        self._check_model_vocab()  # before tokenizing a large corpus for a run that cannot start
        self._tokens()

    def setup(self, stage: str | None = None) -> None:
        self._check_model_vocab()
        tokens = self._tokens()
        cut = int(len(tokens) * (1 - self.val_fraction))
        self.train = TokenWindows(tokens[:cut], self.seq_len)
        self.val = TokenWindows(tokens[cut:], self.seq_len)
        if len(self.train) == 0:
            raise ValueError(f"corpus {self.files!r}: {len(tokens)} tokens, fewer than one training window of "
                             f"seq_len {self.seq_len} + 1. HINT: more text, or a smaller --data.seq_len.")

    def _loader(self, ds: Dataset | None, shuffle: bool) -> DataLoader:
        assert ds is not None, "call setup() first"
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val, False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val, False)

    def state_dict(self) -> dict[str, Any]:
        return {"files": self.files, "seq_len": self.seq_len, "text_field": self.text_field,
                "tokenizer": self.tokenizer}
