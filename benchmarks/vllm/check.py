"""vLLM with semcomm's KV connector: a second process loads what the first one saved.

Runs in the vLLM environment (``.venv-vllm``, see docs/vllm.md); ``make vllm-check`` runs it.
Each phase is a fresh process (``--phase save`` / ``--phase load`` re-run this file), so the
load really comes from the store, never from memory:

* ``save``: vLLM with the connector on an empty store. A warm-up request, then the 2k-token
  prompt (cold TTFT: nothing cached anywhere; its greedy text is the reference), the same prompt
  again (vLLM's own prefix cache: APC TTFT), a second prompt (``--also``: the restarted-Redis
  check) and a tenant's prompt (``cache_salt="acme"``). Waits until the chunks are stored.
* ``load``: a fresh vLLM on the same store. A warm-up request, then the 2k-token prompt (warm
  TTFT: its prefix loaded through semcomm; greedy text compared with the reference), the
  tenant's prompt as another tenant (must not load) and as the tenant (must load). With
  ``--restart-redis`` also: Redis restarted empty, the second prompt (a miss, not an error),
  then Redis stopped, a third prompt (computed normally).

Writes ``--out`` (default ``vllm_check.json`` at the repository root):
``{"cold_ttft_s", "warm_ttft_s", "apc_ttft_s", "same_text", "hit_tokens", ...}`` plus the
ratios and the isolation and outage checks, a table, and ``--png``.

    python -m benchmarks.vllm.check --model DIR --store disk:/tmp/kv      # two processes
    python -m benchmarks.vllm.check --model DIR --redis                    # a private redis
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_HOST_IP": "127.0.0.1",
       "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       # each process compiles for itself: a compiled artifact reused from vLLM's on-disk cache
       # by the second process produced wrong logits here (its own cold requests differed too)
       "VLLM_DISABLE_COMPILE_CACHE": "1"}

_TOPICS = ["river", "harbour", "library", "orchard", "observatory", "railway", "market",
           "glacier", "workshop", "lighthouse", "vineyard", "monastery"]


def long_text(seed: int) -> str:
    """A deterministic document of plain sentences (about 12 tokens each)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(400):
        a, b = rng.sample(_TOPICS, 2)
        out.append(f"Note {i}: the {a} near the {b} was visited on day {rng.randint(1, 365)} "
                   f"by {rng.randint(2, 90)} people.")
    return " ".join(out)


def prompt_ids(tok: Any, seed: int, n: int) -> list[int]:
    question = tok.encode("\n\nQuestion: which place was visited most often? Answer:",
                          add_special_tokens=False)
    body = tok.encode(long_text(seed), add_special_tokens=False)
    return body[: n - len(question)] + question


