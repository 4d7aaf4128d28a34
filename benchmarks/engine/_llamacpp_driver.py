"""One llama.cpp run for benchmarks.engine.decode, in the ``llama-cpp-python`` venv (not semcomm's).

Reads a job JSON ``{gguf, ids, threads, new_tokens}``; prints one JSON line: load time, cold TTFT
(prompt evaluation + the first greedy token), decode tokens/s (tokens after the first) and the
greedy tokens. Greedy: top_k=1, temperature 0; EOS is not special here (``generate`` does not
stop on it), so exactly ``new_tokens`` tokens are decoded.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=job["gguf"], n_ctx=len(job["ids"]) + job["new_tokens"] + 16,
                n_threads=job["threads"], n_threads_batch=job["threads"], n_batch=512,
                verbose=False)
    load_s = time.perf_counter() - t0
    times: list[float] = []
    tokens: list[int] = []
    t1 = time.perf_counter()
    for tok in llm.generate(job["ids"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        times.append(time.perf_counter())
        tokens.append(int(tok))
        if len(tokens) >= job["new_tokens"]:
            break
    tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    print(json.dumps({"load_s": load_s, "cold_ttft_s": times[0] - t1, "decode_tps": tps,
                      "tokens": tokens, "threads": job["threads"]}))


if __name__ == "__main__":
    main()
