"""A mixed-domain local corpus for routing traces: English prose, Python code, numbers/tables, Russian.

    python benchmarks/mixed_corpus.py        # (re)writes benchmarks/traces/mixed_corpus.jsonl

Why: the shipped corpus (``lightning_galv/demo/corpus.txt``) is template-generated English sentences of one
register, so nothing about a 64-byte window tells a router which experts it wants more than any other window
does. Real pretraining data mixes domains -- web prose, source code, math and tables, other languages -- and a
sample (one packed window) mostly comes from one document, so its tokens share a domain an expert can
specialise on. That sample-level routing locality is what NetMoE's placement exploits. This module builds such
a mix offline and deterministically, from text the repository already has or generates.

The mix was fixed before any trace was recorded on it, after the proportions Meta reports for Llama 3's
pretraining data ("roughly 50 % general knowledge, 25 % mathematical and reasoning tokens, 17 % code, 8 %
multilingual"), by UTF-8 bytes:

* ``prose`` (50 %): every line of the shipped English corpus, grouped into documents of 8-24 lines;
* ``math`` (25 %): generated CSV tables (a header and numeric rows) and worked arithmetic, a stand-in for the
  math/reasoning share (we have no math text offline; these carry its digits-and-symbols byte statistics);
* ``code`` (17 %): the package's own Python source files, cut at blank lines into documents of <= 3 kB,
  drawn in a seeded order;
* ``russian`` (8 %): template-generated Russian sentences about training (Cyrillic, 2 bytes per letter).

Documents are shuffled (seeded) and written one JSON object per line, ``{"domain": ..., "text": ...}``, so
``lightning_galv.demo.corpus.load_tokens`` reads it as a JSON corpus (``text_field="text"``: byte tokens are
the documents' UTF-8 joined by newlines) and :func:`domain_of_bytes` recovers the domain of every byte.

The shipped ``benchmarks/traces/mixed_corpus.jsonl`` is the output at the commit that added it; rebuilding
later reads the package's *current* source files for the code share, so it can differ in that share (the
trace's ``meta`` records the file's sha256).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MIXED_CORPUS = HERE / "traces" / "mixed_corpus.jsonl"
PROSE_SOURCE = ROOT / "lightning_galv" / "demo" / "corpus.txt"
CODE_ROOT = ROOT / "lightning_galv"
DOMAINS = ("prose", "math", "code", "russian")
MIX = {"prose": 0.50, "math": 0.25, "code": 0.17, "russian": 0.08}  # Llama 3's reported shares, by bytes


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _prose_docs(rng: random.Random) -> list[str]:
    lines = [ln for ln in PROSE_SOURCE.read_text(encoding="utf-8").splitlines() if ln.strip()]
    docs, i = [], 0
    while i < len(lines):
        n = rng.randint(8, 24)
        docs.append("\n".join(lines[i:i + n]))
        i += n
    return docs


def _code_chunks() -> list[str]:
    chunks: list[str] = []
    for path in sorted(CODE_ROOT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        cur: list[str] = []
        size = 0
        for block in text.split("\n\n"):
            b = _nbytes(block) + 2
            if cur and size + b > 3000:
                chunks.append("\n\n".join(cur))
                cur, size = [], 0
            cur.append(block)
            size += b
        if cur and "".join(cur).strip():
            chunks.append("\n\n".join(cur))
    return chunks


_COLUMNS = ("step", "loss", "lr", "tokens", "ms", "gpu", "mem_gb", "grad_norm", "ratio", "count", "x", "y", "price",
            "qty", "year", "temp_c", "id", "score")


def _table(rng: random.Random) -> str:
    cols = rng.sample(_COLUMNS, rng.randint(3, 6))
    lines = [",".join(cols)]
    start = rng.randint(0, 5000)
    for r in range(rng.randint(12, 40)):
        row = []
        for c in cols:
            if c in ("step", "id"):
                row.append(str(start + r))
            elif c == "year":
                row.append(str(1950 + r))
            elif c in ("tokens", "count", "qty", "gpu"):
                row.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
            else:
                row.append(f"{rng.uniform(-1, 1) * 10 ** rng.randint(-3, 3):.{rng.randint(1, 5)}f}")
        lines.append(",".join(row))
    return "\n".join(lines)


def _arithmetic(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(8, 30)):
        a, b = rng.randint(2, 99999), rng.randint(2, 9999)
        op = rng.choice("+-*/")
        if op == "+":
            lines.append(f"{a} + {b} = {a + b}")
        elif op == "-":
            lines.append(f"{a} - {b} = {a - b}")
        elif op == "*":
            lines.append(f"{a} * {b} = {a * b}")
        else:
            lines.append(f"{a} / {b} = {a // b} r {a % b}")
    return "\n".join(lines)


_RU_SUBJ = ("Планировщик", "Оптимизатор", "Каждый ранг", "Эксперт", "Конвейер", "Профилировщик", "Загрузчик данных",
            "Маршрутизатор", "Слой трансформера", "Контрольная точка")
_RU_VERB = ("измеряет", "распределяет", "сохраняет", "пересылает", "вычисляет", "проверяет", "собирает", "делит",
            "обновляет", "оценивает")
_RU_OBJ = ("время шага", "градиенты", "состояние оптимизатора", "токены", "параметры модели", "пропускную способность",
           "нагрузку экспертов", "размер пакета", "функцию потерь", "память устройства")
_RU_TAIL = ("после каждого шага", "на каждом узле", "в начале эпохи", "без лишних копий", "между узлами",
            "внутри одного узла", "в том же порядке", "до следующей итерации", "по всем рангам", "перед обменом")


def _russian(rng: random.Random) -> str:
    sent = [f"{rng.choice(_RU_SUBJ)} {rng.choice(_RU_VERB)} {rng.choice(_RU_OBJ)} {rng.choice(_RU_TAIL)}."
            for _ in range(rng.randint(10, 30))]
    return "\n".join(" ".join(sent[i:i + 4]) for i in range(0, len(sent), 4))


def build_documents(seed: int = 0) -> list[tuple[str, str]]:
    """``[(domain, text)]`` in their shuffled order: all the prose, the other domains filled to their share."""
    rng = random.Random(seed)
    prose = _prose_docs(rng)
    total = sum(_nbytes(d) for d in prose) / MIX["prose"]
    docs = [("prose", d) for d in prose]
    code = _code_chunks()
    rng.shuffle(code)
    makers = {"math": lambda: (_table if rng.random() < 0.6 else _arithmetic)(rng), "russian": lambda: _russian(rng)}
    for dom in ("math", "code", "russian"):
        target, got, i = MIX[dom] * total, 0, 0
        while got < target:
            if dom == "code":
                if i >= len(code):
                    raise ValueError(f"code share {target:.0f} B: the package's source has only {got} B of code "
                                     "chunks. HINT: lower MIX['code'] or add source roots.")
                text, i = code[i], i + 1
            else:
                text = makers[dom]()
            docs.append((dom, text))
            got += _nbytes(text) + 1
    rng.shuffle(docs)
    return docs


def write_corpus(path: Path = MIXED_CORPUS, seed: int = 0) -> Path:
    docs = build_documents(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for dom, text in docs:
            f.write(json.dumps({"domain": dom, "text": text}, ensure_ascii=False) + "\n")
    return path


def read_documents(path: Path = MIXED_CORPUS) -> list[tuple[str, str]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            row = json.loads(line)
            if not isinstance(row, dict) or row.get("domain") not in DOMAINS or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{n}: not a mixed-corpus row (a JSON object with 'domain' in {DOMAINS} and "
                                 "a string 'text'). HINT: rebuild it with python benchmarks/mixed_corpus.py.")
            out.append((row["domain"], row["text"]))
    return out


def domain_of_bytes(docs: list[tuple[str, str]]) -> np.ndarray:
    """``[n_bytes]`` int8 index into :data:`DOMAINS` for every byte of the token stream (documents joined by
    ``"\\n"``; a separator belongs to the document before it)."""
    parts = [np.full(_nbytes(t) + (i + 1 < len(docs)), DOMAINS.index(d), np.int8) for i, (d, t) in enumerate(docs)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int8)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    p = write_corpus(Path(sys.argv[1]) if len(sys.argv) > 1 else MIXED_CORPUS)
    docs = read_documents(p)
    by = {d: sum(_nbytes(t) + 1 for dd, t in docs if dd == d) for d in DOMAINS}
    tot = sum(by.values())
    print(f"wrote {p} ({p.stat().st_size / 1e3:.0f} kB, {len(docs)} documents): "
          + ", ".join(f"{d} {100 * b / tot:.1f} %" for d, b in by.items()))
