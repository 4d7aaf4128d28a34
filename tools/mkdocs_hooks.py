"""MkDocs hook: the benchmark charts under benchmarks/results/ become part of the site.

docs/BENCHMARKS.md links each chart as ``../benchmarks/results/NAME.png`` (a path that also works
when the Markdown is read on its own); this registers every such PNG as a site file under that
source path, written to ``assets/results/NAME.png``, so that ``mkdocs build --strict`` resolves
the links instead of rejecting them as pointing outside the docs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config["docs_dir"])
    results = docs.parent / "benchmarks" / "results"
    for png in sorted(results.glob("*.png")):
        files.append(File(f"../benchmarks/results/{png.name}", str(docs), config["site_dir"],
                          config["use_directory_urls"], dest_uri=f"assets/results/{png.name}",
                          inclusion=InclusionLevel.INCLUDED))  # a "../" path is excluded by default
    return files
