"""The repository's documents stand on their own: no link or path outside the repository, no
issue numbers or notes about how the project is run, links that resolve, and help texts
without Sphinx markup."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORBIDDEN = [
    (re.compile(r"\.\./"), "a path outside the repository"),
    (re.compile(r"(?<![\w/.-])shared/"), "a folder outside the repository"),
    (re.compile(r"(?<![\w&])#\d+\b"), "an issue number"),
    (re.compile(r"\bissue \d+\b|\bthe issue's\b", re.I), "an issue reference"),
    (re.compile(r"\$OUT\b"), "a path of the machine the figures were made on"),
    (re.compile(r"\bdevice time\b|\bcarry:|\.whl\b|\.debs\b|\blent\b", re.I), "how the project's sessions run"),
    (re.compile(r"/work/"), "an absolute path of a development machine"),
]


def tracked_docs() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.split() if os.path.exists(os.path.join(ROOT, f))]


def problems(text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pat, what in FORBIDDEN:
            m = pat.search(line)
            if m:
                found.append(f"line {n}: {what}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return found


def test_the_checker_catches_what_it_should():
    assert problems("Design: [`ARCHITECTURE.md`](../shared/ARCHITECTURE.md)")
    assert problems("as in issue 3") and problems("fixed in #12") and problems("--json $OUT/x.json")
    assert not problems("## Heading\n`make train` on a GPU: see docs/architecture.md")


def test_tracked_docs_name_nothing_outside_the_repository():
    docs = tracked_docs()
    assert "docs/architecture.md" in docs and "README.md" in docs
    bad = {f: problems(open(os.path.join(ROOT, f), encoding="utf-8").read()) for f in docs}
    assert not {f: p for f, p in bad.items() if p}


def test_markdown_links_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    missing = []
    for f in tracked_docs():
        text = open(os.path.join(ROOT, f), encoding="utf-8").read()
        for target in link.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(f), target))):
                missing.append(f"{f}: {target}")
    assert not missing


@pytest.mark.parametrize("args", [["bench", "--help"], ["bench", "train", "--help"], ["plan", "--help"],
                                  ["train", "--help"]], ids=" ".join)
def test_help_texts_are_plain(args):
    p = subprocess.run([sys.executable, "-m", "pyinfinity", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not re.search(r":(mod|func|class|meth|data):`", p.stdout), p.stdout
    assert not problems(p.stdout), problems(p.stdout)


def test_the_package_points_at_the_design_record():
    import pyinfinity

    assert "docs/architecture.md" in pyinfinity.__doc__
    assert "ARCHITECTURE.md" not in pyinfinity.__doc__
