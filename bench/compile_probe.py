"""Where a device's first minutes go, per env family: tracing, XLA compile, the first call
and the steady-state call of a vmapped rollout, timed apart, each case in its own process
under its own time limit (a case that hangs is reported as such and the next one runs).

Cases (N envs, T steps):
  smax-step       one vmapped jaxmarl SMAX 3m step (HeuristicEnemySMAX), no scan
  smax-random     jaxmarl SMAX 3m, random valid actions, scanned over T steps
  smax-collector  the collect stage's own rollout (marl.rollout.make_collector), QMIX acting
  mpe-collector   the same for MAPPO on mpe:simple_spread (the family that runs fast)

    python bench/compile_probe.py [--cases smax-step,smax-random,...] [--envs 64 4096]
                                  [--steps 32] [--case-timeout-s 120]

Prints one JSON row per phase as it is measured (partial cases still say how far they got)
and writes bench/results/compile_probe.{json,md,png} (or $MARL_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = ("smax-step", "smax-random", "smax-collector", "mpe-collector")
PHASES = ("lower", "compile", "first", "steady")


def _build(case: str, n_envs: int, n_steps: int):
    """(jitted fn, its args) for one case."""
    import jax
    import jax.numpy as jnp

    if case in ("smax-step", "smax-random"):
        from jaxmarl.environments.smax import HeuristicEnemySMAX, map_name_to_scenario

        env = HeuristicEnemySMAX(scenario=map_name_to_scenario("3m"))
        agents = env.agents
        _, state = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(0), n_envs))

        def random_actions(key, state):
            avail = jax.vmap(env.get_avail_actions)(state)
            keys = jax.random.split(key, len(agents))
            # a uniformly random available action per agent (logits -inf where unavailable)
            return {a: jax.random.categorical(k, jnp.where(avail[a] > 0, 0.0, -jnp.inf))
                    for k, a in zip(keys, agents)}

        def one_step(state, key):
            act_key, step_key = jax.random.split(key)
            _, state, reward, dones, _ = jax.vmap(env.step)(
                jax.random.split(step_key, n_envs), state, random_actions(act_key, state))
            return state, reward[agents[0]].sum() + dones["__all__"].sum()

        if case == "smax-step":
            return jax.jit(one_step), (state, jax.random.PRNGKey(1))

        def scanned(state, key):
            return jax.lax.scan(lambda s, k: one_step(s, k), state, jax.random.split(key, n_steps))

        return jax.jit(scanned), (state, jax.random.PRNGKey(1))

    from marl import algos, envs, rollout

    env_id, algo = {"smax-collector": ("smax:3m", "qmix"), "mpe-collector": ("mpe:simple_spread", "mappo")}[case]
    env = envs.make(env_id)
    learner = algos.make_learner(algo, env.spec, algos.config_for(algo))
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n_envs, n_steps)
    params = learner.policy_params(learner.init(jax.random.PRNGKey(0)))
    explore = learner.exploration(jnp.float32(10**6))
    return collect, (params, init(jax.random.PRNGKey(1)), explore)


def run_case(case: str, n_envs: int, n_steps: int):
    """Child: times each phase and prints it at once (the parent may kill this process)."""
    import jax

    def say(phase, seconds, **extra):
        print(json.dumps({"case": case, "n_envs": n_envs, "n_steps": n_steps, "phase": phase,
                          "s": round(seconds, 4), **extra}), flush=True)

    started = time.perf_counter()
    fn, args = _build(case, n_envs, n_steps)
    say("build", time.perf_counter() - started, device=str(jax.devices()[0]))
    t = time.perf_counter()
    lowered = fn.lower(*args)
    say("lower", time.perf_counter() - t, hlo_chars=len(lowered.as_text()))
    t = time.perf_counter()
    compiled = lowered.compile()
    say("compile", time.perf_counter() - t)
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    say("first", time.perf_counter() - t)
    t, repeats = time.perf_counter(), 3
    for _ in range(repeats):
        jax.block_until_ready(compiled(*args))
    seconds = (time.perf_counter() - t) / repeats
    steps = n_envs * (1 if case == "smax-step" else n_steps)
    say("steady", seconds, env_steps_per_s=round(steps / seconds))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--envs", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--case-timeout-s", type=float, default=120.0)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_case(args.child[0], int(args.child[1]), int(args.child[2]))

    import report

    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"--cases: unknown case {case!r}; known: {', '.join(CASES)}")
        for n in args.envs:
            command = [sys.executable, os.path.abspath(__file__), "--child", case, str(n), str(args.steps)]
            began = time.perf_counter()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout_s)
                out, status = done.stdout, ("ok" if done.returncode == 0 else f"exit {done.returncode}")
                if done.returncode:
                    print(done.stderr[-2000:], file=sys.stderr)
            except subprocess.TimeoutExpired as expired:
                out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
                status = f"timed out after {args.case_timeout_s:g} s"
            phases = {}
            for line in out.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    print(line, flush=True)
                    phases[row["phase"]] = row
            rows.append({"case": case, "n_envs": n, "n_steps": args.steps, "status": status,
                         "wall_s": round(time.perf_counter() - began, 2),
                         "device": phases.get("build", {}).get("device", "?"),
                         **{f"{p}_s": phases[p]["s"] for p in ("build", *PHASES) if p in phases},
                         "env_steps_per_s": phases.get("steady", {}).get("env_steps_per_s")})
    table = [[r["case"], f"{r['n_envs']:,}", r["device"],
              *(f"{r[f'{p}_s']:.2f}" if f"{p}_s" in r else "-" for p in ("build", *PHASES)),
              f"{r['env_steps_per_s']:,}" if r["env_steps_per_s"] else "-", r["status"]] for r in rows]
    headers = ["case", "N", "device", "build s", "trace+lower s", "compile s", "first call s",
               "steady call s", "env steps/s", "status"]
    plt = report.save("compile_probe", {"rows": rows, "steps": args.steps}, headers,
                      ["---"] * 3 + ["---:"] * 6 + ["---"], table)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['case']}\nN={r['n_envs']:,}" for r in rows]
    for offset, phase in ((-0.2, "compile"), (0.2, "steady")):
        ax.bar([i + offset for i in range(len(rows))], [r.get(f"{phase}_s", 0) for r in rows], 0.4, label=f"{phase} s")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_title(f"compile vs steady call, T={args.steps} ({rows[0]['device'] if rows else '?'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(report.figure_path("compile_probe"))


if __name__ == "__main__":
    main()
