"""KV prefix reuse: TTFT warm against cold, the stores against LMCache, codecs, real models against llama.cpp."""
