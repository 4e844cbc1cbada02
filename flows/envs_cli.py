"""`marl envs`: every env id the registry knows, with its family, agents, spaces and backend.

    marl envs [FILTER]     one line per id (FILTER: only ids containing it, e.g. hanabi)
"""

from __future__ import annotations

import sys
import warnings


def describe(env_id: str) -> dict:
    """One row of the listing: what `marl train --env ENV_ID` would train on, or why it cannot."""
    from marl import envs

    kind, _, name = env_id.partition(":")
    family = envs.family_of(name) if kind == "jaxmarl" else {"pz": "pettingzoo"}.get(kind, kind)
    why = envs.why_not(env_id)
    if why:
        return {"id": env_id, "family": family, "unavailable": why}
    env = envs.make(env_id)
    spec, sizes = env.spec, sorted(set(env.action_sizes))
    if spec.discrete:
        actions = f"discrete {spec.n_actions}" + (f" (own {'/'.join(map(str, sizes))})" if len(sizes) > 1 else "")
    else:
        actions = f"continuous {spec.action_dim} in [{spec.action_low:g}, {spec.action_high:g}]" + \
            (f" (own {'/'.join(map(str, sizes))})" if len(sizes) > 1 else "")
    return {"id": env_id, "family": family, "agents": spec.n_agents, "obs": spec.obs_dim,
            "state": spec.state_dim, "obs_shape": spec.obs_shape, "state_shape": spec.state_shape,
            "actions": actions, "space": "discrete" if spec.discrete else "continuous",
            "masked": spec.has_avail_actions, "limit": spec.episode_limit,
            "backend": "JAX" if spec.backend == "jax" else "CPU", "teams": env.teams}


def _teams(teams: dict) -> str:
    """`, teams adversary(1)/agent(2)` where the agents' names make more than one team."""
    if len(teams) < 2:
        return ""
    return ", teams " + "/".join(f"{name}({len(members)})" for name, members in teams.items())


def _size(dim: int, shape: tuple) -> str:
    """An observation or state as `marl envs` shows it: an image's HxWxC, a vector's size."""
    return "x".join(map(str, shape)) if shape else str(dim)


def cmd_envs(args) -> int:
    from marl import envs

    ids = [i for i in envs.env_ids() if not args.filter or args.filter.lower() in i.lower()]
    if not ids:
        print(f"marl: no env id contains {args.filter!r}; run `marl envs` for them all", file=sys.stderr)
        return 2
    with warnings.catch_warnings():  # jaxmarl's deprecation notes are not about the listing
        warnings.simplefilter("ignore")
        rows = [describe(i) for i in ids]
    # images as HxWxC (pistonball's 457x120x3), vectors as their size; each column as wide
    # as its widest entry (atari's limit is 100000 steps)
    sizes = {r["id"]: (_size(r["obs"], r["obs_shape"]), _size(r["state"], r["state_shape"]))
             for r in rows if "unavailable" not in r}
    width = max(len(r["id"]) for r in rows)
    obs_w = max([len("obs"), *(len(o) for o, _ in sizes.values())])
    state_w = max([len("state"), *(len(s) for _, s in sizes.values())])
    limit_w = max([len("limit"), *(len(str(r["limit"])) for r in rows if "limit" in r)])
    print(f"{'id':{width}s}  {'family':13s} {'agents':>6s} {'obs':>{obs_w}s} {'state':>{state_w}s}  "
          f"{'backend':7s} {'limit':>{limit_w}s}  actions")
    for r in rows:
        if "unavailable" in r:
            print(f"{r['id']:{width}s}  {r['family']:13s} not available here: {r['unavailable']}")
            continue
        obs, state = sizes[r["id"]]
        print(f"{r['id']:{width}s}  {r['family']:13s} {r['agents']:>6d} {obs:>{obs_w}s} "
              f"{state:>{state_w}s}  {r['backend']:7s} {r['limit']:>{limit_w}d}  {r['actions']}"
              f"{', masked' if r['masked'] else ''}{_teams(r['teams'])}")
    print("any other importable PettingZoo ParallelEnv: pz:<module>.<env> (CPU); env kwargs: "
          "--set env_kwargs='{\"max_steps\": 50}'; teams: --set train_team=TEAM opponent=random|noop|EXPORT_DIR, or train_team=each")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("envs", help="list every env id with its family, agents, spaces and backend",
                       description="List every env id `marl train --env` takes: its family, agent count, "
                       "observation and state sizes, whether it steps in JAX (jit/vmap, any worker) or on "
                       "a CPU (PettingZoo), its episode limit and its actions (discrete or continuous; "
                       "'own' sizes where agents differ and are padded; 'masked' where the env restricts "
                       "actions; 'teams' where the agents' names make competing teams, each of which `--set "
                       "train_team=TEAM` trains against a fixed opponent). Ids that need a missing package say which.")
    p.add_argument("filter", nargs="?", help="only ids containing this, e.g. hanabi or smax")
    p.set_defaults(fn=cmd_envs)
