"""Replay write throughput: `ReplayStore.write_region` (encode, write, fsync, commit) against
a raw `ndarray.tofile` + fsync of the same bytes, side by side in one run, across codecs and
region sizes, on real SMAX 3m regions collected by the QMIX policy (epsilon 0.1).

    python bench/write_throughput.py [--sizes 32x32 256x32 1024x128] [--repeats 30 10 5]

Each repeat writes one region with every variant in turn (raw first), into stores of 4 ring
slots, so the variants share the machine's state; the table gives medians. MB/s counts the
region's uncompressed bytes. Writes bench/results/write_throughput.{json,md,png}.

`--preset mappo-mpe` writes MPE simple_spread regions of the MAPPO policy instead (float
observations that hardly compress, where SMAX's are mostly zeros), as
bench/results/write_throughput-mappo-mpe.*.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)

N_SLOTS = 4


def variants() -> dict[str, dict]:
    """name -> ReplayStore.create keyword arguments (plus "previous": the write path before
    issue 16: one chunk per field and region, zarr's all-equal-to-fill scan, no fsync)."""
    from zarr.codecs import BloscCodec, ZstdCodec

    from storage.replay import CODEC

    return {
        "store (zstd 1, fsync)": {"compressors": CODEC},
        "zstd 1, no fsync": {"compressors": CODEC, "durable": False},
        "zstd 0 (level 3), fsync": {"compressors": (ZstdCodec(level=0),)},
        "blosc lz4 shuffle, fsync": {"compressors": (BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),)},
        "blosc lz4 no shuffle, fsync": {"compressors": (BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle"),)},
        "blosc zstd 1 shuffle, fsync": {"compressors": (BloscCodec(cname="zstd", clevel=1, shuffle="shuffle"),)},
        "none, fsync": {"compressors": ()},
        "none, no fsync": {"compressors": (), "durable": False},
        "previous (zstd 0, 1 chunk, scan, no fsync)": {"compressors": (ZstdCodec(level=0),), "durable": False,
                                                       "chunk_bytes": 2**62, "previous": True},
    }


def region_maker(preset: str, n_envs: int, n_steps: int):
    """(a function returning one real region on the device, the store's fields): the
    preset's policy acting in its env (qmix-smac: SMAX 3m), the collector's second region (so
    episodes are under way), as the collect stage hands it to the store. Each call rolls the
    same envs out again: the same values in fresh device arrays."""
    import jax
    import jax.numpy as jnp

    from marl import rollout
    from pipelines.config import make_run_config
    from pipelines.stages import RunParts, replay_fields

    config = make_run_config(preset, run_dir=tempfile.mkdtemp(prefix="write-bench-"),
                             overrides={"envs_per_collector": n_envs, "steps_per_region": n_steps})
    parts = RunParts.build(config)
    learner = parts.learner
    init, collect = rollout.make_collector(parts.env, learner.act, learner.init_carry, n_envs, n_steps)
    params = learner.policy_params(learner.init(jax.random.PRNGKey(0)))
    explore = learner.exploration(jnp.float32(10**6))
    rs, _, _ = collect(params, init(jax.random.PRNGKey(1)), explore)
    return (lambda: jax.block_until_ready(collect(params, rs, explore)[1])), replay_fields(parts.env.spec, learner)


def collect_region(preset: str, n_envs: int, n_steps: int) -> tuple[dict, dict]:
    """One real region (region_maker's) in host memory, and the store's fields."""
    import numpy as np

    make, fields = region_maker(preset, n_envs, n_steps)
    return {k: np.asarray(v) for k, v in make().items()}, fields


def raw_write(directory: str, data: dict) -> float:
    """Seconds to write every field's bytes to its own new file with tofile + fsync."""
    os.makedirs(directory, exist_ok=True)
    started = time.perf_counter()
    for name, arr in data.items():
        with open(os.path.join(directory, name), "wb") as fh:
            arr.tofile(fh)
            fh.flush()
            os.fsync(fh.fileno())
    return time.perf_counter() - started


def make_store(path: str, fields, n_envs: int, n_steps: int, kwargs: dict):
    from storage import ReplayStore

    kwargs = dict(kwargs)
    previous = kwargs.pop("previous", False)
    store = ReplayStore.create(path, fields=fields, n_envs=n_envs, steps_per_region=n_steps,
                               n_slots=N_SLOTS, attrs={}, **kwargs)
    if previous:  # zarr's default: scan each chunk for fill values before writing it
        for name in fields:
            store._arrays[name] = store._arrays[name].with_config({"write_empty_chunks": False})
    return store


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(preset: str, size: str, repeats: int, root: str, only: list[str] | None,
            out: str | None) -> list[dict]:
    n_envs, n_steps = (int(x) for x in size.split("x"))
    data, fields = collect_region(preset, n_envs, n_steps)
    nbytes = sum(a.nbytes for a in data.values())
    todo = {k: v for k, v in variants().items() if not only or k in only}
    stores = {name: make_store(os.path.join(root, f"{size}-{i}"), fields, n_envs, n_steps, kw)
              for i, (name, kw) in enumerate(todo.items())}
    seconds = {name: [] for name in ["raw tofile + fsync", *todo]}
    for r in range(repeats + 1):  # the first round warms up (first files of each slot)
        raw_dir = os.path.join(root, f"raw-{size}-{r}")
        t = raw_write(raw_dir, data)
        shutil.rmtree(raw_dir)
        if r:
            seconds["raw tofile + fsync"].append(t)
        for name, store in stores.items():
            started = time.perf_counter()
            store.write_region(r, data, iteration=r, collector=0, param_version=r)
            if r:
                seconds[name].append(time.perf_counter() - started)
    raw_mbps = nbytes / statistics.median(seconds["raw tofile + fsync"]) / 1e6
    rows = []
    for name, ts in seconds.items():
        store = stores.get(name)
        ratio = 1.0
        if store is not None:
            stored = sum(dir_bytes(os.path.join(store.path, f, "c")) for f in fields)
            ratio = min(repeats + 1, N_SLOTS) * nbytes / stored
        mbps = nbytes / statistics.median(ts) / 1e6
        rows.append({"preset": preset, "size": size, "n_envs": n_envs, "steps": n_steps, "region_mb": nbytes / 1e6,
                     "variant": name, "median_s": statistics.median(ts), "min_s": min(ts),
                     "mb_per_s": mbps, "x_raw": mbps / raw_mbps, "compression": ratio,
                     "chunks_obs": list(store._arrays["obs"].chunks) if store else None})
        print(json.dumps(rows[-1]), flush=True)
        if out:  # each row as soon as it is measured (bench/gpu.sh)
            with open(os.path.join(out, "rows.jsonl"), "a") as f:
                f.write(json.dumps({"part": "write_throughput", **rows[-1]}) + "\n")
    for store in stores.values():
        shutil.rmtree(store.path)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["32x32", "256x32", "1024x128"], help="ENVSxSTEPS per region")
    parser.add_argument("--repeats", type=int, nargs="+", default=[30, 10, 5], help="writes per size (one per size or one for all)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--variants", nargs="+", default=None, help="only these write paths (names as in the table)")
    parser.add_argument("--out", default=None, help="also append each row to OUT/rows.jsonl")
    parser.add_argument("--preset", default="qmix-smac", help="whose policy and env make the regions (qmix-smac: SMAX 3m)")
    args = parser.parse_args()
    name = "write_throughput" if args.preset == "qmix-smac" else f"write_throughput-{args.preset}"
    repeats = args.repeats if len(args.repeats) == len(args.sizes) else args.repeats[:1] * len(args.sizes)
    root = tempfile.mkdtemp(prefix="write-throughput-", dir=args.dir)
    rows = []
    try:
        for size, n in zip(args.sizes, repeats):
            rows += measure(args.preset, size, n, root, args.variants, args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    plt = report.save(
        name, {"rows": rows, "cpus": os.cpu_count(), "preset": args.preset},
        ["region (envs x steps)", "MB", "write path", "MB/s (median)", "x raw", "compression", "obs chunk (steps)"],
        ["---:", "---:", "---", "---:", "---:", "---:", "---:"],
        [[r["size"], f"{r['region_mb']:.1f}", r["variant"], f"{r['mb_per_s']:,.0f}", f"{r['x_raw']:.2f}",
          f"{r['compression']:.1f}x", str(r["chunks_obs"][0]) if r["chunks_obs"] else ""] for r in rows])
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        mine = {r["variant"]: r for r in rows if r["size"] == size}
        ax.barh(range(len(names)), [mine[n]["mb_per_s"] for n in names],
                color=["grey" if n.startswith("raw") else "tab:blue" for n in names])
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("MB/s (uncompressed region bytes)")
        ax.set_title(f"{args.preset} region {size} ({mine[names[0]]['region_mb']:.1f} MB)")
    fig.tight_layout()
    fig.savefig(report.figure_path(name), dpi=120)


if __name__ == "__main__":
    main()
