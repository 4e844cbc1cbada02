"""How fast a region leaves the device for the host, field by field and whole, by several ways
of copying it (a TPU keeps an array's two minor dims in (8, 128) tiles, so fields such as
obs [T, N, 3, 18] are padded and de-tiled on the way out; reshaped on the device first,
each field leaves as dense runs of bytes):

  as is         np.asarray of each field as the rollout left it, one after another
  async         copy_to_host_async of every field first, then np.asarray of each
  raveled each  each field raveled to 1-D on the device (one jitted call per field), then as async
  per step      each step's [N, ...] raveled in a loop over T ([T, N * ...] leaves), then as async
  n last        the env axis moved minor-most on the device, moved back on the host
  one buffer    every field raveled and bitcast to bytes, concatenated into one uint8 array
                on the device, one copy, split on the host (views)

Each jitted way's compile is timed field by field, apart, printed as it goes: on a TPU v5e
the raveled copy of a 4096-env QMIX region spent about 70 s in XLA's compiler (its
avail_actions [32, 4096, 3, 8] alone 69 s), so "raveled each" and "one buffer" are left out
unless --ways names them.

The region is the collect stage's own (marl.rollout.make_collector with the preset's policy
and env: mappo-mpe by default) at N envs x T steps, as the store holds it (its dtypes). Each
repeat copies fresh device arrays (a jax array caches its host copy). Every way's host bytes
are checked equal to "as is"; each way's first call is timed apart.

    python bench/host_copy.py [--preset mappo-mpe] [--envs 4096] [--steps 128] [--repeats 3]
                              [--ways "as is" async "per step" "n last"]

Prints one JSON row per way (and per field for "as is") and writes
bench/results/host_copy.{json,md} (or $MARL_BENCH_RESULTS; no figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)
from write_throughput import region_maker  # noqa: E402  (the same real region the write bench stores)


def make_region(preset: str, n_envs: int, n_steps: int):
    """(a function -> a fresh device region in the store's dtypes, the fields): a jax array
    keeps its host copy once made, so every way times arrays of its own."""
    make, fields = region_maker(preset, n_envs, n_steps)
    return (lambda: {name: array.astype(fields[name].dtype) for name, array in make().items()}), fields


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mappo-mpe")
    parser.add_argument("--envs", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", nargs="+", default=["as is", "async", "per step", "n last"],
                        help="which ways to time (the module's docstring says why two are left out by default)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pipelines.stages import ravel_steps

    region, fields = make_region(args.preset, args.envs, args.steps)

    def as_bytes(v):
        v = v.reshape(-1)
        return v.astype(jnp.uint8) if v.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(-1)

    pack = jax.jit(lambda d: jnp.concatenate([as_bytes(d[k]) for k in sorted(d)]))

    # per-field ways: (on the device, jitted per field; back to the field's shape on the host)
    per_field_ways = {
        "raveled each": (lambda v: v.reshape(-1), lambda a, shape: a.reshape(shape)),
        # what the collect stage does: each step's [N, ...] raveled inside a loop over T (the
        # compiler sees one step's shape)
        "per step": (ravel_steps, lambda a, shape: a.reshape(shape)),
        # the env axis (the long one) moved minor-most, so the tiles are full; moved back here
        "n last": (lambda v: jnp.moveaxis(v, 1, -1) if v.ndim > 2 else v,
                   lambda a, shape: np.ascontiguousarray(np.moveaxis(a, -1, 1)) if a.ndim > 2 else a),
    }
    compiled = {name: {} for name in per_field_ways}  # way -> field -> its compiled transform

    def per_field(name):
        back = per_field_ways[name][1]

        def way(d):
            moved = {k: compiled[name][k](v) for k, v in d.items()}
            for v in moved.values():
                v.copy_to_host_async()
            return {k: back(np.asarray(v), d[k].shape) for k, v in moved.items()}
        return way

    def as_is(d):
        return {k: np.asarray(v) for k, v in d.items()}

    def async_(d):
        for v in d.values():
            v.copy_to_host_async()
        return {k: np.asarray(v) for k, v in d.items()}

    def one_buffer(d):
        raw, out, at = np.asarray(pack(d)), {}, 0
        for k in sorted(d):
            dtype = np.dtype(d[k].dtype)
            n = int(np.prod(d[k].shape)) * dtype.itemsize
            out[k] = raw[at:at + n].view(dtype).reshape(d[k].shape)
            at += n
        return out

    every = {"as is": as_is, "async": async_, **{name: per_field(name) for name in per_field_ways},
             "one buffer": one_buffer}
    unknown = set(args.ways) - set(every)
    if unknown:
        parser.error(f"unknown --ways {sorted(unknown)}: choose from {sorted(every)}")
    ways = {name: every[name] for name in every if name in args.ways}
    started = time.perf_counter()
    first = region()
    jax.block_until_ready(first)
    print(json.dumps({"made_first_region_s": time.perf_counter() - started}), flush=True)
    for name in compiled:  # each field's compile, apart: which shapes XLA is slow on (printed as it goes)
        if name not in ways:
            continue
        for k, v in first.items():
            started = time.perf_counter()
            compiled[name][k] = jax.jit(per_field_ways[name][0]).lower(v).compile()
            print(json.dumps({"way": name, "compile_s": time.perf_counter() - started, "field": k,
                              "shape": list(v.shape), "dtype": str(v.dtype)}), flush=True)
    expect = as_is(first)
    nbytes = sum(a.nbytes for a in expect.values())
    first_s = {}
    for name, way in ways.items():  # warm up (compile) and check the bytes
        d = region()
        jax.block_until_ready(d)
        started = time.perf_counter()
        got = way(d)
        first_s[name] = time.perf_counter() - started
        print(json.dumps({"way": name, "first_s": first_s[name]}), flush=True)
        assert all(np.array_equal(got[k], expect[k]) for k in expect), name
    seconds = {name: [] for name in ways}
    per_field_s = {k: [] for k in fields}
    for r in range(args.repeats):
        for name, way in ways.items():
            d = region()
            started = time.perf_counter()
            way(d)
            seconds[name].append(time.perf_counter() - started)
        d = region()
        for k, v in d.items():
            started = time.perf_counter()
            np.asarray(v)
            per_field_s[k].append(time.perf_counter() - started)
    device = str(jax.devices()[0])
    rows = []
    for name, ts in seconds.items():
        s = statistics.median(ts)
        rows.append({"way": name, "field": "(all)", "shape": "", "mb": nbytes / 1e6, "median_s": s,
                     "mb_per_s": nbytes / s / 1e6, "x_as_is": statistics.median(seconds["as is"]) / s if "as is" in seconds else None,
                     "first_s": first_s[name],
                     "device": device, "envs": args.envs, "steps": args.steps, "preset": args.preset})
        print(json.dumps(rows[-1]), flush=True)
    for k, ts in per_field_s.items():
        s, b = statistics.median(ts), expect[k].nbytes
        rows.append({"way": "as is", "field": k, "shape": "x".join(map(str, expect[k].shape)) + f" {expect[k].dtype}",
                     "mb": b / 1e6, "median_s": s, "mb_per_s": b / s / 1e6, "x_as_is": None, "first_s": None,
                     "device": device, "envs": args.envs, "steps": args.steps, "preset": args.preset})
        print(json.dumps(rows[-1]), flush=True)
    print(f"{args.preset} region, {args.envs} envs x {args.steps} steps, {nbytes / 1e6:.1f} MB, "
          f"on {device}; medians of {args.repeats}")
    report.save("host_copy", {"rows": rows}, ["way", "field", "shape", "MB", "s", "MB/s", "x as is", "first call s"],
                ["---", "---", "---", "---:", "---:", "---:", "---:", "---:"],
                [[r["way"], r["field"], r["shape"], f"{r['mb']:.1f}", f"{r['median_s']:.3f}", f"{r['mb_per_s']:,.0f}",
                  "" if r["x_as_is"] is None else f"{r['x_as_is']:.2f}",
                  "" if r["first_s"] is None else f"{r['first_s']:.2f}"] for r in rows])

if __name__ == "__main__":
    main()
