"""`marl replay ...`: inspect, summarise, reanalyse and export replay stores offline.

    marl replay info PATH                                   schema, env, dims, chunks, codecs, size
    marl replay verify PATH [--drop-damaged]                checksums and chunks of every committed region
    marl replay episodes PATH [--by iteration|collector] [--csv OUT]
    marl replay reanalyze RUN_DIR [--checkpoint STEP] [--out PATH]
    marl replay export PATH --minari DATASET_ID [--out DIR]

PATH is a replay store or a run dir holding one at <run_dir>/replay. info, episodes and export
check every committed region first (verify's checks): damage is one line on stderr, exit 1.
info and verify also take a derived group (a reanalysis output), checked the same way.
"""

from __future__ import annotations

import math
import os
import sys


def _console():
    from rich.console import Console

    # a pipe or a test gets a fixed, wide layout instead of rich's 80 columns
    # markup off: paths and code in the output hold square brackets
    return Console(markup=False) if sys.stdout.isatty() else Console(width=160, soft_wrap=True, markup=False)


def _fail(message) -> int:
    """One line on stderr; exit 1 for a damaged store, 2 for bad input."""
    from flows.checks import one_line
    from storage import ReplayDamaged

    print(f"marl: {one_line(message)}", file=sys.stderr)
    return 1 if isinstance(message, ReplayDamaged) else 2


def _checked(path: str):
    """The store at `path`, opened read-only once verify's checks pass (else ReplayDamaged)."""
    from storage import ReplayStore

    store = ReplayStore.open(path)
    store.check()
    return store


