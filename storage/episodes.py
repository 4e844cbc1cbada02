"""Episodes of a replay store, computed chunk by chunk (stores larger than memory work).

Each collector steps its own N envs, and an env's episodes run on across that collector's
regions (iteration i, then i + 1). So one episode lives on a chain (collector, env) and may
span regions. The computation has two parts:

1. per region, in parallel (dask tasks over groups of regions, reading only reward,
   terminated, truncated, first and won): every episode end (terminated | truncated) in
   it, with the return and length of the segment since the episode's start (a step marked
   `first`, or the step after the previous end) or the region start, and the open tail
   after the region's last start;
2. a small sequential stitch over the regions in region order, per collector: a region's
   segment that has no start in it joins the tail carried from the same collector's
   previous iteration. Where that region is missing (the ring overwrote it, or it was
   never committed), the episode's start is unknown and the episode is marked partial.

A collector that restarts (a resumed run, a retried task on a fresh worker) resets its envs
without an end, and the store marks that step `first`: the unfinished episode before it is
dropped (it has no end) and a new one starts there. Data without a `first` field (hand-made
stores) start episodes only after ends, and at iteration 0, where the envs were just reset.

Return = the agents' mean reward summed over the episode's steps, as the collector's
episode stats count it; `won` is the store's per-step flag at the step that ended it.
"""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np

from .replay import ENV_DIM, STEP_DIM, StoreError, episode_starts

COLUMNS = ("collector", "env", "region", "iteration", "param_version", "end_t", "return",
           "length", "won", "complete")
_DTYPES = {"collector": "int64", "env": "int64", "region": "int64", "iteration": "int64",
           "param_version": "int64", "end_t": "int64", "return": "float64", "length": "int64",
           "won": "bool", "complete": "bool"}


def _block_episodes(step_reward: np.ndarray, end: np.ndarray, first: np.ndarray | None,
                    won: np.ndarray) -> dict:
    """Episode ends inside one region: step_reward/end/first/won are [T, N] (first may be
    None: no starts marked)."""
    T, N = end.shape
    # c[t, e] = reward summed over the region's steps before t
    c = np.concatenate([np.zeros((1, N)), np.cumsum(step_reward, axis=0)])
    starts = episode_starts(first, end)  # [T + 1, N], -1: began before the region
    env, t = np.nonzero(end.T)  # sorted by env, then step
    start = starts[t, env]
    head = start < 0  # began before the region: continues the carried tail
    begin = np.maximum(start, 0)  # where each segment began in the region
    tail_start = starts[T]
    tail_begin = np.maximum(tail_start, 0)
    return {
        "env": env, "end_t": t, "head": head,
        "return": c[t + 1, env] - c[begin, env], "length": t + 1 - begin, "won": won[t, env],
        "tail_return": c[T, np.arange(N)] - c[tail_begin, np.arange(N)],
        "tail_length": T - tail_begin, "has_start": tail_start >= 0,
    }


def _blocks(ds):
    """(T, n_blocks, per-block coordinates) of a dataset laid out as open_replay gives it."""
    T = int(ds.attrs.get("steps_per_region", 0))
    n = ds.sizes.get(STEP_DIM, 0)
    if T < 1 or n % T:
        raise StoreError(f"dataset has {n} steps and steps_per_region={T!r}; pass the dataset "
                         f"of storage.open_replay(path) (whole regions, in region order)")
    coords = {}
    for name in ("region", "iteration", "collector", "param_version"):
        if name not in ds.coords:
            raise StoreError(f"dataset has no {name!r} coordinate; pass storage.open_replay(path)")
        coords[name] = np.asarray(ds[name].values).reshape(-1, T)[:, 0] if n else np.zeros(0, int)
    return T, n // T, coords


def _per_step(ds, name: str, reduce_mean: bool):
    """A [step, env] dask array of field `name` (its mean over any other dims if asked)."""
    var = ds[name]
    if reduce_mean:
        extra = [d for d in var.dims if d not in (STEP_DIM, ENV_DIM)]
        var = var.astype("float64").mean(extra) if extra else var.astype("float64")
    var = var.transpose(STEP_DIM, ENV_DIM)
    return var.data if isinstance(var.data, da.Array) else da.from_array(var.values)


def _group_episodes(step_reward, end, first, won, T: int) -> list[dict]:
    """_block_episodes of each of the regions in a group of consecutive ones."""
    return [_block_episodes(step_reward[i:i + T], end[i:i + T],
                            None if first is None else first[i:i + T], won[i:i + T])
            for i in range(0, len(end), T)]


