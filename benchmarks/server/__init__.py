"""The gateway: overhead against LiteLLM, batching, agent chains, the memory plan, security costs."""
