"""What every benchmark leaves under bench/results/: its JSON (with the command that made
it), a markdown table, and a matplotlib figure (headless)."""

from __future__ import annotations

import json
import os
import sys

# MARL_BENCH_RESULTS redirects them (bench/gpu.sh: a dry run must not overwrite the tables)
RESULTS = os.environ.get("MARL_BENCH_RESULTS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def save(name: str, payload: dict, header: list[str], align: list[str], rows: list[list[str]],
         command: str | None = None):
    """Writes <name>.json and <name>.md, prints the table, and returns pyplot for the figure.
    `command`: the one that measured it, where this call only rebuilds the report."""
    os.makedirs(RESULTS, exist_ok=True)
    command = command or " ".join(["python", f"bench/{os.path.basename(sys.argv[0])}", *sys.argv[1:]])
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"command": command, **payload}, f, indent=2)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    table = "\n".join(lines)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def embedded_prefect(home: str = ".prefect", startup_timeout_s: int = 90):
    """Prefect without a server for a benchmark's flow runs, as `marl train` has it (no
    telemetry, warnings only, the home's database made once), in a home of its own where
    other benchmarks may run their temporary servers at the same time."""
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(home))
    # Prefect makes its home without parents: a nested home on a fresh clone fails to start
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(startup_timeout_s))
    from flows.cli import _embedded_defaults, migrate_embedded_home

    _embedded_defaults()
    migrate_embedded_home()  # runs started together on a fresh home would race its creation


def figure_path(name: str) -> str:
    return os.path.join(RESULTS, f"{name}.png")
