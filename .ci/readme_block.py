"""Print the first shell block under a README.md heading, as written, for .ci/run to run.

`python3 .ci/readme_block.py "First run"` prints the block of the section whose heading starts
with "First run"; `--line N` prints only its N-th line (1-based).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def block(heading: str) -> str:
    sections = re.split(r"^## ", README.read_text(encoding="utf-8"), flags=re.M)
    for section in sections:
        if section.startswith(heading):
            fence = re.search(r"^```(?:bash|sh|shell)\n(.*?)^```", section, re.M | re.S)
            if fence:
                return fence.group(1)
            sys.exit(f"README.md: the section {heading!r} has no shell block")
    sys.exit(f"README.md: no section starts with {heading!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("heading")
    parser.add_argument("--line", type=int)
    args = parser.parse_args()
    text = block(args.heading)
    if args.line is not None:
        lines = text.splitlines()
        if not 1 <= args.line <= len(lines):
            sys.exit(f"README.md: the block of {args.heading!r} has {len(lines)} lines")
        text = lines[args.line - 1] + "\n"
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
