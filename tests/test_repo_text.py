"""cpu tier: what the repository says about itself.

Results are named by GPU, date and commit, never by where or how the work was done: no tracked
file name and no tracked text file may use the words listed in WORDS (the pattern is built from
pieces, so this file does not contain them). scripts/ holds at most 8 maintained tools, each
opening with a usage line. Needs a git checkout (skipped in an sdist or wheel).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["ses" + "sion", r"\ble" + r"nt\b", r"\bv" + r"ms?\b"]
PATTERN = re.compile("|".join(WORDS), re.IGNORECASE)


def _tracked() -> list:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def test_pattern_catches_the_words():
    for text in ("a Se" + "ssion", "on the le" + "nt ones", "two V" + "Ms", "a v" + "m"):
        assert PATTERN.search(text), text
    for text in ("excellent", "lenticular", "silent", "llvm", "vmap"):
        assert not PATTERN.search(text), text


def test_no_tracked_file_names_or_texts_use_the_words():
    hits = []
    for name in _tracked():
        if PATTERN.search(name):
            hits.append(f"{name}: file name")
        data = (ROOT / name).read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (an image): compressed bytes are not wording
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if PATTERN.search(line):
                hits.append(f"{name}:{lineno}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_scripts_are_few_and_say_how_to_use_them():
    scripts = sorted(n for n in _tracked() if n.startswith("scripts/"))
    assert 0 < len(scripts) <= 8, scripts
    for name in scripts:
        lines = (ROOT / name).read_text().splitlines()
        head = lines[1] if lines[0].startswith("#!") else lines[0]
        assert re.match(r'^(# |""")Usage: ', head), f"{name} must open with a usage line: {head!r}"
