"""Replay that fits the machine: QMIX and MAPPO presets on six SMAX maps, each a few
iterations of the real `marl-train` flow on a fresh 2-worker LocalCluster (this machine's
memory split between them, as `marl train` does), measuring what the learner's replay takes.

    python bench/replay_memory.py [--maps 3m 8m ...] [--algos qmix-smac mappo-smax]

Per row: the ring as asked and as fitted (transitions per seed), the learner's replay bytes
(pipelines/memory.py), the peak RSS of each worker (ru_maxrss: the learner's and the other)
and of the driver, updates/s over the iterations after the first two (compiles), and the
Dask memory warnings the workers logged. Each row runs in its own process so the driver's
peak is its own. "vdn-smax 3m, 4 seeds" is the README's `--seeds 4` example (4 rings in one
learner). "3m, today's ring" is QMIX's ring before the ring was stated in
transitions (65,536 steps x 32 envs = 2,097,152 transitions).

Writes bench/results/replay_memory.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)

MAPS = ["3m", "2s3z", "8m", "3s5z", "5m_vs_6m", "27m_vs_30m"]
ALGOS = ["qmix-smac", "mappo-smax"]
# a few iterations each: QMIX 12 x 1,024 env steps (updates from the second), MAPPO 4 x 8,192
ENV_STEPS = {"qmix-smac": 12 * 1024, "vdn-smax": 12 * 1024, "mappo-smax": 4 * 8192}
ROW_OVERRIDES = {"qmix-smac": {"learning_starts": "1024"}, "vdn-smax": {"learning_starts": "1024"},
                 "mappo-smax": {}}
TODAYS_RING = 65_536 * 32
WARNING = re.compile(r"memory|Pausing worker|Restarting", re.IGNORECASE)


def row(preset: str, env: str, overrides: dict) -> dict:
    """One run in this process: the flow on a fresh 2-worker cluster."""
    import resource

    report.embedded_prefect()
    from distributed import Client

    from flows.train import marl_train
    from marl import algos, envs
    from pipelines import stages
    from pipelines.cluster import make_cluster, workers
    from pipelines.config import RunConfig, make_run_config

    run_dir = tempfile.mkdtemp(prefix="replay-memory-")
    overrides = {**ROW_OVERRIDES[preset], "eval_every": "1000", "eval_episodes": "16", **overrides}
    asked = make_run_config(preset, env_id=env, run_dir=run_dir, overrides=overrides)
    with make_cluster(n_workers=2, kind="cpu", dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        result = marl_train(preset=preset, env=env, env_steps=ENV_STEPS[preset], run_dir=run_dir,
                            overrides=overrides, scheduler_address=cluster.scheduler_address)
        peaks = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        limit = next(iter(workers(client).values()))["memory_limit"]
    with open(os.path.join(run_dir, "replay", "zarr.json")) as f:
        ran = RunConfig(**json.load(f)["attributes"]["config"])
    env_ = envs.make(env)
    learner = algos.make_learner(ran.algo, env_.spec, ran.algo_config())
    memory = stages.learner_memory(ran, env_.spec, learner, limit)
    steady = [r["updates_per_s"] for r in result["history"][2:]]
    return {"preset": preset, "env": env, "asked_transitions": asked.buffer_transitions,
            "ring_transitions": ran.buffer_transitions, "replay_bytes": memory.bytes,
            "budget_bytes": memory.budget, "memory_limit": limit,
            "worker_peak_rss": sorted(peaks.values(), reverse=True),
            "driver_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "updates_per_s": sum(steady) / len(steady) if steady else float("nan"),
            "env_steps": result["env_steps"], "wall_s": result["wall_s"]}


def run_row(preset: str, env: str, overrides: dict, label: str) -> dict:
    """A row in a fresh process; its stderr (the workers' logs) is scanned for Dask's memory
    warnings."""
    cmd = [sys.executable, __file__, "--row", preset, env, json.dumps(overrides)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    warnings = [line for line in done.stderr.splitlines() if WARNING.search(line)
                and ("distributed" in line or "Worker" in line)]
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"[{label}] failed: {tail}", flush=True)
        return {"preset": preset, "env": env, "label": label, "error": tail, "dask_memory_warnings": warnings}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out.update(label=label, dask_memory_warnings=warnings)
    print(f"[{label}] ring {out['ring_transitions']:,} replay {out['replay_bytes'] / 2**30:.2f} GiB "
          f"workers {[round(p / 2**30, 2) for p in out['worker_peak_rss']]} GiB "
          f"driver {out['driver_peak_rss'] / 2**30:.2f} GiB updates/s {out['updates_per_s']:.1f} "
          f"warnings {len(warnings)}", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", nargs="+", default=MAPS)
    parser.add_argument("--algos", nargs="+", default=ALGOS)
    parser.add_argument("--from-json", action="store_true",
                        help="rewrite the table and figure from bench/results/replay_memory.json")
    parser.add_argument("--row", nargs=3, metavar=("PRESET", "ENV", "OVERRIDES_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        preset, env, overrides = args.row
        print(json.dumps(row(preset, env, json.loads(overrides))))
        return

    if args.from_json:  # the table and figure again from saved rows
        with open(os.path.join(report.RESULTS, "replay_memory.json")) as f:
            saved = json.load(f)
        return write(saved["rows"], saved["command"])
    results = []
    for preset in args.algos:
        for name in args.maps:
            results.append(run_row(preset, f"smax:{name}", {}, f"{preset} {name}"))
            if preset == "qmix-smac" and name == "3m":
                results.append(run_row(preset, "smax:3m", {"buffer_transitions": str(TODAYS_RING)},
                                       f"{preset} 3m, today's ring"))
                # the README's own example of seeds: 4 rings in one learner
                results.append(run_row("vdn-smax", "smax:3m", {"n_seeds": "4"}, "vdn-smax 3m, 4 seeds"))
    write(results)


def write(results: list[dict], command: str | None = None):
    gib = lambda n: f"{n / 2**30:.2f}"
    table = []
    for r in results:
        if "error" in r:
            table.append([r["label"], "failed: " + r["error"][:80], "", "", "", "", "", ""])
            continue
        fitted = "" if r["ring_transitions"] == r["asked_transitions"] else " (fitted)"
        table.append([r["label"], f"{r['ring_transitions']:,}{fitted}", gib(r["replay_bytes"]),
                      gib(r["budget_bytes"]), " / ".join(gib(p) for p in r["worker_peak_rss"]),
                      gib(r["driver_peak_rss"]), f"{r['updates_per_s']:.3g}", str(len(r["dask_memory_warnings"]))])
    plt = report.save(
        "replay_memory", {"rows": results, **({"command": command} if command else {})},
        ["run", "ring (transitions per seed)", "replay GiB", "budget GiB", "worker peak RSS GiB (max / other)",
         "driver peak RSS GiB", "updates/s", "Dask memory warnings"],
        ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], table)
    ok = [r for r in results if "error" not in r]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(ok))
    ax.bar([i - 0.2 for i in x], [r["replay_bytes"] / 2**30 for r in ok], 0.4, label="learner replay (estimate)")
    ax.bar([i + 0.2 for i in x], [r["worker_peak_rss"][0] / 2**30 for r in ok], 0.4, label="largest worker peak RSS")
    if ok:
        ax.axhline(ok[0]["memory_limit"] / 2**30, color="red", ls="--", label="worker memory limit")
    ax.set_xticks(list(x), [r["label"] for r in ok], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("GiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.figure_path("replay_memory"), dpi=120)


if __name__ == "__main__":
    main()