def episodes(ds):
    """One row per episode that ends in the data of `ds` (storage.open_replay(path)).

    Returns a pandas.DataFrame with columns collector, env, region, iteration,
    param_version, end_t (step of the end within its region: these coordinates are those
    of the step that ended the episode), return, length, won and complete (False: the
    episode's start is not in the data, so its return and length are partial).
    Reads only reward, terminated, truncated, first and won, a group of regions per dask task.
    """
    import pandas as pd

    for name in ("reward", "terminated", "truncated"):
        if name not in ds.data_vars:
            raise StoreError(f"dataset has no {name!r} variable; episodes need reward, "
                             f"terminated and truncated")
    T, n_blocks, coords = _blocks(ds)
    if n_blocks == 0:  # typed like a full table, so summarize() works on it
        return pd.DataFrame({c: [] for c in COLUMNS}).astype(_DTYPES)
    N = ds.sizes[ENV_DIM]
    # a task per group of regions (~1M step x env cells, at most 64 regions): one task per
    # region costs more in dask overhead than in reading
    group = T * max(1, min(64, 2**20 // (T * N)))
    chunks = {0: group, 1: -1}
    reward = _per_step(ds, "reward", True).rechunk(chunks)
    end = (_per_step(ds, "terminated", False) | _per_step(ds, "truncated", False)).rechunk(chunks)
    # data without a `won` field: no wins known
    won = (_per_step(ds, "won", False).rechunk(chunks) if "won" in ds.data_vars
           else da.zeros(end.shape, bool, chunks=end.chunks))
    has_first = "first" in ds.data_vars
    first = (_per_step(ds, "first", False).rechunk(chunks).to_delayed().ravel() if has_first
             else [None] * len(end.to_delayed().ravel()))
    tasks = [dask.delayed(_group_episodes)(r, e, f, w, T) for r, e, f, w in
             zip(reward.to_delayed().ravel(), end.to_delayed().ravel(), first, won.to_delayed().ravel())]
    blocks = [b for per_group in dask.compute(*tasks) for b in per_group]

    rows = {c: [] for c in COLUMNS}
    # per collector: (iteration of its last block, carried return, length, start known) per env
    carry: dict[int, tuple] = {}
    for k in np.argsort(coords["region"], kind="stable"):
        b = blocks[k]
        collector, iteration = int(coords["collector"][k]), int(coords["iteration"][k])
        prev = carry.get(collector)
        if prev is not None and prev[0] == iteration - 1:
            _, c_return, c_length, c_known = prev
        else:  # no predecessor in the data: known start only where the envs were reset
            c_return, c_length = np.zeros(N), np.zeros(N, np.int64)
            # (stores with `first` mark that reset; for those without, iteration 0 is one)
            c_known = np.full(N, iteration == 0 and not has_first)
        env, head = b["env"], b["head"]
        rows["collector"].append(np.full(len(env), collector))
        rows["env"].append(env)
        for name in ("region", "iteration", "param_version"):
            rows[name].append(np.full(len(env), int(coords[name][k])))
        rows["end_t"].append(b["end_t"])
        rows["return"].append(b["return"] + np.where(head, c_return[env], 0.0))
        rows["length"].append(b["length"] + np.where(head, c_length[env], 0))
        rows["won"].append(b["won"])
        rows["complete"].append(np.where(head, c_known[env], True))
        has_start = b["has_start"]
        carry[collector] = (
            iteration,
            np.where(has_start, b["tail_return"], c_return + b["tail_return"]),
            np.where(has_start, b["tail_length"], c_length + b["tail_length"]),
            np.where(has_start, True, c_known),
        )
    table = pd.DataFrame({c: np.concatenate(v) for c, v in rows.items()})
    return table.astype(_DTYPES).reset_index(drop=True)


def summarize(table, by: str = "iteration"):
    """Per `by` (iteration or collector): complete episodes, mean return, mean length,
    win rate, and how many partial episodes were left out."""
    import pandas as pd

    if by not in ("iteration", "collector", "region"):
        raise StoreError(f"cannot summarise by {by!r}; use iteration, collector or region")
    complete = table[table["complete"]]
    grouped = complete.groupby(by)
    out = pd.DataFrame({
        "episodes": grouped.size(),
        "return_mean": grouped["return"].mean(),
        "length_mean": grouped["length"].mean(),
        "win_rate": grouped["won"].mean(),
    })
    partial = table[~table["complete"]].groupby(by).size()
    out = out.reindex(sorted(set(out.index) | set(partial.index)))
    out["episodes"] = out["episodes"].fillna(0).astype("int64")
    out["partial"] = partial.reindex(out.index).fillna(0).astype("int64")
    return out


def iter_episodes(ds, fields: tuple[str, ...], table=None):
    """Yields (row of `episodes(ds)` as a dict, {field: [length, ...] numpy}) for each complete
    episode, reading one region at a time (memory: the regions that open episodes span).
    Pass `table` if `episodes(ds)` was computed already."""
    T, n_blocks, coords = _blocks(ds)
    table = episodes(ds) if table is None else table
    ends: dict[int, list] = {}  # region -> the rows of episodes ending there, by env then step
    for row in table.sort_values(["env", "end_t"]).to_dict("records"):
        ends.setdefault(int(row["region"]), []).append(row)
    flags = ("terminated", "truncated", "first") if "first" in ds.data_vars else ("terminated", "truncated")
    read = tuple(dict.fromkeys((*fields, *flags)))
    open_parts: dict[tuple[int, int], list] = {}  # (collector, env) -> [(block, t0, t1)]
    last_iteration: dict[int, int] = {}
    for k in np.argsort(coords["region"], kind="stable"):
        collector, iteration = int(coords["collector"][k]), int(coords["iteration"][k])
        if last_iteration.get(collector) != iteration - 1:  # chain broken: starts unknown
            for key in [key for key in open_parts if key[0] == collector]:
                del open_parts[key]
        last_iteration[collector] = iteration
        steps = {STEP_DIM: slice(k * T, (k + 1) * T)}
        block = {f: np.asarray(ds[f].isel(steps).values) for f in read}
        starts = episode_starts(block.get("first"), block["terminated"] | block["truncated"])
        for row in ends.get(int(coords["region"][k]), []):
            env, t = int(row["env"]), int(row["end_t"])
            earlier = open_parts.pop((collector, env), [])
            start = int(starts[t, env])
            parts = [(block, start, t + 1)] if start >= 0 else earlier + [(block, 0, t + 1)]
            if row["complete"]:
                yield row, {f: np.concatenate([b[f][t0:t1, env] for b, t0, t1 in parts]) for f in fields}
        for env in range(starts.shape[1]):
            t0 = int(starts[T, env])
            if t0 >= 0:  # the tail starts in this block (or is empty: T)
                open_parts.pop((collector, env), None)
            if t0 < T:
                open_parts.setdefault((collector, env), []).append((block, max(t0, 0), T))
