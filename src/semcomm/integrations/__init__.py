"""semcomm.integrations: adapters for frameworks, without monkey-patching.

- :mod:`semcomm.integrations.langchain`: ``SemcommCache`` (a LangChain ``BaseCache``);
- :mod:`semcomm.integrations.llamaindex`: ``SemcommLLM`` (wraps a LlamaIndex ``LLM``);
- :mod:`semcomm.integrations.openai`: ``CachedOpenAI`` / ``CachedAsyncOpenAI`` (wrap an
  ``openai`` client's chat completions);
- :mod:`semcomm.integrations.ray_serve`: Ray Serve deployment.

Submodules import their framework lazily; import the one you need.
"""

__all__: list[str] = []
