"""The documentation runs: code blocks of the pages, docstring examples, the site build.

* Every ```python block of ``docs/*.md`` and ``docs/howto/*.md`` is executed.
  The blocks of one page run in order in one namespace, as a notebook would.
  All pages run in one subprocess with 4 (fake) CPU devices, so the
  multi-device examples really use several devices. To opt a block out, put
  ``<!-- test: skip -->`` on the line before its fence (invisible on the site;
  ```python skip also works here but breaks the fence in mkdocs). Use that
  sparingly: a sketch that cannot run, such as code that edits the package.
  A block announced by ``<!-- test: output -->`` right after a ```python block
  shows that block's output, and must equal it (up to trailing whitespace).
* The examples in the public docstrings run as doctests.
* ``mkdocs build --strict`` succeeds, so broken links and references fail.
  Skipped when mkdocs, mkdocs-material or mkdocstrings are not installed
  (``pip install -e ".[docs]"``).

Run the pages by hand with ``python tests/test_docs.py docs/quickstart.md ...``.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NDEV = 4
_MARK = "@@DOCS-RESULTS@@"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_SKIP_COMMENT = re.compile(r"<!--\s*test:\s*skip\s*-->")
_OUTPUT_COMMENT = re.compile(r"<!--\s*test:\s*output\s*-->")


# --------------------------------------------------------------------------- #
# Extraction
# --------------------------------------------------------------------------- #
def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + sorted((DOCS / "howto").glob("*.md"))


def _fences(lines):
    """``[(start, end, indent, info)]`` of the fenced blocks (line indices of the fences)."""
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks = m["ticks"]
        j = i + 1
        while j < len(lines):
            end = _FENCE.match(lines[j])
            if end and end["ticks"].startswith(ticks[0] * len(ticks)) and not end["info"].strip():
                break
            j += 1
        out.append((i, j, m["indent"], m["info"].strip()))
        i = j + 1
    return out


def _body(lines, start, end, indent):
    body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
            for ln in lines[start + 1 : end]]
    return textwrap.dedent("\n".join(body)) + "\n"


def extract_blocks(text: str, with_output: bool = False):
    """``[(first line number, code, skipped)]`` of the ```python blocks of a page.

    With ``with_output``, each tuple also holds the expected stdout of the block:
    the body of a fenced block that follows it, announced by ``<!-- test: output -->``
    (None when there is none).
    """
    lines = text.splitlines()
    fences = _fences(lines)
    blocks = []
    for k, (start, end, indent, info) in enumerate(fences):
        words = info.replace("{", " ").replace("}", " ").replace(".", " ").split()
        if not words or words[0] not in ("python", "py"):
            continue
        prev = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        skip = "skip" in words[1:] or bool(_SKIP_COMMENT.search(prev))
        expected = None
        if k + 1 < len(fences):
            nstart, nend, nindent, _ = fences[k + 1]
            between = [ln.strip() for ln in lines[end + 1 : nstart] if ln.strip()]
            if between and all(_OUTPUT_COMMENT.search(b) for b in between):
                expected = _body(lines, nstart, nend, nindent)
        code = _body(lines, start, end, indent)
        blocks.append((start + 2, code, skip, expected) if with_output else (start + 2, code, skip))
    return blocks


def _normalise(out: str) -> str:
    return "\n".join(ln.rstrip() for ln in out.strip().splitlines())


# --------------------------------------------------------------------------- #
# Execution (in the subprocess)
# --------------------------------------------------------------------------- #
def run_page(path: Path) -> dict:
    """Runs the blocks of one page in one fresh namespace; stops at the first error."""
    rel = str(path.relative_to(ROOT))
    namespace = {"__name__": "__docs__", "__file__": str(path)}
    out = io.StringIO()
    t0 = time.time()
    ran = 0
    for line, code, skip, expected in extract_blocks(path.read_text(), with_output=True):
        if skip:
            continue
        block_out = io.StringIO()
        try:
            compiled = compile(code, f"{rel}:{line}", "exec")
            with contextlib.redirect_stdout(block_out):
                exec(compiled, namespace)  # noqa: S102 - running our own docs
        except BaseException:  # noqa: BLE001 - report any failure of the block
            out.write(block_out.getvalue())
            return {"ok": False, "line": line, "error": traceback.format_exc(limit=-8),
                    "stdout": out.getvalue()[-3000:], "seconds": time.time() - t0}
        out.write(block_out.getvalue())
        if expected is not None and _normalise(block_out.getvalue()) != _normalise(expected):
            return {"ok": False, "line": line,
                    "error": "its output differs from the block shown after it "
                             "(<!-- test: output -->); update the page.\n--- shown ---\n"
                             f"{_normalise(expected)}\n--- actual ---\n"
                             f"{_normalise(block_out.getvalue())}",
                    "stdout": "", "seconds": time.time() - t0}
        ran += 1
    return {"ok": True, "blocks": ran, "seconds": time.time() - t0}


def _main(argv):
    os.chdir(ROOT)
    results = {}
    for p in argv:
        path = (ROOT / p).resolve()
        results[str(path.relative_to(ROOT))] = run_page(path)
    print(_MARK + json.dumps(results))


def run_pages_subprocess(pages, timeout=600) -> dict:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={NDEV}".strip()
    if "xla_backend_optimization_level" not in env["XLA_FLAGS"]:  # halves CPU compile times
        env["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *[str(p.relative_to(ROOT)) for p in pages]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(
        f"docs runner crashed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
def test_extract_blocks():
    text = "\n".join([
        "# t", "```python", "a = 1", "```", "```bash", "ls", "```",
        "1. item", "    ```python", "    b = a + 1", "    ```",
        "```python skip", "raise SystemExit", "```",
        "<!-- test: skip -->", "", "```python", "raise SystemExit", "```",
    ])
    blocks = extract_blocks(text)
    assert [(code, skip) for _, code, skip in blocks] == [
        ("a = 1\n", False), ("b = a + 1\n", False),
        ("raise SystemExit\n", True), ("raise SystemExit\n", True),
    ]
    text = "\n".join(["```python", "print(1)", "```", "<!-- test: output -->", "```text",
                      "1", "```", "```python", "x = 2", "```", "```text", "2", "```"])
    assert [e for *_, e in extract_blocks(text, with_output=True)] == ["1\n", None]


