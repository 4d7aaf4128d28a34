"""The documentation: the site builds with ``mkdocs build --strict``, and every Python and shell
example in README.md and docs/ runs, or says why it does not.

An example is a fenced block tagged ``python``, ``bash``, ``sh``, ``shell`` or ``console``
(untagged blocks are output, trees and tables). A block is not run when the line above it is
``<!-- not run: WHY -->`` (in pages whose examples are mostly runnable) or when ``NOT_RUN``
below names it by file and first line, with the reason. Everything else runs: a file's Python
blocks in order in one fresh interpreter (a later block sees the names of an earlier one), each
shell block in ``bash -euo pipefail``, both in a temporary directory with the venv's ``bin``
first on ``PATH``. A Python block already run verbatim for an earlier file is not run twice.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGS = {"python": "python", "bash": "shell", "sh": "shell", "shell": "shell",
             "console": "shell"}
NOT_RUN_MARK = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")

#: (page, first line of the block) -> why it is not run. For pages whose examples are sketches
#: over the caller's own objects, or need a service CI does not start.
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "make run    # creates .venv, installs semcomm, runs `semcomm quickstart` "
                  "(offline, CPU)"):
        "the set-up commands themselves: make test runs this suite",
    ("README.md", "semcomm serve --port 8000              # OpenAI-compatible gateway, "
                  "embedded default, offline"):
        "starts a server that runs until stopped (tests/test_server_*.py exercise it)",
    ("docs/SECURITY.md", "semcomm security probe --json probe.json          # the timing "
                         "attack, defenses off vs on (< 60 s)"):
        "a minute-long attack against a live server (tests/test_security_probe.py)",
    ("docs/engine.md", "from semcomm import HFEngine"):
        "a sketch: SYSTEM and q stand for the caller's prompt (README.md's example runs)",
    ("docs/engine.md", 'HFEngine(model, tokenizer=None, store=None, chunk_size=256, '
                       'codec="lossless",'):
        "a signature, not a call",
    ("docs/fusion.md", "from semcomm.fusion import FusionPipeline, ModelSide, load_fuser, "
                       "model_spec"):
        "a sketch over the caller's own sharer and receiver models",
    ("docs/fusion.md", "from semcomm.fusion import FusionPipeline, load_fuser, "
                       "shipped_pair_fuser_path"):
        "loads both real models and the fuser (GBs, minutes of CPU); "
        "tests/test_server_c2c_real.py covers the pair",
    ("docs/kv.md", "from semcomm.kv import MemoryStore, DiskStore, RedisStore, TieredStore"):
        "needs a Redis server at redis://cache:6379",
    ("docs/models.md", "semcomm models list [--json]               # the catalog, and which "
                       "models are pulled here"):
        "a synopsis: NAME and [options] are placeholders (README.md runs the concrete commands)",
    ("docs/models.md", "from transformers import AutoModelForCausalLM, AutoTokenizer"):
        "the path is a shell substitution inside a string",
    ("docs/rag.md", "from semcomm import HFEngine"):
        "a sketch: corpus, d1, d3 and q stand for the caller's documents and question "
        "(tests/test_engine_documents.py runs the same calls)",
    ("docs/routing.md", "from semcomm.routing import ReplicaRouter"):
        "a sketch: engine, stores, token_ids and send_to stand for the caller's",
    ("docs/routing.md", "semcomm route simulate --trace mooncake_trace.jsonl --replicas 8 "
                        "--policy default --rate-scale 2 --json out.json"):
        "needs a Mooncake-format trace file (tests/test_routing_cli.py runs the command)",
    ("docs/routing.md", "from semcomm.routing import ModelRouter, ModelSpec"):
        "a sketch: prompts, correct and messages stand for the caller's labelled data",
    ("docs/routing.md", "semcomm route train --out router.json [--data labels.jsonl] "
                        "[--cost sharer=2 --cost receiver=1] [--budget 0.5]"):
        "a synopsis with [options] (tests/test_routing_cli.py runs the commands)",
    ("docs/routing.md", "from ray import serve"):
        "needs a Ray Serve cluster (tests/test_routing_ray.py)",
    ("docs/semantic.md", "SemanticCache(embedder=None, path=None, store=None, policy=None, "
                         "*, threshold=None,"):
        "a signature, not a call",
    ("docs/semantic.md", "from langchain_core.globals import set_llm_cache"):
        "needs an OpenAI model and key for the LlamaIndex half "
        "(tests/test_integrations_langchain.py, _llamaindex.py)",
    ("docs/server.md", "semcomm serve --port 8000                     # embedded default, "
                       "offline, no services"):
        "starts a server that runs until stopped (tests/test_server_*.py exercise it)",
    ("docs/server.md", "from openai import OpenAI"):
        "needs the server above running (tests/test_integrations_openai.py)",
    ("docs/vllm.md", "from vllm import LLM, SamplingParams"):
        "needs vLLM, which lives in its own venv (make vllm-check, make vllm-test)",
}


@dataclass(frozen=True, slots=True)
class Block:
    page: str  # path relative to the repository root
    line: int  # line of the opening fence
    kind: str  # "python" or "shell"
    code: str
    why_not: str | None  # the reason it is not run, or None

    @property
    def first(self) -> str:
        return next(ln for ln in self.code.splitlines() if ln.strip())


def blocks(page: Path) -> list[Block]:
    rel = page.relative_to(ROOT).as_posix()
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(2)
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in RUN_LANGS or not any(b.strip() for b in body):
            continue
        mark = NOT_RUN_MARK.search(lines[start - 1]) if start else None
        b = Block(rel, start + 1, RUN_LANGS[lang], "\n".join(body) + "\n", None)
        why = mark.group(1) if mark else NOT_RUN.get((rel, b.first.rstrip()))
        out.append(Block(b.page, b.line, b.kind, b.code, why))
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def _runnable_python() -> dict[str, list[Block]]:
    seen: set[str] = set()
    per_page: dict[str, list[Block]] = {}
    for b in ALL:
        if b.kind == "python" and b.why_not is None and b.code not in seen:
            seen.add(b.code)
            per_page.setdefault(b.page, []).append(b)
    return per_page


PYTHON = _runnable_python()
SHELL = [b for b in ALL if b.kind == "shell" and b.why_not is None]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("TRANSFORMERS_OFFLINE", "1")
    return e


def test_site_builds_strict(tmp_path: Path, env: dict[str, str]) -> None:
    """``make docs`` in CI: broken links, anchors and API references fail the build."""
    env["NO_MKDOCS_2_WARNING"] = "1"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_skip_has_a_reason_and_a_block() -> None:
    """Every example that is not run says why, and no entry of NOT_RUN names a block that is
    gone (so an edited example is run or marked again)."""
    assert all(b.why_not.strip() for b in ALL if b.why_not is not None)
    present = {(b.page, b.first.rstrip()) for b in ALL}
    stale = [k for k in NOT_RUN if k not in present]
    assert not stale, f"NOT_RUN names blocks that no longer exist: {stale}"


@pytest.mark.parametrize("page", sorted(PYTHON), ids=str)
def test_python_examples_run(page: str, tmp_path: Path, env: dict[str, str]) -> None:
    script = "\n".join(f"# {b.page}:{b.line}\n{b.code}" for b in PYTHON[page])
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{page}: an example failed\n{r.stdout}\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("block", SHELL, ids=lambda b: f"{b.page}:{b.line}")
def test_shell_examples_run(block: Block, tmp_path: Path, env: dict[str, str]) -> None:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{block.page}:{block.line} failed\n{r.stdout}\n{r.stderr[-4000:]}"


def test_every_page_is_in_the_nav() -> None:
    """A new page under docs/ appears in the site's navigation (mkdocs.yml), not only by URL."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    missing = [p for p in pages if f" {p}" not in nav and f"- {p}" not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"
