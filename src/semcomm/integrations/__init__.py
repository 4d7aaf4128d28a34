"""semcomm.integrations: adapters for frameworks, without monkey-patching.

- :mod:`semcomm.integrations.langchain`: ``SemcommCache`` (a LangChain ``BaseCache``) and
  ``documents_prompt`` (a retriever's documents sent to the gateway as documents);
- :mod:`semcomm.integrations.llamaindex`: ``SemcommLLM`` (wraps a LlamaIndex ``LLM``),
  ``SemcommGateway`` (an ``LLM`` for the gateway) and ``DocumentsSynthesizer`` (retrieved nodes
  sent as documents);
- :mod:`semcomm.integrations.openai`: ``CachedOpenAI`` / ``CachedAsyncOpenAI`` (wrap an
  ``openai`` client's chat completions);
- :mod:`semcomm.integrations.ray_serve`: Ray Serve deployment.

Submodules import their framework lazily; import the one you need.
"""

__all__: list[str] = []