def test_every_page_has_examples():
    for page in ["quickstart.md", "concepts.md", "statistics.md", "explain.md"]:
        assert any(not s for _, _, s in extract_blocks((DOCS / page).read_text())), page
    for page in (DOCS / "howto").glob("*.md"):
        assert any(not s for _, _, s in extract_blocks(page.read_text())), page.name


@pytest.mark.parametrize("half", [0, 1])
def test_doc_pages_run(half):
    """Every page's code runs: every other page in one subprocess per half (two tests,
    which pytest-xdist may run at once; each page once, not once per worker)."""
    pages = doc_pages()[half::2]
    results = run_pages_subprocess(pages)
    failures = [
        f"docs/{Path(page).relative_to('docs')}: the ```python block at line {res['line']} "
        f"failed:\n{res['error']}\n--- stdout of the page so far ---\n{res['stdout']}"
        for page, res in results.items() if not res["ok"]
    ]
    assert len(results) == len(pages)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


DOCTEST_MODULES = [
    "jaxpr_surgery",
    "jaxpr_surgery.stats",
    "jaxpr_surgery.optim",
    "jaxpr_surgery._src.api",
    "jaxpr_surgery._src.check",
    "jaxpr_surgery._src.laws",
    "jaxpr_surgery._src.custom_ops",
    "jaxpr_surgery._src.explain",
    "jaxpr_surgery._src.stats",
    "jaxpr_surgery._src.stats_research",
    "jaxpr_surgery._src.optim.adam",
    "jaxpr_surgery._src.optim.dp",
    "jaxpr_surgery._src.optim.monitor",
    "jaxpr_surgery._src.optim.requests",
    "jaxpr_surgery._src.optim.schedules",
    "jaxpr_surgery._src.optim.sign",
    "jaxpr_surgery._src.optim.shampoo",
    "jaxpr_surgery._src.optim.wrappers",
    "jaxpr_surgery._src.optim.accumulate",
    "jaxpr_surgery._src.dots",
    "jaxpr_surgery._src.partials",
    "jaxpr_surgery.privacy",
    "jaxpr_surgery._src.privacy.accounting",
    "jaxpr_surgery._src.privacy.sampling",
    "jaxpr_surgery._src.privacy.clipped_grad",
]


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples(module):
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    report = io.StringIO()
    for test in finder.find(mod, module, globs={}):
        runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"doctest failures in {module}:\n{report.getvalue()}"


def _public(module):
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
    return [(f"{module}.{n}", getattr(mod, n)) for n in names
            if callable(getattr(mod, n)) and not isinstance(getattr(mod, n), type(mod))]


def test_public_api_has_docstrings():
    missing = [name for m in ("jaxpr_surgery", "jaxpr_surgery.stats", "jaxpr_surgery.optim",
                                   "jaxpr_surgery.extend")
               for name, obj in _public(m) if not (getattr(obj, "__doc__", None) or "").strip()]
    assert not missing, f"public objects without a docstring: {missing}"


def _have(*modules):
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.skipif(
    not _have("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"),
    reason='needs mkdocs, mkdocs-material and mkdocstrings[python] (pip install -e ".[docs]")',
)
def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    hint = ""
    if "AliasResolutionError" in proc.stderr:
        hint = ("\nhint: griffe (mkdocstrings) cannot see into a package directory without an "
                "__init__.py; every package under jaxpr_surgery/ needs one.")
    out = f"{proc.stdout}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"mkdocs build --strict failed:{hint}\n{out}"
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "stats" / "index.html").exists()


if __name__ == "__main__":
    _main(sys.argv[1:])
