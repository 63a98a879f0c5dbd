"""The ``zerosim`` command line."""

from __future__ import annotations

import json
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


@app.command("eval")
def evaluate(
    policy: str = typer.Option(
        None, "--policy", help="Policy under test: checkpoint path, HF id, or smollm2."
    ),
    dataset: str = typer.Option(
        None, "--dataset", help="Comma-separated datasets (files, HF ids, factbook[:split])."
    ),
    search: str = typer.Option(None, "--search", help="bm25 | dense | hybrid | simulator | http"),
    method: str = typer.Option(None, "--method", help="agent | rag | direct"),
    limit: int = typer.Option(None, "--limit", help="Evaluate only the first N rows of each dataset."),
    config: Path = typer.Option(None, "--config", "-c", help="YAML eval recipe."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. search.k=5 batch_size=8"),
) -> None:
    """Evaluate a policy on QA datasets; writes table.json/table.md and an MLflow eval run."""
    from zerosim.config import ConfigError, EvalConfig, load_config
    from zerosim.models import ModelError

    flags = {"policy": policy, "method": method, "search.engine": search, "limit": limit}
    extra = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if dataset is not None:
        names = [d.strip() for d in dataset.split(",") if d.strip()]
        extra.append("datasets=[" + ",".join(json.dumps(n) for n in names) + "]")
    try:
        cfg = load_config(config, [*extra, *(overrides or [])], schema=EvalConfig)
    except ConfigError as exc:
        _fail(str(exc))
    from eval.run import run_eval

    try:
        result = run_eval(cfg)
    except (ModelError, FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    typer.echo(result.markdown)
    console.print(f"[bold green]done[/] MLflow run {result.run_id} · {result.out_dir}")


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