def make_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {"store": args.store}
    if args.chunk_size:
        extra["chunk_size"] = args.chunk_size
    kw: dict[str, Any] = {"block_size": args.block_size} if args.block_size else {}
    return LLM(
        model=args.model, dtype=args.dtype, max_model_len=4096, enable_prefix_caching=True,
        disable_log_stats=False, seed=0, **kw,
        kv_transfer_config=KVTransferConfig(
            kv_connector="SemcommConnector",
            kv_connector_module_path="semcomm.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )


def run(llm: Any, ids: list[int], *, max_tokens: int, salt: str | None = None) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    log = os.environ.get("SEMCOMM_VLLM_TIMINGS")
    seen = Path(log).stat().st_size if log and Path(log).exists() else 0
    t0 = time.perf_counter()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    m = out.metrics
    ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
    res = {"ttft_s": float(ttft) if ttft else wall, "wall_s": wall,
           "text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids),
           "cached_tokens": int(out.num_cached_tokens or 0)}
    if log and m is not None and getattr(m, "first_token_ts", 0.0):
        with open(log, encoding="utf-8") as f:
            f.seek(seen)
            events = [json.loads(line) for line in f if line.strip()]
        res["timeline"] = timeline(m, events)
    return res


def timeline(m: Any, events: list[dict[str, Any]]) -> dict[str, float]:
    """Where a request's time to first token went, in ms from vLLM's ``queued_ts`` (engine
    core, ``time.monotonic()``), from the connector's ``SEMCOMM_VLLM_TIMINGS`` lines of the
    request's prefill step: the store lookup, the load, the forward's end, the first token."""
    q, first = float(m.queued_ts), float(m.first_token_ts)

    def ms(t: float) -> float:
        return round((t - q) * 1e3, 2)

    out: dict[str, float] = {"scheduled": ms(float(m.scheduled_ts)), "first_token": ms(first)}
    step = [e for e in events if q - 0.5 <= e["at"] <= first]
    before: dict[str, Any] | None = None  # the worker's record that starts the forward
    for e in step:
        if e["event"] == "lookup" and "lookup_ms" not in out:
            out["lookup_at"], out["lookup_ms"] = ms(e["at"]), e["ms"]
        elif e["event"] == "step_start" and e.get("loads") and "load_ms" not in out:
            before = e
        elif e["event"] == "load" and "load_ms" not in out:
            out["load_at"], out["load_ms"] = ms(e["at"]), e["ms"]
            out["load_chunks"] = e.get("chunks", 0)
            for part in ("read_ms", "write_ms", "read_minflt", "write_minflt"):
                if part in e:
                    out[f"load_{part}"] = e[part]
            before = e
        elif e["event"] == "layers" and "layer_copy_ms" not in out:
            # a layer-by-layer load: the copy thread's time, and the forward's waits for it
            out["layer_copy_ms"], out["layer_wait_ms"] = e["ms"], e.get("waited_ms", 0.0)
            out["layers_by_forward"] = e.get("stolen", 0)  # copied by the forward's thread
            if "verify_ms" in e:  # streamed reads: the rest read and every chunk verified
                out["layer_verify_ms"] = e["verify_ms"]
        elif e["event"] == "step_start" and before is None:
            before = e  # no load: the forward starts here
        elif e["event"] == "forward_end":
            out["forward_end"] = ms(e["at"])  # the last before the first token: the prefill
            if before is not None and "minflt" in e and before.get("pid") == e.get("pid"):
                # page faults of the process from the load's end (or the step's start) to
                # the forward's end (the last forward before the first token)
                out["forward_minflt"] = e["minflt"] - before.get("minflt", 0)
                out["forward_majflt"] = e["majflt"] - before.get("majflt", 0)
            before = None
    if "forward_end" in out:
        start = out.get("load_at", 0.0) + out.get("load_ms", 0.0) if "load_at" in out else \
            out["scheduled"]
        out["forward_ms"] = round(out["forward_end"] - start, 2)
    return out


def page_cache_residency(store: str) -> list[list[float]] | None:
    """For every chunk file of a disk store: ``[seconds since it was written, fraction of its
    pages in the page cache]`` (``mincore`` on a mapping of the file: nothing is read),
    oldest first. None for another store or where ``mincore`` is missing."""
    import ctypes
    import mmap

    import numpy as np

    if not store.startswith("disk:"):
        return None
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    out = []
    now = time.time()
    for f in Path(store[5:]).expanduser().glob("??/*.sckv"):
        size = f.stat().st_size
        if not size:
            continue
        n = -(-size // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(n)
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            ok = mincore(view.ctypes.data, size, vec) == 0
            del view
        if not ok:
            return None
        resident = sum(b & 1 for b in vec.raw)
        out.append([round(now - f.stat().st_mtime, 1), round(resident / n, 3)])
    return sorted(out, reverse=True)


def chunk_files(store: str) -> set[str]:
    """The chunk files of a disk store (none for another store)."""
    if not store.startswith("disk:"):
        return set()
    return {str(f) for f in Path(store[5:]).expanduser().glob("??/*.sckv")}


def wait_for_chunks(store: str, want: int, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while stored_chunks(store) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return stored_chunks(store)


def middle_chunk(files: set[str], chunk_tokens: int, n: int) -> str | None:
    """Of one prompt's chunk files, the one starting at token ``(n // 2) * chunk_tokens``."""
    from semcomm.kv import read_header

    want = (n // 2) * chunk_tokens
    for f in sorted(files):
        try:
            if read_header(Path(f).read_bytes()).start == want:
                return f
        except Exception:  # gone, or not a chunk: not the one
            continue
    return None


def flip_payload_byte(path: str) -> None:
    """Flip one bit in the middle of a chunk file, in place (its header still parses)."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x10]))


def stored_chunks(store: str) -> int:
    if store.startswith("disk:"):
        root = Path(store[5:]).expanduser()
        return len(list(root.glob("??/*.sckv")))
    import redis

    r = redis.Redis.from_url(store)
    return sum(1 for _ in r.scan_iter(match="semcomm:kv:*", count=1000)
               if b"~" not in _)


def phase(args: argparse.Namespace) -> dict[str, Any]:
    llm = make_llm(args)
    tok = llm.get_tokenizer()
    main_ids = prompt_ids(tok, 1, args.tokens)
    also_ids = prompt_ids(tok, 2, args.tokens)
    third_ids = prompt_ids(tok, 3, args.tokens)
    tenant_ids = prompt_ids(tok, 4, args.tokens)
    out: dict[str, Any] = {"phase": args.phase, "prompt_tokens": len(main_ids),
                           "first_chunk_ids": main_ids[: args.chunk_tokens]}
    run(llm, tok.encode("Hello, how are you?"), max_tokens=4)  # warm-up (kernels, allocator)
    if args.phase == "save":
        out["cold"] = run(llm, main_ids, max_tokens=args.max_tokens)
        out["cold_done_wall"] = time.time()  # the main prompt's chunks are written about now
        out["apc"] = run(llm, main_ids, max_tokens=args.max_tokens)
        # more hits of vLLM's own cache, for a median beside the first one
        out["apc_repeats"] = [run(llm, main_ids, max_tokens=2) for _ in range(args.repeats - 1)]
        per = len(main_ids) // args.chunk_tokens
        wait_for_chunks(args.store, per)  # the main prompt's chunks, then the second's
        before = chunk_files(args.store)
        out["also_cold"] = run(llm, also_ids, max_tokens=args.max_tokens)
        wait_for_chunks(args.store, 2 * per)
        # the second prompt's middle chunk: --tamper damages it before the load phase
        out["also_middle_chunk"] = middle_chunk(chunk_files(args.store) - before,
                                                args.chunk_tokens, per)
        out["third_cold"] = run(llm, third_ids, max_tokens=args.max_tokens)
        out["tenant_cold"] = run(llm, tenant_ids, max_tokens=args.max_tokens, salt="acme")
        out["tenant_apc"] = run(llm, tenant_ids, max_tokens=args.max_tokens, salt="acme")
        want = 4 * ((len(main_ids)) // args.chunk_tokens)
        deadline = time.monotonic() + 120
        while stored_chunks(args.store) < want and time.monotonic() < deadline:
            time.sleep(0.2)
        out["stored_chunks"] = stored_chunks(args.store)
    else:
        out["residency_before_warm"] = page_cache_residency(args.store)
        out["warm_start_wall"] = time.time()
        out["warm"] = run(llm, main_ids, max_tokens=args.max_tokens)
        # more loads through semcomm in this process: vLLM's own cache emptied before each,
        # so the prefix comes from the store again (for a median beside the first load)
        out["warm_repeats"] = []
        for _ in range(args.repeats - 1):
            llm.reset_prefix_cache()
            out["warm_repeats"].append(run(llm, main_ids, max_tokens=2))
        # a control: vLLM's own cache hits in this (second) process, right after the loads
        out["apc_local"] = [run(llm, main_ids, max_tokens=2) for _ in range(args.repeats)]
        out["other_tenant"] = run(llm, tenant_ids, max_tokens=args.max_tokens, salt="globex")
        out["tenant"] = run(llm, tenant_ids, max_tokens=args.max_tokens, salt="acme")
        if args.tamper:  # its middle chunk was damaged after it was stored: recomputed
            out["tampered"] = run(llm, also_ids, max_tokens=args.max_tokens)
        if args.restart_redis:
            _signal_parent("restart")
            out["after_restart"] = run(llm, also_ids, max_tokens=args.max_tokens)
            _signal_parent("stop")
            out["redis_down"] = run(llm, third_ids, max_tokens=args.max_tokens)
    return out


def _signal_parent(what: str) -> None:
    """Ask the parent (which owns the private redis-server) to restart or stop it; wait."""
    print(f"@@{what}", flush=True)
    reply = sys.stdin.readline().strip()
    assert reply == "ok", reply


class PrivateRedis:
    def __init__(self) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise SystemExit("redis-server not found (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="semcomm-vllm-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(self.exe), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def child(args: argparse.Namespace, which: str, redis: PrivateRedis | None) -> dict[str, Any]:
    cmd = [args.vllm_python, "-m", "benchmarks.vllm.check", "--phase", which, "--model", args.model, "--store",
           args.store, "--tokens", str(args.tokens), "--max-tokens", str(args.max_tokens),
           "--dtype", args.dtype, "--chunk-tokens", str(args.chunk_tokens),
           "--repeats", str(args.repeats)]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    if which == "load" and redis is not None:
        cmd.append("--restart-redis")
    if which == "load" and args.tamper:
        cmd.append("--tamper")
    timings = tempfile.NamedTemporaryFile(prefix=f"semcomm-vllm-{which}-", suffix=".jsonl",
                                          delete=False)
    timings.close()
    env = {**os.environ, **ENV, "SEMCOMM_VLLM_TIMINGS": timings.name}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT))
    assert proc.stdin is not None and proc.stdout is not None
    result: dict[str, Any] | None = None
    for line in proc.stdout:
        if line.startswith("@@restart") and redis is not None:
            redis.stop()
            redis.start()
            proc.stdin.write("ok\n")
            proc.stdin.flush()
        elif line.startswith("@@stop") and redis is not None:
            redis.stop()
            proc.stdin.write("ok\n")
            proc.stdin.flush()
        elif line.startswith("@@result "):
            result = json.loads(line[len("@@result "):])
        elif not args.quiet:
            sys.stderr.write(line)
    rc = proc.wait()
    os.unlink(timings.name)
    if rc != 0 or result is None:
        raise SystemExit(f"vLLM {which} phase failed (exit {rc})")
    result["process_s"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    ap.add_argument("--store", default=None, help="connector store (default: a fresh disk dir)")
    ap.add_argument("--redis", action="store_true", help="store in a private redis-server, "
                    "restarted and stopped during the load phase")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=24, help="greedy tokens compared")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-size", type=int, default=None, help="connector chunk size")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM's KV block size (default: vLLM's, 128 on the CPU build; a "
                         "multiple of 32 there); vLLM computes at least the prompt's last block")
    ap.add_argument("--repeats", type=int, default=5,
                    help="TTFT samples of vLLM's own cache hit and of the load through semcomm "
                         "(the first is the contract's figure; the median of all is reported "
                         "beside it)")
    ap.add_argument("--chunk-tokens", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=["save", "load"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--restart-redis", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tamper", action="store_true",
                    help="disk store: flip a byte in the middle of the second prompt's middle "
                         "chunk before the load phase, which then runs that prompt (a chunk "
                         "that fails verification: recomputed, the same greedy text)")
    ap.add_argument("--vllm-python", default=sys.executable,
                    help="python of the environment with vLLM (default: this one)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_check.json"))
    ap.add_argument("--png", default=None)
    ap.add_argument("--quiet", action="store_true", help="do not echo vLLM's output")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: a 256-token prompt, 4 greedy tokens, one sample each")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.max_tokens, args.repeats = 256, 4, 1
    if args.phase is not None:
        os.environ.update(ENV)
        res = phase(args)
        print("@@result " + json.dumps(res), flush=True)
        return 0
    if args.model is None:
        raise SystemExit("--model DIR is required (make vllm-check passes SmolLM2-135M's)")
    # the connector's default chunk is one vLLM block (128 tokens on the CPU build)
    args.chunk_tokens = args.chunk_size or args.block_size or 128
    redis = PrivateRedis() if args.redis else None
    tmp = None
    if redis is not None:
        args.store = redis.url
    elif args.store is None:
        tmp = tempfile.mkdtemp(prefix="semcomm-vllm-kv-")
        args.store = f"disk:{tmp}"
    layout_dir = Path(args.store[5:]) if args.store.startswith("disk:") else None
    try:
        saved = child(args, "save", redis)
        tampered = saved.get("also_middle_chunk") if args.tamper else None
        if args.tamper:
            if not tampered:
                raise SystemExit("--tamper needs a disk store whose chunks the save phase saw")
            flip_payload_byte(tampered)
        loaded = child(args, "load", redis)
        if tampered:
            loaded["tampered_file_left"] = Path(tampered).exists()
        report = summarize(args, saved, loaded)
        if layout_dir is not None:
            report["layout_vs_transformers"] = layout_check(args, layout_dir,
                                                            saved["first_chunk_ids"])
    finally:
        if redis is not None:
            redis.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    if args.png:
        draw(report, Path(args.png))
    print(f"wrote {args.out}")
    return 0


def summarize(args: argparse.Namespace, saved: dict[str, Any], loaded: dict[str, Any]
              ) -> dict[str, Any]:
    cold, apc, warm = saved["cold"], saved["apc"], loaded["warm"]
    apc_s = [apc["ttft_s"]] + [r["ttft_s"] for r in saved.get("apc_repeats", [])]
    warm_s = [warm["ttft_s"]] + [r["ttft_s"] for r in loaded.get("warm_repeats", [])]
    rep: dict[str, Any] = {
        "cold_ttft_s": cold["ttft_s"], "warm_ttft_s": warm["ttft_s"], "apc_ttft_s": apc["ttft_s"],
        "same_text": warm["token_ids"] == cold["token_ids"], "hit_tokens": warm["cached_tokens"],
        "store": "redis" if args.redis else "disk", "model": args.model, "dtype": args.dtype,
        # the connector's load settings as the environment gave them (unset: the defaults)
        "connector_env": {k: os.environ[k] for k in ("SEMCOMM_VLLM_LAYERWISE_LOAD",
                                                      "SEMCOMM_VLLM_STREAMED_READS")
                          if k in os.environ},
        "prompt_tokens": saved["prompt_tokens"], "greedy_tokens": args.max_tokens,
        "cold_over_warm": cold["ttft_s"] / warm["ttft_s"],
        "warm_over_apc": warm["ttft_s"] / apc["ttft_s"],
        # every sample of each side (the first is the one above) and their medians
        "apc_ttft_samples_s": apc_s, "warm_ttft_samples_s": warm_s,
        "apc_ttft_median_s": statistics.median(apc_s),
        "warm_ttft_median_s": statistics.median(warm_s),
        "warm_over_apc_median": statistics.median(warm_s) / statistics.median(apc_s),
        "warm_repeats_hit_tokens": [r["cached_tokens"] for r in loaded.get("warm_repeats", [])],
        # where the time went (ms from vLLM's queued_ts; benchmarks.vllm.check.timeline): each sample
        "apc_timelines": [r.get("timeline") for r in [apc, *saved.get("apc_repeats", [])]],
        "warm_timelines": [r.get("timeline") for r in [warm, *loaded.get("warm_repeats", [])]],
        # vLLM's own cache hits in the second process (a control: the same process as the
        # loads, so between-process differences cancel)
        "apc_local_ttft_samples_s": [r["ttft_s"] for r in loaded.get("apc_local", [])],
        "apc_local_timelines": [r.get("timeline") for r in loaded.get("apc_local", [])],
        # the first tokens of every repeat equal the cold run's (greedy)
        "repeats_same_first_tokens": all(
            r["token_ids"] == cold["token_ids"][: len(r["token_ids"])]
            for r in saved.get("apc_repeats", []) + loaded.get("warm_repeats", [])),
        "apc_same_text": apc["token_ids"] == cold["token_ids"],
        "stored_chunks": saved.get("stored_chunks"),
        "tenant": {
            "other_tenant_hit_tokens": loaded["other_tenant"]["cached_tokens"],
            "tenant_hit_tokens": loaded["tenant"]["cached_tokens"],
            # the tenant's prompt through semcomm, through vLLM's own prefix cache (same
            # process as the cold run) and cold in the second process, against its cold text
            "same_text": loaded["tenant"]["token_ids"] == saved["tenant_cold"]["token_ids"],
            "apc_same_text": saved["tenant_apc"]["token_ids"] == saved["tenant_cold"]["token_ids"],
            "same_as_apc": loaded["tenant"]["token_ids"] == saved["tenant_apc"]["token_ids"],
            "other_process_cold_same_text": (loaded["other_tenant"]["token_ids"]
                                             == saved["tenant_cold"]["token_ids"]),
        },
        "process_s": {"save": saved["process_s"], "load": loaded["process_s"]},
        # seconds from the cold run that wrote the main prompt's chunks to the second
        # process's first request for them (how long their bytes lay untouched)
        # each chunk file's age (s) and the fraction of it in the page cache, just before
        # that request (disk store; oldest first)
        "page_cache_before_warm": loaded.get("residency_before_warm"),
        "warm_chunk_age_s": (loaded["warm_start_wall"] - saved["cold_done_wall"]
                             if "warm_start_wall" in loaded and "cold_done_wall" in saved
                             else None),
        "text": {"cold": cold["text"], "warm": warm["text"],
                 "tenant_cold": saved["tenant_cold"]["text"],
                 "tenant_apc": saved["tenant_apc"]["text"],
                 "other_tenant": loaded["other_tenant"]["text"],
                 "tenant": loaded["tenant"]["text"]},
    }
    if rep["apc_local_ttft_samples_s"]:
        rep["apc_local_ttft_median_s"] = statistics.median(rep["apc_local_ttft_samples_s"])
        rep["warm_over_apc_local_median"] = (statistics.median(warm_s)
                                             / rep["apc_local_ttft_median_s"])
    rep["timeline_medians_ms"] = {
        side: {key: statistics.median(t[key] for t in tls if t and key in t)
               for key in ("scheduled", "lookup_ms", "load_ms", "load_read_ms",
                           "load_write_ms", "load_read_minflt", "load_write_minflt",
                           "layer_copy_ms", "layer_wait_ms", "layer_verify_ms",
                           "layers_by_forward", "forward_ms",
                           "forward_minflt",
                           "forward_majflt", "first_token")
               if any(t and key in t for t in tls)}
        for side, tls in (("apc", rep["apc_timelines"]), ("warm", rep["warm_timelines"]),
                          ("apc_local", rep["apc_local_timelines"]))}
    if "tampered" in loaded:
        rep["tampered"] = {
            "hit_tokens": loaded["tampered"]["cached_tokens"],
            "same_text": loaded["tampered"]["token_ids"] == saved["also_cold"]["token_ids"],
            "file_dropped": not loaded.get("tampered_file_left", True),
        }
    if "after_restart" in loaded:
        rep["redis_restart"] = {
            "hit_tokens": loaded["after_restart"]["cached_tokens"],
            "same_text": loaded["after_restart"]["token_ids"] == saved["also_cold"]["token_ids"],
        }
        rep["redis_down"] = {
            "hit_tokens": loaded["redis_down"]["cached_tokens"],
            "same_text": loaded["redis_down"]["token_ids"] == saved["third_cold"]["token_ids"],
        }
    return rep


def layout_check(args: argparse.Namespace, store_dir: Path, ids: list[int]) -> dict[str, Any]:
    """vLLM's stored first chunk against transformers' KV cache for the same tokens.

    Runs in this (the orchestrating) environment, which has semcomm's transformers; skipped
    when it has none. Among the stored first chunks (one per prompt) the one whose values match
    best is the main prompt's; reports the worst layer's cosine and relative error.
    """
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from semcomm.kv import decode_chunk, get_codec
    except ImportError as exc:
        return {"skipped": str(exc)}
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    hk = torch.stack([cache.layers[i].keys[0] for i in range(len(cache.layers))]).float()
    hv = torch.stack([cache.layers[i].values[0] for i in range(len(cache.layers))]).float()
    codec = get_codec("lossless")

    def cos(a: Any, b: Any) -> float:
        return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))

    best: dict[str, Any] | None = None
    for f in store_dir.glob("??/*.sckv"):
        c = decode_chunk(f.read_bytes())
        if c.header.start != 0 or c.header.num_tokens != len(ids):
            continue
        k, v = (t.float() for t in codec.decode(c.arrays, num_tokens=len(ids),
                                                 dtype=args.dtype))
        score = cos(v[0], hv[0])
        if best is None or score > best["score"]:
            best = {"score": score, "k": k, "v": v}
    if best is None:
        return {"skipped": "no first chunk found"}
    k, v = best["k"], best["v"]
    return {
        "tokens": len(ids),
        "k_cos_min": min(cos(k[i], hk[i]) for i in range(len(hk))),
        "v_cos_min": min(cos(v[i], hv[i]) for i in range(len(hv))),
        "k_rel_err_max": max(float((k[i] - hk[i]).norm() / hk[i].norm()) for i in range(len(hk))),
        "v_rel_err_max": max(float((v[i] - hv[i]).norm() / hv[i].norm()) for i in range(len(hv))),
    }


def print_table(rep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"vLLM + semcomm connector, {rep['prompt_tokens']}-token prompt, "
                    f"{rep['store']} store (one run)")
    for col in ("measure", "value"):
        t.add_column(col)
    rows = [
        ("cold TTFT (s)", f"{rep['cold_ttft_s']:.3f}"),
        ("vLLM prefix cache (APC) TTFT (s)", f"{rep['apc_ttft_s']:.3f}"),
        ("second process via semcomm TTFT (s)", f"{rep['warm_ttft_s']:.3f}"),
        ("cold / semcomm", f"{rep['cold_over_warm']:.1f}x"),
        ("semcomm / APC", f"{rep['warm_over_apc']:.2f}x"),
        (f"medians of {len(rep['apc_ttft_samples_s'])}: APC / semcomm TTFT (s)",
         f"{rep['apc_ttft_median_s']:.3f} / {rep['warm_ttft_median_s']:.3f}"),
        ("semcomm / APC, medians", f"{rep['warm_over_apc_median']:.2f}x"),
        ("semcomm / APC in the second process, medians",
         f"{rep.get('warm_over_apc_local_median', float('nan')):.2f}x"),
        *[(f"{side}: ms from queued (medians)", ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
          for side, t in rep["timeline_medians_ms"].items()],
        ("tokens loaded", str(rep["hit_tokens"])),
        ("greedy text identical to cold", str(rep["same_text"])),
        ("other tenant: tokens loaded", str(rep["tenant"]["other_tenant_hit_tokens"])),
        ("tenant: tokens loaded", str(rep["tenant"]["tenant_hit_tokens"])),
    ]
    if "tampered" in rep:
        rows.append(("tampered chunk: tokens counted / same text / file dropped",
                     f"{rep['tampered']['hit_tokens']} / {rep['tampered']['same_text']} / "
                     f"{rep['tampered']['file_dropped']}"))
    if "redis_restart" in rep:
        rows += [("after Redis restart: tokens loaded / same text",
                  f"{rep['redis_restart']['hit_tokens']} / {rep['redis_restart']['same_text']}"),
                 ("Redis down: tokens loaded / same text",
                  f"{rep['redis_down']['hit_tokens']} / {rep['redis_down']['same_text']}")]
    lay = rep.get("layout_vs_transformers", {})
    if "k_cos_min" in lay:
        rows.append(("stored chunk vs transformers: min cosine K / V",
                     f"{lay['k_cos_min']:.5f} / {lay['v_cos_min']:.5f}"))
    for r in rows:
        t.add_row(*r)
    Console(width=120).print(t)


def draw(rep: dict[str, Any], path: Path) -> None:
    from benchmarks.common import agg_figure

    with agg_figure(path, (6, 3.4)) as ax:
        names = ["cold", "vLLM prefix cache", "semcomm (2nd process)"]
        vals = [rep["cold_ttft_s"], rep["apc_ttft_s"], rep["warm_ttft_s"]]
        ax.bar(names, vals, color=["#999999", "#4c72b0", "#dd8452"])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}s", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{rep['prompt_tokens']}-token prompt, {rep['store']} store")


if __name__ == "__main__":
    raise SystemExit(main())
