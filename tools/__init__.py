"""Repository tools that are not part of the installed package (training pipelines, checks)."""
