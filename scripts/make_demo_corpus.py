"""Write a demo text corpus from the Python standard library's ``.py`` sources, as JSON lines.

Every Python installation ships its standard library sources, so this gives real text without a
download. Each line is ``{"path": <path relative to the stdlib root>, "text": <file contents>}``.

Guarantees:

* deterministic: files are taken in sorted order of their POSIX relative paths, so a given Python
  installation and ``--max-bytes`` always give the same corpus;
* bounded: the corpus is the longest prefix of that order whose UTF-8 text fits in ``--max-bytes``;
* faithful: file contents are kept byte for byte (no newline translation); files that are not
  valid UTF-8 (a few encoding tests) are skipped, and so are installed third-party packages.

Usage::

    python scripts/make_demo_corpus.py --output data/stdlib.jsonl --max-bytes 4194304
"""

import argparse
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Iterator, NamedTuple

DEFAULT_MAX_BYTES = 4 * 2**20

# Third-party code installed inside the stdlib tree varies between installations.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class SourceFile(NamedTuple):
    path: str  # relative to the stdlib root, POSIX separators
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_sources(root: Path, max_bytes: int) -> Iterator[SourceFile]:
    """Yield the UTF-8 ``.py`` files under ``root`` in sorted order until one exceeds the cap."""
    remaining = max_bytes
    for relative_path in sorted(_python_files(root)):
        data = (root / relative_path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if len(data) > remaining:
            return
        remaining -= len(data)
        yield SourceFile(relative_path, text)


def _python_files(root: Path) -> Iterator[str]:
    """POSIX paths, relative to ``root``, of the ``.py`` files outside excluded directories."""
    for directory, subdirectories, files in os.walk(root):
        # Pruning in place keeps the walk out of large third-party trees.
        subdirectories[:] = [name for name in subdirectories if name not in _EXCLUDED_DIRS]
        relative_directory = Path(directory).relative_to(root)
        for name in files:
            if name.endswith(".py"):
                yield (relative_directory / name).as_posix()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="JSON-lines file to write")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help=f"cap on the total UTF-8 size of the source text (default {DEFAULT_MAX_BYTES})",
    )
    args = parser.parse_args(argv)

    root = stdlib_root()
    sources = list(iter_sources(root, args.max_bytes))
    if not sources:
        print(
            f"{parser.prog}: error: no source fits in --max-bytes {args.max_bytes}", file=sys.stderr
        )
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as out:
        for source in sources:
            out.write(json.dumps(source._asdict(), ensure_ascii=False) + "\n")
    total_bytes = sum(len(source.text.encode("utf-8")) for source in sources)
    print(
        f"{len(sources)} files, {total_bytes} bytes of the Python {platform.python_version()} "
        f"standard library ({root}) -> {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
