"""The ``zerosim`` command line."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(
    help="zerosim: train LLM search agents against a simulated search engine.", no_args_is_help=True
)
models_app = typer.Typer(help="Embedded and local models.", no_args_is_help=True)
data_app = typer.Typer(help="Embedded data sets.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")

console = Console(stderr=True)


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code=2)


@app.command()
def train(
    config: Path = typer.Option(None, "--config", "-c", help="YAML recipe, e.g. configs/demo.yaml"),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. trainer.max_steps=10"),
) -> None:
    """Run a curriculum RL job (GRPO over the multi-turn search rollout)."""
    from zerosim.config import ConfigError, load_config
    from zerosim.models import ModelError

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as exc:
        _fail(str(exc))
    from zerosim.train import train as run_training

    started = time.perf_counter()
    try:
        result = run_training(cfg)
    except (ModelError, FileNotFoundError) as exc:
        _fail(str(exc))
    minutes = (time.perf_counter() - started) / 60
    console.print(
        f"[bold green]done[/] {result.steps} steps in {minutes:.1f} min · MLflow run {result.run_id} "
        f"({cfg.tracking.tracking_uri}) · checkpoint {result.checkpoint}"
    )


@models_app.command("prepare")
def models_prepare(force: bool = typer.Option(False, help="Convert again even if cached.")) -> None:
    """Convert the embedded SmolLM2 GGUF into a cached bf16 Hugging Face checkpoint."""
    from zerosim.models import ModelError, prepare_embedded_model

    try:
        path = prepare_embedded_model(force=force)
    except ModelError as exc:
        _fail(str(exc))
    typer.echo(str(path))


@data_app.command("factbook")
def data_factbook(
    out: Path = typer.Option(None, "--out", help="Output directory (default: the zerosim cache)."),
) -> None:
    """Build the factbook passage corpus and QA splits (FlashRAG jsonl)."""
    from zerosim.data.embedded import ensure_factbook
    from zerosim.data.factbook import build_factbook

    paths = build_factbook(out) if out is not None else ensure_factbook()
    for name in ("corpus", "train", "dev", "test"):
        typer.echo(f"{name}\t{getattr(paths, name)}")


if __name__ == "__main__":
    app()
