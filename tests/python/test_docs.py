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


# ----------------------------------------------------------------------------- snippets as printed

CONTINUES = re.compile(r"^#\s*continues\b[^\n]*", re.I)
NEEDS_GPU = re.compile(r"needs a GPU", re.I)


def doc_snippets() -> list[tuple[str, int, str]]:
    """(file, index, source) of every ```python block of README.md and docs/*.md."""
    out = []
    for f in ["README.md"] + sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")):
        text = open(os.path.join(ROOT, f), encoding="utf-8").read()
        for i, m in enumerate(re.finditer(r"^```python[^\n]*\n(.*?)^```", text, re.S | re.M)):
            out.append((f, i, m.group(1)))
    return out


def free_names(src: str) -> set[str]:
    """Names a block reads that it neither defines nor imports (nor are builtins)."""
    import builtins
    import symtable

    import ast

    top = symtable.symtable(src, "<snippet>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    defined |= {n.target.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.NamedExpr)}  # := in a comprehension
    free: set[str] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for s in t.get_symbols():
            if s.is_referenced() and (t is top or s.is_global()) and s.get_name() not in defined:
                free.add(s.get_name())
        for child in t.get_children():
            walk(child)
    walk(top)
    return free - set(dir(builtins))


def chains() -> list[list[tuple[str, int, str]]]:
    """The snippets grouped as they run: a block whose first line says "# continues ..." runs after
    the block before it, in its namespace."""
    out: list[list[tuple[str, int, str]]] = []
    for f, i, src in doc_snippets():
        if CONTINUES.match(src) and out and out[-1][0][0] == f:
            out[-1].append((f, i, src))
        else:
            out.append([(f, i, src)])
    return out


def test_the_name_check_sees_what_a_fragment_lacks():
    assert free_names("engine = pyinfinity.initialize(model, config)\n") == {"pyinfinity", "model", "config"}
    assert free_names("import torch\nx = [torch.zeros(1) for _ in range(2)]\nprint(len(x))\n") == set()


def test_every_doc_snippet_runs_by_itself_or_says_which_block_it_continues():
    bad = []
    for chain in chains():
        defined: set[str] = set()
        for f, i, src in chain:
            missing = free_names(src) - defined
            if missing:
                marker = CONTINUES.match(src)
                bad.append(f"{f} python block {i + 1}: uses {sorted(missing)} "
                           + ("that the blocks it continues do not define" if marker else
                              "without a first line '# continues the block above (...)'"))
            import symtable

            top = symtable.symtable(src, "<snippet>", "exec")
            defined |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    assert not bad, "\n".join(bad)


def test_readmes_swap_layer_snippets_run_as_printed(tmp_path, monkeypatch):
    """The swap layer's blocks with /mnt/nvme0 and /mnt/nvme1 as directories under tmp_path (nothing
    else changed); the CudaStager block runs where there is a GPU (it says it needs one)."""
    import torch

    chain = next(c for c in chains() if c[0][0] == "README.md" and "SwapEngine()" in c[0][2])
    dirs = {f"/mnt/nvme{k}": str(tmp_path / f"nvme{k}") for k in (0, 1)}
    for d in dirs.values():
        os.makedirs(d)
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "readme"}
    ran = 0
    for f, i, src in chain:
        if NEEDS_GPU.search(src.splitlines()[0]) and not torch.cuda.is_available():
            continue  # the block says it needs a GPU
        for old, new in dirs.items():
            src = src.replace(old, new)
        exec(compile(src, f"{f} python block {i + 1}", "exec"), ns)
        ran += 1
    assert ran >= 1 and os.path.getsize(os.path.join(dirs["/mnt/nvme0"], "x.bin")) == 12345 + 4 * 1_000_003


def test_benchmarks_lead_with_one_table_per_shape_then_the_history():
    """BENCHMARKS.md opens with the current figure of each shape (a table whose columns name the
    latest figure, the command and the machine) before the dated history."""
    text = open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8").read()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0].startswith("Current figures"), sections[:3]
    current = text.split("\n## ", 2)[1]
    shapes = re.split(r"^### ", current, flags=re.M)[1:]
    assert len(shapes) >= 4
    for shape in shapes:
        header = next(line for line in shape.splitlines() if line.startswith("| "))
        assert "latest figure" in header, shape.splitlines()[0]
        assert "command" in header or "flags" in header, shape.splitlines()[0]
        assert "measured" in header, shape.splitlines()[0]
    assert "MAKE_TRAIN" not in text  # no placeholder left
