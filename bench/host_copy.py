"""How fast a region leaves the device for the host, field by field and whole, by four ways
of copying it (a TPU keeps an array's two minor dims in (8, 128) tiles, so fields such as
obs [T, N, 3, 18] are padded and de-tiled on the way out; raveled on the device first,
each field is one dense run of bytes):

  as is       np.asarray of each field as the rollout left it, one after another
  async       copy_to_host_async of every field first, then np.asarray of each
  raveled     each field raveled to 1-D on the device (one jitted call), then as async
  raveled each  the same, one jitted call per field (one small compile per field shape)
  one buffer  every field raveled and bitcast to bytes, concatenated into one uint8 array
              on the device, one copy, split on the host (views)

The region is the collect stage's own (marl.rollout.make_collector with the preset's policy
and env: mappo-mpe by default) at N envs x T steps, as the store holds it (its dtypes). Each
repeat copies fresh device arrays (a jax array caches its host copy). Every way's host bytes
are checked equal to "as is". Each way's first call (its compile, for the jitted ways) is
timed apart: on a TPU v5e the collect stage's first raveled copy of a 4096-env QMIX region
spent about 70 s in XLA's compiler.

    python bench/host_copy.py [--preset mappo-mpe] [--envs 4096] [--steps 128] [--repeats 3]

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
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    region, fields = make_region(args.preset, args.envs, args.steps)
    ravel = jax.jit(lambda d: {k: v.reshape(-1) for k, v in d.items()})

    def as_bytes(v):
        v = v.reshape(-1)
        return v.astype(jnp.uint8) if v.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(-1)

    ravel_one = jax.jit(lambda v: v.reshape(-1))
    pack = jax.jit(lambda d: jnp.concatenate([as_bytes(d[k]) for k in sorted(d)]))

    def as_is(d):
        return {k: np.asarray(v) for k, v in d.items()}

    def async_(d):
        for v in d.values():
            v.copy_to_host_async()
        return {k: np.asarray(v) for k, v in d.items()}

    def raveled(d):
        flat = ravel(d)
        for v in flat.values():
            v.copy_to_host_async()
        return {k: np.asarray(v).reshape(d[k].shape) for k, v in flat.items()}

    ravel_each = {}  # field -> its compiled ravel (compiled, and timed, below)

    def raveled_each(d):
        flat = {k: ravel_each[k](v) for k, v in d.items()}
        for v in flat.values():
            v.copy_to_host_async()
        return {k: np.asarray(v).reshape(d[k].shape) for k, v in flat.items()}

    def one_buffer(d):
        raw, out, at = np.asarray(pack(d)), {}, 0
        for k in sorted(d):
            dtype = np.dtype(d[k].dtype)
            n = int(np.prod(d[k].shape)) * dtype.itemsize
            out[k] = raw[at:at + n].view(dtype).reshape(d[k].shape)
            at += n
        return out

    ways = {"as is": as_is, "async": async_, "raveled": raveled, "raveled each": raveled_each, "one buffer": one_buffer}
    started = time.perf_counter()
    first = region()
    jax.block_until_ready(first)
    print(json.dumps({"made_first_region_s": time.perf_counter() - started}), flush=True)
    for k, v in first.items():  # which field's ravel is slow to compile, apart (printed as it goes)
        started = time.perf_counter()
        ravel_each[k] = ravel_one.lower(v).compile()
        print(json.dumps({"compile_ravel_s": time.perf_counter() - started, "field": k,
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
    per_field = {k: [] for k in fields}
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
            per_field[k].append(time.perf_counter() - started)
    device = str(jax.devices()[0])
    rows = []
    for name, ts in seconds.items():
        s = statistics.median(ts)
        rows.append({"way": name, "field": "(all)", "shape": "", "mb": nbytes / 1e6, "median_s": s,
                     "mb_per_s": nbytes / s / 1e6, "x_as_is": statistics.median(seconds["as is"]) / s,
                     "first_s": first_s[name],
                     "device": device, "envs": args.envs, "steps": args.steps, "preset": args.preset})
        print(json.dumps(rows[-1]), flush=True)
    for k, ts in per_field.items():
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
