"""The semantic answer cache: quality against GPTCache and plain MiniLM cosine, traffic, fresh held-out sets, speed."""
