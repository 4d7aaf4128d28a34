"""CLI: `semcomm serve`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

__all__ = ["register"]


def serve(
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file (merged "
                                       "over the embedded default; see docs/server.md)."),
    host: str | None = typer.Option(None, "--host", help="Address to bind (default from "
                                    "config: 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", "-p", help="Port to bind (default from "
                                    "config: 8000)."),
    ray: bool = typer.Option(False, "--ray", help="Deploy the engines as Ray Serve replicas "
                             "behind semcomm's replica router, with Redis-backed stores."),
    log_level: str = typer.Option("info", "--log-level", help="Log level (debug, info, "
                                  "warning, error)."),
    dtype: str | None = typer.Option(None, "--dtype", help="Weight dtype of every in-process "
                                     "model: float32, bfloat16, float16 or auto (bfloat16 on a "
                                     "CPU with native bfloat16, else float32); docs/engine.md."),
    check: bool = typer.Option(False, "--check", help="Validate the config, print it as JSON "
                               "(with its memory plan under 'memory_plan'), print the plan as "
                               "a table on stderr and exit; a plan that does not fit "
                               "server.memory_bytes is refused."),
) -> None:
    """Serve an OpenAI-compatible API with semantic, KV-prefix and cache-to-cache reuse.

    With no --config it serves the embedded default offline (a local model, a SQLite semantic
    cache, memory + disk KV stores). Clients authenticate with 'Authorization: Bearer <key>'
    using the api_key of a tenant from the config's tenants table.
    """
    from ..engine import DTYPE_CHOICES
    from ..errors import require
    from ..server import load_config

    overrides: dict[str, Any] = {"server": {}}
    if host is not None:
        overrides["server"]["host"] = host
    if port is not None:
        overrides["server"]["port"] = port
    cfg = load_config(config, overrides=overrides)
    if dtype is not None:
        if dtype not in DTYPE_CHOICES:
            raise typer.BadParameter(f"must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}",
                                     param_hint="--dtype")
        for mcfg in cfg.models.values():  # the dtype of every in-process model
            if mcfg.kind == "hf":
                mcfg.dtype = dtype  # type: ignore[assignment]
    from ..server import preflight

    # paths, the server secret, the files the config names: one line, before any model loads
    preflight(cfg, create=not check)
    if check:
        import json

        from rich.console import Console
        from rich.table import Table

        from ..server import plan_config

        plan = plan_config(cfg)
        t = Table(title="memory plan (weights from the model files; baseline a default)")
        for col in ("part", "weights", "KV / token", "KV budget", "total"):
            t.add_column(col, justify="left" if col == "part" else "right")
        for row in plan.rows():
            t.add_row(*row)
        Console(stderr=True).print(t)
        out = json.loads(cfg.model_dump_json(exclude={"tenants"}))
        out["memory_plan"] = plan.as_dict()
        typer.echo(json.dumps(out, indent=2))
        plan.check()  # a plan that cannot fit: one clear line, exit code 2
        return
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    require("uvicorn", "server")
    if ray:
        from ..server import serve_ray

        serve_ray(cfg)
        return
    import uvicorn

    from ..server import create_app

    app = create_app(cfg)
    typer.echo(f"semcomm serving on http://{cfg.server.host}:{cfg.server.port} "
               f"(models: {', '.join([*cfg.models, *cfg.pipelines])})")
    uvicorn.run(app, host=cfg.server.host, port=cfg.server.port, log_level=log_level.lower(),
                access_log=False)


def register(app: typer.Typer) -> None:
    """Attach the `serve` command(s) to the main app."""
    app.command("serve")(serve)