def store_path(path: str) -> str:
    """PATH itself, or PATH/replay when PATH is a run dir."""
    inner = os.path.join(path, "replay")
    if not os.path.isfile(os.path.join(path, "zarr.json")) and os.path.isfile(os.path.join(inner, "zarr.json")):
        return inner
    return path


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _codec(codec) -> str:
    """e.g. zstd(level=0); settings that are off (checksum=False) are left out."""
    d = codec.to_dict()
    config = ",".join(f"{k}={v}" for k, v in (d.get("configuration") or {}).items()
                      if v is not False and v is not None)
    return f"{d['name']}({config})" if config else d["name"]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _arrays_table(path: str, names: list[str]):
    """Per Zarr array: dims, shape, chunks, codec chain, bytes on disk and compression ratio."""
    import zarr
    from rich import box
    from rich.table import Table

    group = zarr.open_group(path, mode="r", zarr_format=3)
    table = Table(title="variables: Zarr v3 arrays (codecs: filters > serializer > compressors)",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("name", "dtype", "dims", "shape", "chunks", "codecs", "stored", "ratio"):
        table.add_column(col, justify="right" if col in ("stored", "ratio") else "left")
    for name in names:
        array = group[name]
        stored = array.nbytes_stored()  # its chunks and metadata, on any store
        n_chunks = array.nchunks_initialized
        # raw / stored bytes of the chunks written (stores made before every chunk was written
        # lack those equal to the fill value); the metadata's ~1 KiB is in the stored bytes
        ratio = f"{n_chunks * math.prod(array.chunks) * array.dtype.itemsize / stored:.1f}x" if n_chunks else "no chunks"
        codecs = [*array.filters, array.serializer, *array.compressors]
        table.add_row(name, str(array.dtype), ",".join(array.metadata.dimension_names or ()),
                      "x".join(map(str, array.shape)), "x".join(map(str, array.chunks)),
                      " > ".join(_codec(c) for c in codecs), _size(stored), ratio)
    return table


def _derived_kind(path: str) -> str | None:
    """'reanalysis' or 'derived' where PATH is a derived group, else None."""
    import json

    try:  # a reanalysis output is a derived group, not a store
        with open(os.path.join(path, "zarr.json")) as fh:
            kind = json.load(fh).get("attributes", {}).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in ("reanalysis", "derived") else None


def _derived_info(path: str) -> int:
    """`replay info` of a derived group (a reanalysis output), checked first."""
    from storage import StoreError
    from storage.derived import WRITTEN, DerivedGroup

    try:
        derived = DerivedGroup.open(path)
        derived.check()
    except StoreError as e:
        return _fail(e)
    console, attrs = _console(), derived.attrs
    written = derived.written()
    console.print(f"{attrs.get('kind')} group: {os.path.abspath(path)}")
    console.print(f"source store: {attrs.get('source_store')}  env {attrs.get('env_id')}  "
                  f"algorithm {attrs.get('algorithm')}")
    if "checkpoint_step" in attrs:
        console.print(f"checkpoint:   step {attrs['checkpoint_step']} in {attrs.get('checkpoint_dir')}")
    console.print(f"regions:      {len(written)} of {len(derived.regions)} written "
                  f"({derived.steps_per_region} steps x {derived.n_envs} envs each)")
    console.print(_arrays_table(path, [*derived.variables, "region", "iteration", "collector",
                                       "param_version", WRITTEN]))
    console.print(f"size on disk: {_size(_dir_size(path))}")
    return 0


def cmd_replay_info(args) -> int:
    import numpy as np

    from storage import ReplayStore, StoreError, open_replay

    path = store_path(args.path)
    if _derived_kind(path):
        return _derived_info(path)
    try:
        store = _checked(path)
        ds = open_replay(path)
    except StoreError as e:
        return _fail(e)
    console, attrs = _console(), store.attrs
    spec = attrs.get("env_spec") or {}
    committed = [r for r, _ in store.committed()]
    console.print(f"store:        {os.path.abspath(path)}")
    console.print(f"schema:       v{attrs.get('schema_version')}  env {attrs.get('env_id')}  "
                  f"algorithm {attrs.get('algorithm')}  seed {attrs.get('seed')}  preset {attrs.get('preset')}")
    if spec:
        actions = (f"{spec['n_actions']} discrete actions" if spec.get("discrete")
                   else f"continuous actions [{spec.get('action_dim')}] in [{spec.get('action_low')}, {spec.get('action_high')}]")
        console.print(f"env:          {len(spec.get('agents', []))} agents {', '.join(spec.get('agents', []))}; "
                      f"obs {spec.get('obs_dim')}, state {spec.get('state_dim')}, {actions}, "
                      f"episode limit {spec.get('episode_limit')}, {spec.get('backend')} backend")
    span = f" (ids {committed[0]}..{committed[-1]})" if committed else ""
    console.print(f"committed:    {len(committed)} regions{span} = {store.committed_steps()} steps x "
                  f"{store.n_envs} envs = {store.committed_steps() * store.n_envs:,} transitions; "
                  f"{store.total_regions_committed()} regions written in all")
    console.print(f"ring:         {store.n_slots} slots x {store.steps_per_region} steps "
                  f"(capacity {store.capacity:,} steps); one region = one chunk along step")
    console.print("dims:         " + ", ".join(f"{k}={v}" for k, v in ds.sizes.items()))
    if len(ds.step):
        it, pv = ds.iteration.values, ds.param_version.values
        console.print(f"iterations:   {int(np.min(it))}..{int(np.max(it))}  collectors "
                      f"{sorted(set(int(c) for c in ds.collector.values))}  param versions "
                      f"{int(np.min(pv))}..{int(np.max(pv))}")

    console.print(_arrays_table(path, [*store.fields, "region", "iteration", "collector",
                                       "param_version", "commit", "trained_version"]))
    console.print(f"size on disk: {_size(_dir_size(path))}")
    return 0


def _derived_verify(path: str, drop_damaged: bool) -> int:
    """`replay verify` of a derived group: every written block's chunks and the marks."""
    from storage import ReplayDamaged, StoreError
    from storage.derived import DerivedGroup, _fix

    try:
        derived = DerivedGroup.open(path)
        damage, counts = derived.verify()
    except StoreError as e:
        return _fail(e)
    by_array: dict[str, list] = {}
    for d in damage:
        by_array.setdefault(d.array, []).append(d)
    for name, found in by_array.items():  # one line per damaged array, as for a store
        regions = sorted({d.region for d in found})
        files = "; ".join(f"{d.key} {d.problem}" for d in found[:3])
        more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
        print(f"{name}: block{'s' if len(regions) > 1 else ''} of region{'s' if len(regions) > 1 else ''} "
              f"{', '.join(map(str, regions))} damaged ({files}{more})")
    checked = (f"{counts['blocks']} written blocks, {counts['chunks']} chunks checked"
               + ("" if counts["checksums"] else " (made before checksums: chunks decoded instead)"))
    if not damage:
        print(f"derived group at {os.path.abspath(path)}: {checked}, no damage")
        return 0
    regions = sorted({d.region for d in damage})
    drop = " (--drop-damaged drops regions of replay stores only)" if drop_damaged else ""
    return _fail(ReplayDamaged(f"derived group at {path}: {len(regions)} of {counts['blocks']} written "
                               f"blocks damaged; {_fix(path)}{drop}"))


def cmd_replay_verify(args) -> int:
    from storage import ReplayDamaged, ReplayStore, StoreError

    path = store_path(args.path)
    if _derived_kind(path):
        return _derived_verify(path, args.drop_damaged)
    remade = []
    try:
        try:
            store = ReplayStore.open(path, mode="r")
        except ReplayDamaged:
            if not args.drop_damaged:
                raise
            remade = ReplayStore.remake_damaged_arrays(path)  # raises again if it cannot
            store = ReplayStore.open(path, mode="r")
        damage, counts = store.verify()
    except StoreError as e:
        return _fail(e)
    for name in remade:
        print(f"{name}: array metadata missing or damaged; remade empty, every region dropped")
    by_array: dict[str, list] = {}
    for d in damage:
        by_array.setdefault(d.array, []).append(d)
    for name, found in by_array.items():  # one line per damaged array
        regions = sorted({d.region for d in found if d.region is not None})
        files = "; ".join(f"{d.key} {d.problem}" for d in found[:3])
        more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
        what = "commit marker" if name == "commits" else "region"
        print(f"{name}: {what}{'s' if len(regions) > 1 else ''} {', '.join(map(str, regions)) or '?'} "
              f"damaged ({files}{more})")
    checked = (f"{counts['regions']} committed regions, {counts['chunks']} chunks checked"
               + ("" if counts["checksums"] else " (a store made before checksums: chunks "
                  "decoded instead; a missing field chunk may be a legitimate fill)"))
    if not damage:
        print(f"replay store at {os.path.abspath(path)}: {checked}, no damage")
        return 0
    regions = sorted({d.region for d in damage if d.region is not None and d.slot is not None})
    if not args.drop_damaged:
        return _fail(ReplayDamaged(
            f"replay store at {path}: {len(regions)} of {counts['regions']} committed regions "
            f"damaged; run `marl replay verify {args.path} --drop-damaged` to drop them from the "
            f"commit log, then resume"))
    try:
        dropped = ReplayStore.open(path, mode="r+").drop_damaged(damage)
    except StoreError as e:
        return _fail(e)
    markers = sum(d.slot is None for d in damage)
    print(f"dropped {len(dropped)} damaged region(s) ({', '.join(map(str, dropped)) or 'none'}) from "
          f"the commit log of {os.path.abspath(path)}"
          + (f", rebuilt {markers} commit marker(s)" if markers else "")
          + "; a resumed run trains on the regions left and collects new ones")
    return 0


def cmd_replay_episodes(args) -> int:
    from rich.table import Table

    from storage import StoreError, open_replay
    from storage.episodes import episodes, summarize

    from flows import checks

    path = store_path(args.path)
    try:
        if args.csv:  # checked before the episodes are computed; never written into the store
            checks.check_writable_path(args.csv, "--csv", directory=False)
            checks.check_outside(args.csv, "--csv", {"replay store": path})
        _checked(path)
        table = episodes(open_replay(path))
        summary = summarize(table, args.by)
    except (StoreError, checks.InputError) as e:
        return _fail(e)
    if args.csv:
        table.to_csv(args.csv, index=False)
    console = _console()
    complete = table[table["complete"]]
    out = Table(title=f"episodes by {args.by}: {os.path.abspath(path)}", title_justify="left")
    for col in (args.by, "episodes", "mean return", "mean length", "win rate", "partial"):
        out.add_column(col, justify="right")
    fmt = lambda v, spec: "" if v != v else format(v, spec)
    for row in summary.reset_index().itertuples(index=False):
        out.add_row(str(row[0]), str(row.episodes), fmt(row.return_mean, ".3f"),
                    fmt(row.length_mean, ".1f"), fmt(row.win_rate, ".3f"), str(row.partial))
    if len(complete):
        out.add_row("all", str(len(complete)), f"{complete['return'].mean():.3f}",
                    f"{complete['length'].mean():.1f}", f"{complete['won'].mean():.3f}",
                    str(int((~table['complete']).sum())), style="bold")
    console.print(out)
    console.print("partial: episodes whose start is not in the committed data (overwritten by the "
                  "ring or before the first stored region); left out of the figures")
    if args.csv:
        console.print(f"per-episode table ({len(table)} rows): {os.path.abspath(args.csv)}")
    return 0


def cmd_replay_reanalyze(args) -> int:
    from flows import checks
    from flows.cli import _embedded_defaults

    try:  # the cheap checks first: no JAX import for a typo
        checks.check_count("--workers", args.workers)
        checks.check_count("--checkpoint", args.checkpoint, low=0, example=20)
        checks.check_scheduler(args.scheduler)
    except checks.InputError as e:
        return _fail(e)
    from marl.algos import ConfigError
    from pipelines import reanalyze
    from storage import StoreError

    try:  # bad paths or steps fail here, before a Prefect server or a cluster starts
        job = reanalyze.plan(run_dir=args.run_dir, store=args.store, checkpoint_dir=args.checkpoints,
                             checkpoint=args.checkpoint, out=args.out)
        _checked(job["store"])  # damage stops it here, before a cluster starts (and in the tasks)
        checks.check_writable_path(job["out"], "--out", directory=True)
        checks.check_outside(job["out"], "--out", {"replay store": job["store"],
                                                   "checkpoint dir": job["checkpoint_dir"]})
    except (StoreError, checks.InputError) as e:
        return _fail(e)
    _embedded_defaults()  # before prefect is imported
    from flows.cli import fail, migrate_embedded_home, quiet_reported_failures, start_embedded_server
    from flows.reanalyze import marl_reanalyze
    from flows.training import StageError, stage_errors

    migrate_embedded_home()
    start_embedded_server()
    quiet_reported_failures()
    try:  # an error inside a task: one line, its traceback in <run dir>/logs
        with stage_errors(args.run_dir or os.path.dirname(job["store"])):
            result = marl_reanalyze(run_dir=args.run_dir, store=args.store, checkpoint_dir=args.checkpoints,
                                    checkpoint=args.checkpoint, out=args.out,
                                    scheduler_address=args.scheduler, n_workers=args.workers)
    except (StoreError, ConfigError, ValueError) as e:
        return _fail(e)
    except StageError as e:
        return fail(e, code=1)
    console = _console()
    console.print(f"reanalysed {result['written']} of {len(result['regions'])} regions of "
                  f"{result['store']} with checkpoint {result['checkpoint_step']} in {result['wall_s']:.1f} s")
    if result["skipped"]:
        console.print(f"skipped (overwritten by the ring meanwhile): {result['skipped']}")
    console.print(f"variables:    {', '.join(result['variables'])}")
    console.print(f"output:       {result['out']}")
    console.print(f"open with:    xr.merge([storage.open_replay({result['store']!r}), "
                  f"storage.open_derived({result['out']!r})], compat='no_conflicts')")
    return 0


def cmd_replay_export(args) -> int:
    from flows import checks
    from storage import StoreError
    from storage.minari_export import export_minari

    path = store_path(args.path)
    try:
        if args.out:  # a Minari root of its own, never inside the store it reads
            checks.check_writable_path(args.out, "--out", directory=True)
            checks.check_outside(args.out, "--out", {"replay store": path})
        _checked(path)
        result = export_minari(path, args.minari, out_dir=args.out)
    except (StoreError, checks.InputError) as e:
        return _fail(e)
    _console().print(f"Minari dataset {result['dataset_id']}: {result['episodes']} episodes, "
                     f"{result['steps']} steps ({result['skipped']} partial episodes left out) at "
                     f"{result['path']}")
    return 0


EXPORT_HELP = """Writes the complete episodes of a store as a Minari dataset (single-agent,
gymnasium-style): the agents are flattened into one joint observation (Box of
n_agents*obs_dim) and one joint action (MultiDiscrete of n_actions per agent for discrete
envs such as smax:*, Box of n_agents*action_dim for continuous ones such as continuous
mpe:*), the reward is the team reward (mean over agents), and the global state and action
masks go into infos. Works for every env of the registry (smax:*, mpe:*, pz:*), since their
stores hold fixed-shape agents. The store keeps no terminal observation (envs auto-reset),
so each episode's final observation repeats its last one; an episode that reaches the
env's episode limit is marked truncated, any other end terminated."""


def add_commands(sub):
    import argparse

    p = sub.add_parser("replay", help="inspect, summarise, reanalyse and export replay stores")
    rsub = p.add_subparsers(dest="replay_command", required=True)
    where = "a replay store, or a run dir holding one at <run_dir>/replay"

    info = rsub.add_parser("info", help="schema, env, dims, committed steps, chunking, compression, size")
    info.add_argument("path", help=where)
    info.set_defaults(fn=cmd_replay_info)

    ver = rsub.add_parser("verify", help="check every committed region: chunks present, crc32c checksums, commit log",
                          description="Reads every chunk of every committed region of every array and the "
                          "commit log; names each damaged array and its regions on one line each. Exit 0 and "
                          "a one-line summary when clean, 1 on damage.")
    ver.add_argument("path", help=f"{where}; or a derived group (a reanalysis output)")
    ver.add_argument("--drop-damaged", action="store_true",
                     help="drop the damaged regions from the commit log (and remake arrays whose metadata "
                     "is lost, empty), so a resumed run can go on; says how many")
    ver.set_defaults(fn=cmd_replay_verify)

    ep = rsub.add_parser("episodes", help="per-episode return, length and win, summarised by iteration or collector",
                         description="Episodes are computed region by region with dask (stores larger "
                         "than memory work); an episode whose start was overwritten by the ring is partial "
                         "and left out of the figures.")
    ep.add_argument("path", help=where)
    ep.add_argument("--by", choices=("iteration", "collector", "region"), default="iteration",
                    help="group the summary by this coordinate of the step that ended each episode")
    ep.add_argument("--csv", metavar="OUT", help="also write the per-episode table to this CSV file")
    ep.set_defaults(fn=cmd_replay_episodes)

    rean = rsub.add_parser("reanalyze", help="re-score stored transitions with a checkpoint (the marl-reanalyze flow)",
                         description="Rebuilds the run's learner from the store, restores a checkpoint "
                         "and writes its per-step scores (QMIX: q_taken, q_max, q_tot, td_error) into a "
                         "separate Zarr group aligned with the store, on a local Dask cluster.")
    rean.add_argument("run_dir", nargs="?", help="the run dir (holding replay/ and checkpoints/)")
    rean.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint step (default: the latest)")
    rean.add_argument("--out", metavar="PATH", help="output group (default <run_dir>/reanalysis/step-<STEP>)")
    rean.add_argument("--store", metavar="PATH", help="the replay store, if not <run_dir>/replay")
    rean.add_argument("--checkpoints", metavar="DIR", help="the checkpoint dir, if not <run_dir>/checkpoints")
    rean.add_argument("--scheduler", help="address of a running Dask scheduler (default: a new local cluster)")
    rean.add_argument("--workers", type=int, default=2, help="local cluster workers (default 2)")
    rean.set_defaults(fn=cmd_replay_reanalyze)

    ex = rsub.add_parser("export", help="export complete episodes to a Minari dataset",
                         description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ex.add_argument("path", help=where)
    ex.add_argument("--minari", required=True, metavar="DATASET_ID",
                    help="Minari dataset id, e.g. marl/smax-3m-qmix-v0")
    ex.add_argument("--out", metavar="DIR", help="Minari datasets root (default $MINARI_DATASETS_PATH "
                    "or ~/.minari/datasets)")
    ex.set_defaults(fn=cmd_replay_export)
