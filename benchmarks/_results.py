"""One writer for benchmarks/RESULTS.md: each benchmark owns one delimited section and replaces only it."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    """Replace ``<!-- name:start -->...<!-- name:end -->`` with ``body`` (append the section if missing)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body}\n{end}"
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
