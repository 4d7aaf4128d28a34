"""Agents sharing text: cross-context KV reuse in multi-agent pipelines (docs/agents.md)."""
