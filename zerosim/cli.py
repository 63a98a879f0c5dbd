"""The ``zerosim`` command line.

A mistake of the user's — a bad config value or file, a malformed data row, a missing model or index, a
search backend that cannot be reached — ends the command with one line on stderr naming the problem and the
fix, and exit code 2; ``--debug`` (anywhere on the line) or ``ZEROSIM_DEBUG=1`` prints the traceback too.
A ``ValueError`` raised by a library rather than by zerosim (possibly a bug) always shows its traceback above
that line; anything else (``RuntimeError`` …) is a bug and ends in its traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import typer
from rich.console import Console
from typer.core import TyperGroup

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("zerosim", "eval", "simulators", "curricula")
# a user's mistake, not a bug: reported in one line (ConfigError, DataError, ModelError are ValueErrors)
USER_OS_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def _user_os_error(exc: BaseException) -> bool:
    from zerosim.core.fsutil import WriteFaultError

    return isinstance(exc, (*USER_OS_ERRORS, WriteFaultError))


def _debug_env() -> bool:
    return os.environ.get("ZEROSIM_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _user_error(exc: BaseException) -> bool:
    from zerosim.core.search import SearchError

    return isinstance(exc, (ValueError, SearchError)) or _user_os_error(exc)


def _ours(exc: BaseException) -> bool:
    """Raised on purpose by zerosim (its own error class, or a raise in its code): the message is written for
    the user; anything else (a library's ValueError) gets a pointer to --debug."""
    if type(exc).__module__.split(".")[0] in PROJECT_PACKAGES:
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    where = Path(frames[-1].filename).resolve()
    return any(where.is_relative_to(ROOT / package) for package in PROJECT_PACKAGES)


def error_line(exc: BaseException, debug: bool = False) -> str:
    """The one line ``zerosim`` prints for a user error."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror and len(exc.args) == 2:
        message = f"{exc.filename}: {exc.strerror}; check the path"  # raised by the OS: [Errno 2] ...
    else:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        message = message or type(exc).__name__
    if not _ours(exc):
        message = f"{type(exc).__name__}: {message}" + (
            "" if debug else " (run with --debug for the traceback)"
        )
    return message


class ZerosimGroup(TyperGroup):
    """Turns a user error raised by any subcommand into one line on stderr and exit code 2."""

    debug = False

    def main(self, args=None, *rest, **kwargs):
        args = list(sys.argv[1:] if args is None else args)
        ZerosimGroup.debug = "--debug" in args or _debug_env()  # --debug anywhere on the line
        from zerosim.core import signals

        signals.install()  # SIGTERM unwinds: MLflow runs end FAILED, a training job saves a checkpoint first
        try:
            return super().main([a for a in args if a != "--debug"], *rest, **kwargs)
        except signals.Terminated as exc:
            typer.echo(typer.style("stopped:", fg="yellow", bold=True) + f" {exc}", err=True)
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as exc:
            from zerosim.core.tracking import mlflow_failure

            store = mlflow_failure(exc)  # the MLflow store failed (mid-run): one line naming the key
            if store is not None:
                if ZerosimGroup.debug or _debug_env():
                    traceback.print_exception(exc, file=sys.stderr)
                _fail(store)
            if not _user_error(exc):
                raise
            # a library's ValueError may be a bug hours into a run: its traceback is always shown (one line
            # alone would mean re-running the job with --debug to see where it came from)
            shown = ZerosimGroup.debug or _debug_env() or not (_ours(exc) or isinstance(exc, OSError))
            if shown:
                traceback.print_exception(exc, file=sys.stderr)
            _fail(error_line(exc, shown))


app = typer.Typer(
    help="zerosim: train LLM search agents against a simulated search engine.",
    no_args_is_help=True,
    cls=ZerosimGroup,
)
models_app = typer.Typer(help="Embedded and local models.", no_args_is_help=True)
data_app = typer.Typer(help="Embedded data sets.", no_args_is_help=True)
policy_app = typer.Typer(help="Policy preparation.", no_args_is_help=True)
serve_app = typer.Typer(
    help="Serve search engines over HTTP (Search-R1 /retrieve API).", no_args_is_help=True
)
index_app = typer.Typer(help="Build or import retrieval indexes.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")
app.add_typer(policy_app, name="policy")
app.add_typer(serve_app, name="serve")
app.add_typer(index_app, name="index")
simulator_app = typer.Typer(help="The LLM search simulator.", no_args_is_help=True)
app.add_typer(simulator_app, name="simulator")

console = Console(stderr=True)


@app.callback()
def main(
    debug: bool = typer.Option(
        False,
        "--debug",
        help="On an error, print the traceback too (also ZEROSIM_DEBUG=1; may follow the command).",
    ),
) -> None:
    """zerosim: train LLM search agents against a simulated search engine."""


def _fail(message: str) -> None:
    """One line on stderr (no markup, no wrapping) and exit code 2."""
    typer.echo(typer.style("error:", fg="red", bold=True) + " " + message, err=True)
    raise typer.Exit(code=2)


def _load(config: Path | None, flags: dict, overrides: list[str] | None, schema: type):
    from zerosim.core.config import load_config
    from zerosim.core.runtime import apply_precision, apply_threads

    extra = [f"{k}={v}" for k, v in flags.items() if v is not None]
    cfg = load_config(config, [*extra, *(overrides or [])], schema=schema)  # ConfigError: one line, exit 2
    apply_threads(cfg.runtime.threads)  # before any work: this process's share of the cores
    apply_precision(cfg.runtime.bf16)  # bf16 compute where the CPU multiplies bf16 in hardware
    return cfg


def _threads_option():
    return typer.Option(
        None,
        "--threads",
        help="torch/OpenMP threads of this server (default: the cores it may use); beside a training job "
        "on one box, split the cores between them.",
    )


@app.command()
def train(
    config: Path = typer.Option(None, "--config", "-c", help="YAML recipe, e.g. configs/demo.yaml"),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. trainer.max_steps=10"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Resolve the recipe and print the plan; load no weights, start nothing."
    ),
    processes: int = typer.Option(
        None,
        "--processes",
        min=1,
        help="With --dry-run: plan for N training processes (default: the --launch-config's, $WORLD_SIZE or 1).",
    ),
    launch_config: Path = typer.Option(
        None,
        "--launch-config",
        help="With --dry-run: the accelerate config the job is launched with (configs/accelerate/zero2.yaml): "
        "its strategy (DDP, ZeRO-1/2/3, FSDP2) and processes plan the memory per GPU.",
    ),
    gpu_memory: float = typer.Option(
        None,
        "--gpu-memory",
        help="With --dry-run: GB of memory per GPU to check the memory plan against, 1 to 4096 (80: H100, "
        "141: H200; default: this machine's GPU, if any).",
    ),
) -> None:
    """Run a curriculum RL job (GRPO over the multi-turn search rollout)."""
    from zerosim.training.config import TrainConfig
    from zerosim.training.memory import check_gpu_memory

    check_gpu_memory(gpu_memory)  # inf, nan, 0, 1e30: one line naming the option, before the recipe loads

    # `resume=true` is short for run.resume=true
    overrides = [f"run.{o}" if o.split("=", 1)[0] == "resume" else o for o in overrides or []]
    cfg = _load(config, {}, overrides, TrainConfig)
    if dry_run:
        from rich.table import Table

        from zerosim.training.dry_run import plan

        if launch_config is not None and processes is None:
            from zerosim.training.memory import launch_from_config

            processes = launch_from_config(launch_config).processes  # ConfigError: one line, exit 2
        # reads the data files, loads no weights
        rows = plan(cfg, processes, launch_config=launch_config, gpu_memory=gpu_memory)
        table = Table(title=f"zerosim train {config or ''} (dry run: nothing loaded)", show_header=False)
        for item, value in rows:
            table.add_row(item, value)
        from rich.console import Console

        Console(width=160).print(table)  # the command's output: stdout
        return
    from zerosim.training.recipe import train as run_training

    started = time.perf_counter()
    result = run_training(cfg)
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
    search: str = typer.Option(None, "--search", help="bm25 | dense | hybrid | simulator | http | web"),
    method: str = typer.Option(None, "--method", help="agent | rag | direct"),
    limit: int = typer.Option(None, "--limit", help="Evaluate only the first N rows of each dataset."),
    config: Path = typer.Option(None, "--config", "-c", help="YAML eval recipe."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. search.k=5 batch_size=8"),
) -> None:
    """Evaluate a policy on QA datasets; writes table.json/table.md and an MLflow eval run."""
    from zerosim.job_config import EvalConfig

    flags = {"policy": policy, "method": method, "search.engine": search, "limit": limit}
    if dataset is not None:
        names = [d.strip() for d in dataset.split(",") if d.strip()]
        flags["datasets"] = "[" + ",".join(json.dumps(n) for n in names) + "]"
    cfg = _load(config, flags, overrides, EvalConfig)
    from zerosim.core.tracking import check_tracking_uri

    check_tracking_uri(cfg.tracking.tracking_uri)  # the MLflow store first, as `zerosim train` does
    from eval.run import run_eval
    from zerosim.engines import build_search_engine, preflight

    if cfg.method != "direct":  # the engine build's own checks (paths, reranker), before the policy loads
        preflight(cfg.search)
    result = run_eval(cfg, build_engine=build_search_engine)
    typer.echo(result.markdown)
    console.print(f"[bold green]done[/] MLflow run {result.run_id} · {result.out_dir}")


@app.command()
def experiment(
    config: Path = typer.Option(
        ..., "--config", "-c", help="Experiment config, e.g. configs/experiments/sim-vs-real-cpu.yaml"
    ),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. seeds=[0,1] eval.limit=50"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the stages, what will be reused and an estimated time; run nothing."
    ),
    export: Path = typer.Option(
        None, "--export", help="Write the finished stages' results (no models) to this folder, then stop."
    ),
    with_models: bool = typer.Option(
        False,
        "--with-models",
        help="With --export: the stages' model folders too, so a continuation elsewhere reads the very "
        "weights (an import checks each against its record's digest).",
    ),
    import_: list[Path] = typer.Option(
        None, "--import", help="Bring results written by --export into this experiment first (repeatable)."
    ),
    interim: bool = typer.Option(
        False,
        "--interim",
        help="Report the evaluations finished so far (per-seed EM, most common answers, seed-level tests) "
        "into <output_dir>/<name>/interim/ and print it; runs no stage (safe beside a running experiment).",
    ),
) -> None:
    """Simulator vs real search, end to end: simulator, warm start, training arms, held-out eval, report."""
    from contextlib import nullcontext

    from zerosim.core.runtime import apply_precision, apply_threads
    from zerosim.experiment import build_stages, load_experiment, plan_rows, run_experiment
    from zerosim.experiment.run import folder_lock
    from zerosim.experiment.transfer import export_results, import_results, plan_import, preview

    cfg = load_experiment(config, overrides or [])
    root = Path(cfg.output_dir) / cfg.name
    if interim and (dry_run or export is not None):
        raise typer.BadParameter("--interim reports what has finished: it runs alone, or after an --import")
    if export is not None:  # after what --import brings (never skipped beside it); a dry run writes nothing
        if dry_run:
            for source in import_ or []:
                coming = plan_import(build_stages(cfg, root), root, source, name=cfg.name)
                console.print(f"would import {len(coming)} stages from {source}: "
                              f"{', '.join(s.name for s in coming) or 'none new'}")  # fmt: skip
        else:
            for source in import_ or []:
                with folder_lock(root):
                    brought = import_results(build_stages(cfg, root), root, source, name=cfg.name)
                console.print(
                    f"imported {len(brought)} stages from {source}: {', '.join(brought) or 'none new'}"
                )
        written = export_results(
            build_stages(cfg, root),
            root,
            export,
            name=cfg.name,
            tracking_uri=cfg.tracking.tracking_uri,
            with_models=with_models,
            dry_run=dry_run,
        )
        models = " with their models" if with_models else ""
        if dry_run:
            console.print(
                f"would export {len(written)} finished stages{models} to {export} (dry run: nothing written"
                f"{'; the imports above not counted' if import_ else ''}): {', '.join(written) or 'none'}"
            )
            return
        console.print(f"[bold green]exported[/] {len(written)} finished stages{models} to {export}")
        return
    if dry_run:  # writes nothing: what --import would bring is planned as if it were here
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        from zerosim.experiment.estimates import rates_basis

        sources: dict[str, Path] = {}
        for source in import_ or []:
            coming = plan_import(build_stages(cfg, root), root, source, name=cfg.name, taken=list(sources))
            sources.update({s.name: source / s.name for s in coming})
            names = ", ".join(s.name for s in coming) or "none new"
            console.print(f"would import {len(coming)} stages from {source}: {names}")
        missing: list[str] = []  # listed under the plan: the plan is readable before the downloads
        with preview(build_stages(cfg, root), root, sources) if sources else nullcontext(root) as seen:
            stages = build_stages(cfg, seen)
            rows = plan_rows(cfg, stages, seen, missing)
        table = Table(title=f"zerosim experiment {config} -> {root} (dry run: nothing loaded)")
        for column in ("stage", "status", "estimate", "what"):
            table.add_column(column)
        for row in rows:  # plain text: a reason names paths in brackets, which are not markup
            table.add_row(*(Text(cell) for cell in row))
        total = sum(float(r[2].split()[0]) for r in rows)
        table.caption = f"estimated {total:.0f} min for the stages to run ({rates_basis(stages)})"
        Console(width=200).print(table)
        from zerosim.experiment.estimates import web_plan

        for line in web_plan(stages, cfg.train_launcher):
            typer.echo(line)
        if missing:  # the run refuses these before its first stage
            missing = list(dict.fromkeys(missing))  # one line per problem, however many stages read the input
            lines = "\n".join(f"  - {problem}" for problem in missing)
            typer.echo(
                f"missing inputs ({len(missing)}): the run refuses to start until they are there\n{lines}"
            )
            raise typer.Exit(code=2)
        return
    for source in import_ or []:
        with folder_lock(root):  # not while another process runs the experiment there
            brought = import_results(build_stages(cfg, root), root, source, name=cfg.name)
        console.print(f"imported {len(brought)} stages from {source}: {', '.join(brought) or 'none new'}")
    if interim:
        from zerosim.experiment.run import interim_report

        folder, _ = interim_report(cfg)
        typer.echo((folder / "report.md").read_text())
        console.print(f"[bold green]interim report[/] {folder}")
        return
    apply_threads(cfg.runtime.threads)
    apply_precision(cfg.runtime.bf16)  # every stage's: the experiment's runtime is theirs
    started = time.perf_counter()
    result = run_experiment(cfg, echo=lambda line: console.print(line, markup=False, highlight=False))
    report = result.root / "report.md"
    if report.is_file():
        typer.echo(report.read_text())
    minutes = (time.perf_counter() - started) / 60
    console.print(
        f"[bold green]done[/] {len(result.ran)} stages run, {len(result.reused)} reused, {minutes:.1f} min · "
        f"MLflow run {result.parent_run_id} · {result.root}"
    )


@policy_app.command("warmstart")
def policy_warmstart(
    config: Path = typer.Option(
        None, "--config", "-c", help="Training recipe; its warmstart section is used."
    ),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. warmstart.max_steps=80"),
) -> None:
    """SFT the policy on synthetic search trajectories (cold start), as `train` does with warmstart.enabled."""
    from zerosim.training.config import TrainConfig

    cfg = _load(config, {}, overrides, TrainConfig)
    from zerosim.training.warmstart import run_warmstart, warmstart_folder

    path = run_warmstart(
        cfg.warmstart,
        policy=cfg.policy.model,
        seed=cfg.run.seed,
        tracking=cfg.tracking,
        output_dir=Path(cfg.run.output_dir) / cfg.run.name / warmstart_folder(cfg),
        rollout=cfg.rollout,
    )
    typer.echo(str(path))


@policy_app.command("merge")
def policy_merge(
    adapter: Path = typer.Option(
        ..., "--adapter", help="A LoRA policy's adapter folder (<run>/final, checkpoint-N)."
    ),
    out: Path = typer.Option(..., "--out", help="Folder for the merged model (written whole or not at all)."),
) -> None:
    """Merge a LoRA policy's adapter into the base it names: a full model for tools that read no adapters (vLLM
    here, other runtimes); what policy.lora.merge_final writes to <run>/merged."""
    from zerosim.core.models import ModelError, is_adapter

    if not is_adapter(adapter):
        raise ModelError(
            f"--adapter {adapter} holds no adapter_config.json: name a LoRA run's final/ or checkpoint"
        )
    from zerosim.training.recipe import save_merged

    save_merged(adapter, out)
    typer.echo(str(out))


@serve_app.command("policy")
def serve_policy(
    model: str = typer.Option(..., "--model", help="Trained policy: a checkpoint folder, HF id, or smollm2."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback unless told otherwise)."),
    port: int = typer.Option(8002, "--port", help="TCP port."),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="Name clients ask for (default: --model)."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16."),
    threads: int = _threads_option(),
    max_waiting: int = typer.Option(64, "--max-waiting", min=0, help="Requests that may wait; more get 429."),
    request_timeout: float = typer.Option(
        30.0, "--request-timeout", min=0.001, help="Seconds to receive a whole request before closing it."
    ),
) -> None:
    """Serve a policy over an OpenAI-compatible /v1/chat/completions that takes `tools` and answers `tool_calls`
    (the template and call format of rollout.protocol=tools; docs/agents.md), in-process."""
    import os

    os.environ.setdefault(
        "OMP_WAIT_POLICY", "PASSIVE"
    )  # as `simulator serve`: it shares cores with its clients
    from simulators.openai_server import serve_openai
    from zerosim.core.http.connections import ConnectionTimeouts
    from zerosim.core.models import resolve_model
    from zerosim.core.runtime import apply_threads

    apply_threads(threads)
    serve_openai(
        resolve_model(model),
        host,
        port,
        served_model_name=served_model_name or model,
        dtype=dtype,
        max_waiting=max_waiting,
        timeouts=ConnectionTimeouts(request=request_timeout),
    )


@serve_app.command("retriever")
def serve_retriever(
    index: Path = typer.Option(..., "--index", help="Index directory from `zerosim index build`."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback unless told otherwise)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    threads: int = _threads_option(),
) -> None:
    """Serve a built index over POST /retrieve and GET /health."""
    from curricula.negatives import CorpusNegatives
    from eval.index import load_index
    from zerosim.core.http.server import serve
    from zerosim.core.runtime import apply_threads

    apply_threads(threads)

    engine = load_index(index)
    serve(engine, host=host, port=port, negatives=CorpusNegatives)


@index_app.command("build")
def index_build(
    corpus: str = typer.Option(..., "--corpus", help="FlashRAG corpus jsonl, or factbook."),
    kind: str = typer.Option(..., "--kind", help="bm25 | dense"),
    out: Path = typer.Option(..., "--out", help="Index directory to write (atomically)."),
    encoder: str = typer.Option(
        "minilm", "--encoder", help="Dense encoder: sentence-transformers name/path or minilm."
    ),
    faiss_type: str = typer.Option("flat", "--faiss-type", help="flat | hnsw | ivfpq"),
) -> None:
    """Build a BM25 or dense index with a manifest."""
    from eval.index import KINDS, build_index
    from zerosim.engines import resolve_corpus

    if kind not in KINDS:
        _fail(f"--kind must be {' or '.join(KINDS)}, got {kind!r}")
    path = build_index(Path(resolve_corpus(corpus)), kind, out, encoder=encoder, faiss_type=faiss_type)
    typer.echo(str(path))


@index_app.command("import")
def index_import(
    faiss_file: Path = typer.Option(
        ..., "--faiss", help="An existing faiss index (Search-R1: e5_Flat.index)."
    ),
    corpus: Path = typer.Option(
        ..., "--corpus", help="Its FlashRAG corpus jsonl, row i = vector i (Search-R1: wiki-18.jsonl)."
    ),
    encoder: str = typer.Option(
        ..., "--encoder", help="The encoder of its vectors: name or path (Search-R1: intfloat/e5-base-v2)."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Index directory to write (atomically; the files are linked, not copied)."
    ),
    pooling: str = typer.Option(
        None, "--pooling", help="mean | cls, for an encoder saved as a bare transformers model."
    ),
    query_prefix: str = typer.Option(
        None,
        "--query-prefix",
        help="Prepended to queries; default: what the encoder expects (e5: 'query: ').",
    ),
    passage_prefix: str = typer.Option(
        None, "--passage-prefix", help="How the passages were encoded (recorded; e5: 'passage: ')."
    ),
) -> None:
    """Wrap an existing faiss index and its corpus with a manifest, for search.dense.index_dir."""
    from eval.index_import import import_index

    if pooling is not None and pooling not in ("mean", "cls"):
        _fail(f"--pooling must be mean or cls, got {pooling!r}")
    path = import_index(
        faiss_file,
        corpus,
        encoder,
        out,
        pooling=pooling,
        query_prefix=query_prefix,
        passage_prefix=passage_prefix,
    )
    typer.echo(str(path))


@simulator_app.command("serve")
def simulator_serve(
    model: str = typer.Option(
        "smollm2", "--model", help="Simulator checkpoint: local path, HF id, or smollm2."
    ),
    lora: list[str] = typer.Option(None, "--lora", help="LoRA adapter as name=path (repeatable)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback unless told otherwise)."),
    port: int = typer.Option(8001, "--port", help="TCP port."),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="Name clients ask for (default: --model)."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16 (vLLM and in-process)."),
    gpu_memory_utilization: float = typer.Option(
        None,
        "--gpu-memory-utilization",
        min=0.01,
        max=1.0,
        help="vLLM only: share of the GPU's memory to take (vLLM's default 0.9; a GPU shared with training less).",
    ),
    tensor_parallel_size: int = typer.Option(
        None, "--tensor-parallel-size", min=1, help="vLLM only: GPUs to split the simulator over."
    ),
    max_model_len: int = typer.Option(
        None,
        "--max-model-len",
        min=1,
        help="vLLM only: longest prompt + completion (less context, more KV cache).",
    ),
    threads: int = _threads_option(),
    bf16: bool = typer.Option(
        None,
        "--bf16/--no-bf16",
        help="In-process on CPU: generate in bf16 from fp32 weights (default: where the CPU multiplies bf16 in "
        "hardware, AMX or AVX512_BF16; runtime.bf16).",
    ),
    max_waiting: int = typer.Option(
        64,
        "--max-waiting",
        min=0,
        help="Requests that may wait for the model; more get 429 (in-process only).",
    ),
    request_timeout: float = typer.Option(
        30.0,
        "--request-timeout",
        min=0.001,
        help="Seconds to receive a whole request before the connection is closed (in-process only).",
    ),
) -> None:
    """Serve the simulator over an OpenAI-compatible API: vllm serve on a GPU with vLLM, else in-process."""
    import os

    # a server shares its cores with the training job that asks it: OpenMP threads spinning at every barrier
    # made a served batch 6.8x slower than in-process on 2 cores (docs/simulator.md). Read once, when torch
    # loads (next line), so it is set here; a user's own value is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from simulators.openai_server import VLLMEngineArgs, start_simulator_server
    from zerosim.core.runtime import apply_precision, apply_threads

    apply_threads(threads)
    apply_precision(bf16)

    code = start_simulator_server(
        model,
        lora or [],
        host,
        port,
        served_model_name=served_model_name,
        dtype=dtype,
        engine=VLLMEngineArgs(gpu_memory_utilization, tensor_parallel_size, max_model_len),
        max_waiting=max_waiting,
        request_timeout=request_timeout,
    )
    raise typer.Exit(code=code)


@simulator_app.command("collect")
def simulator_collect(
    out: Path = typer.Option(None, "--out", help="SFT jsonl to write (a <out>.report.json goes beside it)."),
    data: str = typer.Option(None, "--data", help="Questions: file, HF id, or factbook."),
    search: str = typer.Option(
        None, "--search", help="Real retriever for the documents: bm25 | dense | hybrid | http | web"
    ),
    queries: str = typer.Option(None, "--queries", help="question | policy (the policy's <search> queries)"),
    label: str = typer.Option(None, "--label", help="contains | judge"),
    max_questions: int = typer.Option(
        None, "--max-questions", help="Use this many questions (seeded sample)."
    ),
    config: Path = typer.Option(None, "--config", "-c", help="YAML collect recipe."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. depth=20 balance=false"),
) -> None:
    """Build a simulator SFT dataset: queries, real-retriever documents, useful/noisy labels."""
    from zerosim.job_config import SimulatorCollectConfig

    flags = {
        "out": out,
        "data": data,
        "search.engine": search,
        "queries": queries,
        "label": label,
        "max_questions": max_questions,
    }
    cfg = _load(config, flags, overrides, SimulatorCollectConfig)
    from simulators.collect import run_collect
    from zerosim.engines import build_search_engine

    result = run_collect(cfg, build_engine=build_search_engine)
    typer.echo(json.dumps(result.report, indent=2))
    console.print(f"[bold green]done[/] {len(result.rows)} rows -> {result.path}")


@simulator_app.command("train")
def simulator_train(
    data: Path = typer.Option(None, "--data", help="SFT jsonl from `zerosim simulator collect`."),
    model: str = typer.Option(None, "--model", help="Base model: local path, HF id, or smollm2."),
    output_dir: Path = typer.Option(
        None, "--output-dir", help="Checkpoint goes to <output-dir>/<name>/final."
    ),
    lora: bool = typer.Option(None, "--lora/--full", help="Train a LoRA adapter, or all weights."),
    max_steps: int = typer.Option(None, "--max-steps", help="Optimizer steps."),
    config: Path = typer.Option(None, "--config", "-c", help="YAML SFT recipe."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. learning_rate=5e-5"),
) -> None:
    """Supervised fine-tuning of a simulator LLM (TRL SFTTrainer, full or LoRA) with an MLflow run."""
    from simulators.config import SimulatorTrainConfig

    flags = {
        "data": data,
        "model": model,
        "output_dir": output_dir,
        "lora": None if lora is None else str(lora).lower(),
        "max_steps": max_steps,
    }
    cfg = _load(config, flags, overrides, SimulatorTrainConfig)
    from simulators.sft import run_sft

    path = run_sft(cfg)
    typer.echo(str(path))


@simulator_app.command("eval")
def simulator_eval(
    model: str = typer.Option(None, "--model", help="Simulator: local path, HF id, or smollm2."),
    data: str = typer.Option(None, "--data", help="Questions with gold answers: file, HF id, or factbook."),
    limit: int = typer.Option(None, "--limit", help="Evaluate the first N questions."),
    backend: str = typer.Option(None, "--backend", help="transformers | openai"),
    url: str = typer.Option(None, "--url", help="backend=openai: the server's base URL."),
    config: Path = typer.Option(None, "--config", "-c", help="YAML simulator-eval recipe."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. k=5 simulator.temperature=0"),
) -> None:
    """Quality report of a simulator (useful/noisy answer shares, format, duplicates, speed) + MLflow run."""
    from simulators.config import SimulatorEvalConfig

    flags = {
        "simulator.model": model,
        "data": data,
        "limit": limit,
        "simulator.backend": backend,
        "simulator.url": url,
    }
    cfg = _load(config, flags, overrides, SimulatorEvalConfig)
    from simulators.quality import run_quality

    result = run_quality(cfg)
    typer.echo(result.markdown)
    console.print(f"[bold green]done[/] MLflow run {result.run_id} · {result.out_dir}")


@models_app.command("prepare")
def models_prepare(force: bool = typer.Option(False, help="Convert again even if cached.")) -> None:
    """Convert the embedded SmolLM2 GGUF into a cached bf16 Hugging Face checkpoint."""
    from zerosim.core.models import prepare_embedded_model

    path = prepare_embedded_model(force=force)
    typer.echo(str(path))


@data_app.command("factbook")
def data_factbook(
    out: Path = typer.Option(None, "--out", help="Output directory (default: the zerosim cache)."),
) -> None:
    """Build the factbook passage corpus and QA splits (FlashRAG jsonl)."""
    from zerosim.core.data.embedded import BUILT_SPLITS, ensure_factbook
    from zerosim.core.data.factbook import build_factbook

    paths = build_factbook(out) if out is not None else ensure_factbook()
    for name in ("corpus", *BUILT_SPLITS):
        typer.echo(f"{name}\t{getattr(paths, name.replace('-', '_'))}")


if __name__ == "__main__":
    app()
