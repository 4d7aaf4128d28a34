"""CLI: ``semcomm cache stats|calibrate|report|clear|export|import``.

A cache location is a SQLite file path or a ``redis://`` URL. Commands other than
``calibrate`` never load an embedding model: they work on stored rows.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import ConfigError, CorruptEntryError, InvalidInputError

__all__ = ["cache_app", "register"]

cache_app = typer.Typer(help="Semantic answer cache: inspect, calibrate, report shadow traffic, "
                        "clear, export, import.",
                        no_args_is_help=True)
_out = Console()


class _NoEmbedder:
    """Stands in for the embedder when a command only moves stored rows."""

    def __init__(self, name: str, dim: int) -> None:
        self.name = name
        self.dim = dim

    def embed(self, texts: Any) -> Any:
        raise ConfigError("this command does not embed text")


def _open(location: str) -> Any:
    from ..semantic import SemanticCache, open_store

    store = open_store(location) if location.startswith(("redis://", "rediss://")) else \
        open_store(None, path=location)
    meta = store.read_meta()
    dim = int(meta.get("dim", 0) or 0)
    emb = _NoEmbedder(meta.get("embedder", "unknown"), dim or 1)
    return SemanticCache(embedder=emb, store=store, max_entries=None)


@cache_app.command("stats")
def stats(location: str = typer.Argument(..., help="SQLite file or redis:// URL.")) -> None:
    """Show entry count, bytes, scopes and format of a cache."""
    c = _open(location)
    st = c.stats()
    ents = c.entries()
    t = Table(title=f"semantic cache {location}")
    t.add_column("field")
    t.add_column("value", justify="right")
    rows = [("store", st.store), ("entries", str(st.entries)), ("bytes", str(st.bytes)),
            ("partitions", str(st.extra["partitions"])),
            ("scopes", ", ".join(sorted({e.scope for e in ents})) or "-"),
            ("models", str(len({e.model for e in ents}))),
            ("embedder", c.embedder.name), ("dim", str(c.dim)),
            ("with TTL", str(sum(e.ttl_s is not None for e in ents))),
            ("corrupt rows rejected", str(st.corrupt))]
    for k, v in rows:
        t.add_row(k, v)
    _out.print(t)


@cache_app.command("clear")
def clear(location: str = typer.Argument(..., help="SQLite file or redis:// URL."),
          yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation.")) -> None:
    """Delete every entry of a cache."""
    c = _open(location)
    n = len(c)
    if not yes:
        typer.confirm(f"delete {n} entries from {location}?", abort=True)
    c.clear()
    _out.print(f"cleared {n} entries")


@cache_app.command("export")
def export(location: str = typer.Argument(..., help="SQLite file or redis:// URL."),
           out: Path = typer.Argument(..., help="JSON-lines file to write.")) -> None:
    """Write every live entry as checksummed JSON lines (no pickle)."""
    from ..semantic import encode_entry

    c = _open(location)
    n = 0
    with open(out, "w", encoding="utf-8") as fh:
        for e in c.entries():
            r = encode_entry(e)
            fh.write(json.dumps({"id": r.id, "header": r.header,
                                 "vector": base64.b64encode(r.vector).decode(),
                                 "answer": r.answer, "checksum": r.checksum}) + "\n")
            n += 1
    _out.print(f"exported {n} entries to {out}")


@cache_app.command("import")
def import_(location: str = typer.Argument(..., help="SQLite file or redis:// URL."),
            src: Path = typer.Argument(..., help="JSON-lines file written by export.")) -> None:
    """Load exported entries; lines failing their checksum are skipped and counted."""
    from ..semantic import Row, decode_entry

    c = _open(location)
    good, bad = [], 0
    with open(src, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                good.append(decode_entry(Row(d["id"], d["header"], base64.b64decode(d["vector"]),
                                             d["answer"], d["checksum"])))
            except (CorruptEntryError, ValueError, KeyError, TypeError):
                bad += 1
    if good:
        dims = {int(e.vector.shape[0]) for e in good}
        meta = c.backend.read_meta()
        if meta.get("dim") and {int(meta["dim"])} != dims:
            raise ConfigError(f"export holds {sorted(dims)}-dimensional vectors, cache has "
                              f"{meta['dim']}")
        if not meta.get("dim"):
            c.backend.write_meta({"dim": str(dims.pop()), "embedder": good[0].embedder})
        put_many = getattr(c.backend, "put_many", None)
        if put_many:
            put_many(good)
        else:
            for e in good:
                c.backend.put(e)
    _out.print(f"imported {len(good)} entries, rejected {bad} corrupt lines")


@cache_app.command("calibrate")
def calibrate(
    pairs: Path = typer.Argument(..., help="CSV with question1,question2,is_duplicate."),
    target_precision: float = typer.Option(0.99, help="Precision the threshold must reach."),
    plot: Path = typer.Option(Path("calibration.png"), help="Precision/recall PNG to write."),
    guard: bool = typer.Option(True, help="Apply the lexical near-miss guard (as lookups do)."),
    embedder: str = typer.Option("", help="sentence-transformers model path (default MiniLM)."),
) -> None:
    """Find the lowest cosine threshold that reaches a target precision on labelled pairs."""
    import csv

    import numpy as np

    from ..semantic import LexicalGuard, as_embedder, calibrate_threshold

    if not pairs.exists():
        raise InvalidInputError(f"pairs file {pairs} does not exist")
    q1, q2, y = [], [], []
    with open(pairs, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        need = {"question1", "question2", "is_duplicate"}
        if not need <= set(reader.fieldnames or []):
            raise InvalidInputError(f"{pairs} needs the columns {sorted(need)}, "
                                    f"has {reader.fieldnames}")
        for r in reader:
            a, b = (r["question1"] or "").strip(), (r["question2"] or "").strip()
            if a and b:
                q1.append(a)
                q2.append(b)
                y.append(int(r["is_duplicate"]))
    if not q1:
        raise InvalidInputError(f"{pairs} holds no usable pairs")
    emb = as_embedder(embedder or None)
    from rich.progress import Progress

    vecs = []
    with Progress(console=Console(stderr=True)) as prog:
        task = prog.add_task("embedding pairs", total=len(q1))
        for s in range(0, len(q1), 256):
            a = emb.embed(q1[s : s + 256])
            b = emb.embed(q2[s : s + 256])
            vecs.append(np.sum(a * b, axis=1))
            prog.advance(task, len(a))
    sims = np.concatenate(vecs)
    g = LexicalGuard()
    vetoed = [not g(a, b) for a, b in zip(q1, q2, strict=True)] if guard else None
    res = calibrate_threshold(sims.tolist(), y, target_precision=target_precision,
                              vetoed=vetoed)
    _plot(res, plot)
    status = "reached" if res.reached else "NOT reached (best precision shown)"
    _out.print(f"threshold {res.threshold:.4f}  precision {res.precision:.4f}  "
               f"recall {res.recall:.4f}  target {target_precision} {status}  "
               f"pairs {res.n_pairs}  plot {plot}")


@cache_app.command("report")
def report(
    log: Path = typer.Argument(..., help="Shadow log (JSON lines) written by a cache in shadow "
                               "mode (SemanticCache(mode='shadow', shadow_log=PATH))."),
    target_precision: float = typer.Option(0.95, help="Precision the suggested cut must reach."),
    plot: Path = typer.Option(Path("shadow_report.png"), help="PNG to write."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON."),
) -> None:
    """Would-be hit rate, estimated precision by similarity band and the cosine cut that meets
    a target precision, from shadowed traffic."""
    from ..semantic import plot_shadow_report, read_shadow_log, shadow_report

    rep = shadow_report(read_shadow_log(log), target_precision=target_precision)
    t = Table(title=f"shadow traffic {log}: {rep.lookups} lookups, would-be hit rate "
              f"{rep.would_hit_rate:.1%}")
    for col in ("similarity", "lookups", "would-be hits", "compared", "estimated precision"):
        t.add_column(col, justify="right")
    for b in rep.bands:
        t.add_row(f"{b.lo:.2f}-{min(b.hi, 1.0):.2f}", str(b.lookups), str(b.would_hit),
                  str(b.compared), "-" if b.precision is None else f"{b.precision:.3f}")
    est = rep.estimated_precision
    t.add_row("all", str(rep.lookups), str(rep.would_hit), str(rep.compared),
              "-" if est is None else f"{est:.3f}")
    _out.print(t)
    if rep.threshold is None:
        _out.print(f"no cosine cut reaches precision {target_precision} with 20+ compared "
                   "lookups")
    else:
        _out.print(f"cosine cut {rep.threshold:.4f} reaches estimated precision "
                   f"{rep.threshold_precision:.3f} at hit rate {rep.threshold_hit_rate:.1%} "
                   f"(target {target_precision}; SemanticCache(threshold=...))")
    plot_shadow_report(rep, plot)
    _out.print(f"plot {plot}")
    if json_out is not None:
        json_out.write_text(json.dumps(rep.as_dict(), indent=1))


def _plot(r: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [c[0] for c in r.curve]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot([c[2] for c in r.curve], [c[1] for c in r.curve])
    ax[0].scatter([r.recall], [r.precision], color="red", zorder=3)
    ax[0].set_xlabel("recall")
    ax[0].set_ylabel("precision")
    ax[0].set_title("precision / recall over thresholds")
    ax[1].plot(ts, [c[1] for c in r.curve], label="precision")
    ax[1].plot(ts, [c[2] for c in r.curve], label="recall")
    ax[1].axvline(r.threshold, color="red", ls="--", label=f"threshold {r.threshold:.3f}")
    ax[1].set_xlabel("cosine threshold")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def register(app: typer.Typer) -> None:
    """Attach the ``cache`` command group to the main app."""
    app.add_typer(cache_app, name="cache")
