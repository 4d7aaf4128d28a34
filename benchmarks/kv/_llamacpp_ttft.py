"""llama.cpp's prompt cache, for bench_real_models.py, run in the ``llama-cpp-python`` venv.

``python _llamacpp_ttft.py save JOB.json``: loads the GGUF, measures the cold TTFT of the prompt
(prompt evaluation + the first greedy token), the warm TTFT in the same process (the same prompt
again: llama.cpp keeps the matching prefix of its context and evaluates only the last token),
then writes its state (KV cache and all) to ``job["state"]``.

``python _llamacpp_ttft.py load JOB.json``: a new process (a restart) loads the GGUF and that
state file and measures the TTFT of the same prompt from it.

Each prints one JSON line. Greedy: top_k=1, temperature 0.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from typing import Any


def _first_token_s(llm: Any, ids: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    # reset=True: llama.cpp keeps the longest prefix its context shares with ``ids``
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        return time.perf_counter() - t, int(tok)
    raise RuntimeError("llama.cpp produced no token")


def main() -> None:
    mode, job_path = sys.argv[1], sys.argv[2]
    job = json.loads(open(job_path).read())
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=job["gguf"], n_ctx=len(job["ids"]) + 32, n_threads=job["threads"],
                n_threads_batch=job["threads"], n_batch=512, verbose=False)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "threads": job["threads"]}
    ids = job["ids"]
    if mode == "save":
        out["cold_ttft_s"], out["first_token"] = _first_token_s(llm, ids)
        warm = [_first_token_s(llm, ids) for _ in range(3)]
        out["warm_ttft_s"] = min(w[0] for w in warm)
        out["warm_first_token"] = warm[0][1]
        t = time.perf_counter()
        state = llm.save_state()
        with open(job["state"], "wb") as fh:
            pickle.dump(state, fh)
        out["save_s"] = time.perf_counter() - t
    else:
        t = time.perf_counter()
        with open(job["state"], "rb") as fh:
            llm.load_state(pickle.load(fh))
        load_state_s = time.perf_counter() - t
        ttft, tok = _first_token_s(llm, ids)
        out["restart_ttft_s"] = load_state_s + ttft  # reading the state is part of the hit
        out["state_load_s"] = load_state_s
        out["first_token"] = tok
    print(json.dumps(out))


if __name__ == "__main__":
    main()
