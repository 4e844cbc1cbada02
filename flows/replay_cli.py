"""`marl replay ...`: inspect replay stores offline."""

from __future__ import annotations

import os
import sys


def cmd_replay_info(args) -> int:
    import numpy as np

    from storage import ReplayStore, StoreError, open_replay

    try:
        store = ReplayStore.open(args.path)
        ds = open_replay(args.path)
    except StoreError as e:
        print(f"marl: {e}", file=sys.stderr)
        return 2
    attrs = store.attrs
    print(f"store:        {os.path.abspath(args.path)}")
    print(f"schema:       v{attrs.get('schema_version')}  env {attrs.get('env_id')}  algorithm {attrs.get('algorithm')}  seed {attrs.get('seed')}")
    print(f"committed:    {len(store.committed())} regions ({store.committed_steps()} steps x {store.n_envs} envs), "
          f"{store.total_regions_committed()} regions written in all, ring of {store.n_slots}")
    print("dims:         " + ", ".join(f"{k}={v}" for k, v in ds.sizes.items()))
    for name, var in ds.data_vars.items():
        print(f"  {name:14s} {str(var.dtype):8s} ({', '.join(var.dims)})")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.path) for f in fs)
    print(f"size on disk: {size / 2**20:.1f} MiB")
    if len(ds.step):
        print(f"iterations:   {int(np.min(ds.iteration))}..{int(np.max(ds.iteration))}")
    return 0


def add_commands(sub):
    p = sub.add_parser("replay", help="inspect replay stores")
    rsub = p.add_subparsers(dest="replay_command", required=True)
    info = rsub.add_parser("info", help="schema, env, dims, committed steps, size")
    info.add_argument("path")
    info.set_defaults(fn=cmd_replay_info)
