"""Multi-agent RL in JAX: envs, learners, rollouts; `marl.load_policy(DIR)` plays an exported team."""


def __getattr__(name):
    # lazy: `import marl.envs` should not pull in every learner and flax
    if name in ("load_policy", "Policy", "PolicyError"):
        from marl import policy

        return getattr(policy, name)
    raise AttributeError(f"module 'marl' has no attribute {name!r}")
