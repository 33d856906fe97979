"""``python -m semblend_sglang.bench [JOB] [OPTIONS]``: the benchmark jobs.

With no JOB the main job (``e2e``) runs with its defaults; options without a job name are the
main job's (``python -m semblend_sglang.bench --quick``). Each job lives in its own module as a
click command named ``command`` and is imported only when chosen. Jobs keep their command names;
modules are named for what they measure (``provider``: ``lookup_latency``, ``kernels``:
``kernel_bandwidth``, ``dispatch``: ``dispatch_simulation``).
"""

from __future__ import annotations

import importlib

import click

JOBS: dict[str, tuple[str, str]] = {
    "e2e": (
        "semblend_sglang.bench.e2e",
        "Every workload vs vanilla SGLang and semblend: TTFT, hits, quality (main job).",
    ),
    "ttft": ("semblend_sglang.bench.ttft", "TTFT of cold vs exact-repeat prompts on the server."),
    "provider": ("semblend_sglang.bench.lookup_latency", "Donor lookup latency and index memory."),
    "adversarial": (
        "semblend_sglang.bench.adversarial",
        "Donor lookups on adversarial token streams against the lookup budget.",
    ),
    "load": (
        "semblend_sglang.bench.load",
        "Concurrent clients vs vanilla and semblend: throughput, TTFT p50/p99, errors, memory.",
    ),
    "kernels": (
        "semblend_sglang.bench.kernel_bandwidth",
        "transfer_kv bandwidth against a plain copy.",
    ),
    "semantic": (
        "semblend_sglang.bench.semantic",
        "Semantic-hit TTFT vs cold and vs an exact hit of the same length; miss overhead.",
    ),
    "dispatch": (
        "semblend_sglang.bench.dispatch_simulation",
        "Data-parallel dispatch simulated: hit rate, load imbalance, cost (no engine).",
    ),
    "gateway": (
        "semblend_sglang.bench.gateway",
        "Semblend instances behind a real SMG gateway: donor-aware routing keys vs SMG's policies.",
    ),
    "vllm": (
        "semblend_sglang.bench.vllm_served",
        "The vLLM connector on a real vLLM engine: TTFT reuse vs cold, vLLM's counters, quality.",
    ),
    "blend-sim": (
        "semblend_sglang.bench.blend_sim",
        "Offline recompute simulation: which selection and ratio keep the cold answer.",
    ),
    "gate": (
        "semblend_sglang.bench.gate_eval",
        "Quality gate and post-hoc guard on e2e records: precision/recall for answers lost.",
    ),
    "kl-along": (
        "semblend_sglang.bench.kl_along",
        "Where along reused answers KL rises: terms before, at and after the divergence from cold.",
    ),
    "any-weights": (
        "semblend_sglang.bench.any_weights",
        "Checks that hold for any weights (recompute-all = cold, delta 0, split view = mask).",
    ),
    "table": (
        "semblend_sglang.bench.e2e_table",
        "e2e JSON reports as one markdown table: recompute strategy x ratio x workload.",
    ),
}
DEFAULT_JOB = "e2e"


class _LazyJobs(click.Group):
    """Click group whose subcommands are imported on first use; arguments that do not start
    with a job name go to the main job (``bench --quick`` is ``bench e2e --quick``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Put the main job's name in front of arguments that do not start with a job name."""
        if args and args[0] not in JOBS and args[0] not in ("-h", "--help"):
            args = [DEFAULT_JOB, *args]
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        """The job names, in :data:`JOBS` order."""
        return list(JOBS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The job's click command, importing its module now; None for an unknown name."""
        if cmd_name not in JOBS:
            return None
        module = importlib.import_module(JOBS[cmd_name][0])
        command: click.Command = module.command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """``--help``'s job list from :data:`JOBS`, without importing any job."""
        with formatter.section("Jobs"):
            formatter.write_dl([(name, help_) for name, (_, help_) in JOBS.items()])


@click.group(cls=_LazyJobs, invoke_without_command=True)
@click.pass_context
def main(ctx: click.Context) -> None:
    """semblend-sglang benchmarks. Without a JOB, runs the main job (e2e) on its defaults."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(_LazyJobs().get_command(ctx, DEFAULT_JOB) or main)


if __name__ == "__main__":
    main(prog_name="python -m semblend_sglang.bench")
