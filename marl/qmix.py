"""QMIX (Rashid et al., 2018) and its relatives VDN (Sunehag et al., 2018) and IQL: recurrent
per-agent Q-networks whose values are combined by a mixer, the one difference between them:

    qmix  a monotonic hypernetwork mixer conditioned on the global state
    vdn   Q_tot = sum of the agents' Q
    iql   no mixer: each agent learns its own Q on the team reward (independent learners)

Reads top to bottom:

    config -> agent network -> mixers -> acting (epsilon-greedy, masked) -> loss -> update

Agents share parameters and see their one-hot id. Targets are double-Q (online argmax,
target evaluation) through a target mixer; the target networks are copied every
`target_update_interval` updates. All of it is pure and jitted; the data comes from the
replay ring as fixed-length windows, which run across region boundaries.

A window starts anywhere in the ring, its agents' GRU memory zeroed there, or only at episode
starts (`episode_windows`, as pymarl and JaxMARL train on whole episodes). A window that
starts mid-episode can first replay `burn_in` steps with no loss, so the memory is warm where
the loss begins (R2D2). Targets bootstrap through a time-limit end and not through a real
one (`time_limit_bootstrap`; False treats every end as terminal); a step whose next state is
not stored (`transition.cut`) has no target.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from marl import buffer, encoders, transition
from marl.envs import EnvSpec
from marl.learner import Learner


@dataclasses.dataclass(frozen=True)
class Config:
    mixer: str = "qmix"  # "qmix", "vdn" or "none" (IQL)
    hidden: int = 64  # agent GRU width
    mixer_embed: int = 32
    hypernet_embed: int = 64
    # the std of the mixer's initial kernels, times Flax's default (LeCun normal): 1 keeps it;
    # JaxMARL's QMIX starts its mixer small (orthogonal, 0.001), so Q_tot starts near zero
    mixer_init_scale: float = 1.0
    lr: float = 5e-4
    # >0: the lr decays linearly to 0 over this many training iterations (regions), as
    # MAPPO's; 0 keeps it constant (pymarl's QMIX)
    anneal_lr_iterations: int = 0
    gamma: float = 0.99
    td_lambda: float = 0.0  # 0: one-step targets; >0: TD(lambda) targets over each window
    max_grad_norm: float = 10.0
    batch_size: int = 32  # windows per update
    seq_len: int = 32  # steps of each window that the loss covers
    # steps before them that only warm the GRU memory (R2D2's burn-in; no loss);
    # burn_in + seq_len <= steps per region
    burn_in: int = 0
    episode_windows: bool = False  # True: windows start only where an episode starts
    # each agent also sees its own previous action, one-hot (pymarl's obs_last_action; zero
    # at an episode's first step and, in training, at a window's first, like the memory)
    last_action: bool = False
    updates_per_region: int = 8  # gradient updates per newly collected region
    target_update_interval: int = 200  # in updates
    # True: a time limit (`truncated`) is not a terminal state, so targets bootstrap through
    # it and the step that hit it, whose next obs are already the reset obs, has no target
    # (pymarl's convention). False: every end zeroes the bootstrap, so a state that the
    # limit ends is worth only its reward: it tells a team that stalls until the limit what
    # stalling earns, at the cost of targets the obs cannot predict (they carry no clock)
    time_limit_bootstrap: bool = True
    eps_start: float = 1.0
    eps_end: float = 0.05
    eps_decay_steps: int = 100_000  # env steps over which epsilon decays linearly
    learning_starts: int = 5_000  # env steps in the store before the first update


ACTION_SPACES = ("discrete",)  # one Q-value per action
LAST_ACTION_NEEDS = ("last_action=true (the SMAX presets' default) needs vector observations and {env} "
                     "gives images; --set last_action=false")


# --------------------------------------------------------------------------- networks


class AgentRNN(nn.Module):
    """obs [..., agent, obs] (an image: through the conv encoder) + agent id -> Dense -> GRU
    -> Q per action. Memory is zeroed where `reset`."""

    hidden: int
    n_actions: int
    encoder: nn.Module | None = None  # image observations (marl.encoders)

    @nn.compact
    def __call__(self, carry, obs, reset):
        carry = jnp.where(reset[..., None], 0.0, carry)
        x = encoders.with_agent_ids(encoders.encode(self.encoder, obs))
        h = nn.relu(nn.Dense(self.hidden)(x))
        carry, h = nn.GRUCell(self.hidden)(carry, h)
        return carry, nn.Dense(self.n_actions)(h)


class Mixer(nn.Module):
    """Q_tot = elu(q . |W1(s)| + b1(s)) . |W2(s)| + V(s); abs weights keep dQ_tot/dQ_i >= 0.
    An image state goes through the conv encoder first."""

    embed: int
    hypernet_embed: int
    encoder: nn.Module | None = None  # an image state (marl.encoders)
    init_scale: float = 1.0  # times the LeCun normal std of every kernel (1: Flax's default)

    @nn.compact
    def __call__(self, q, state):  # q [..., agent], state [..., state_dim]
        n_agents = q.shape[-1]
        state = encoders.encode(self.encoder, state)
        init = nn.initializers.variance_scaling(self.init_scale**2, "fan_in", "truncated_normal")
        dense = lambda out: nn.Dense(out, kernel_init=init)
        hyper = lambda out: dense(out)(nn.relu(dense(self.hypernet_embed)(state)))
        w1 = jnp.abs(hyper(n_agents * self.embed)).reshape(*q.shape, self.embed)
        b1 = dense(self.embed)(state)
        w2 = jnp.abs(hyper(self.embed))
        v = dense(1)(nn.relu(dense(self.embed)(state)))[..., 0]
        h = nn.elu(jnp.einsum("...a,...ae->...e", q, w1) + b1)
        return jnp.sum(h * w2, axis=-1) + v


class SumMixer(nn.Module):
    """VDN: Q_tot = sum_i Q_i."""

    @nn.compact
    def __call__(self, q, state):
        return q.sum(axis=-1)


class NoMixer(nn.Module):
    """IQL: every agent's own Q is a target of its own (the trailing axis stays agents)."""

    @nn.compact
    def __call__(self, q, state):
        return q


MIXERS = {"qmix": None, "vdn": SumMixer, "none": NoMixer}


def lambda_returns(reward, terminated, next_value, next_cut, gamma: float, lam: float):
    """TD(lambda) targets along a window ([B, L-1] each), bootstrapping from the target
    Q_tot of the next step: G_t = r_t + gamma (1 - term_t) ((1 - lam) Q'_{t+1} + lam G_{t+1}),
    where G_{t+1} is Q'_{t+1} if step t+1 has no target of its own (`next_cut`: it is cut, or
    the window's last step). lam = 0 is one-step TD."""
    def step(g_next, inputs):
        r, term, v, v_cut = inputs
        g = r + gamma * (1.0 - term) * ((1.0 - lam) * v + lam * jnp.where(v_cut, v, g_next))
        return g, g

    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (reward, terminated, next_value, next_cut))
    _, g = jax.lax.scan(step, xs[2][-1], xs, reverse=True)
    return jnp.swapaxes(g, 0, 1)


def make_learner(spec: EnvSpec, config: Config):
    if not spec.discrete:
        raise ValueError(f"QMIX needs discrete actions and {spec.env_id} has continuous ones; "
                         "use a discrete env or an actor-critic preset")
    if config.mixer not in MIXERS:
        raise ValueError(f"unknown mixer {config.mixer!r}; valid: {', '.join(MIXERS)}")
    if config.last_action and spec.obs_shape:
        raise ValueError(LAST_ACTION_NEEDS.format(env=spec.env_id))
    agent = AgentRNN(config.hidden, spec.n_actions, encoders.for_image(spec.obs_shape))
    mixer = (Mixer(config.mixer_embed, config.hypernet_embed, encoders.for_image(spec.state_shape),
                   config.mixer_init_scale)
             if config.mixer == "qmix" else MIXERS[config.mixer]())
    # optax counts updates; an iteration is one region's updates_per_region of them
    lr = (optax.linear_schedule(config.lr, 0.0, config.anneal_lr_iterations * config.updates_per_region)
          if config.anneal_lr_iterations > 0 else config.lr)
    optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr))
    n_agents = spec.n_agents

    # the acting carry: the GRU memory, then (last_action) the previous action one-hot
    last_width = spec.n_actions if config.last_action else 0

    def init_carry(n_envs):
        return jnp.zeros((n_envs, n_agents, config.hidden + last_width))

    def agent_input(obs, last):
        """What the agent network sees: the observation (and the previous action)."""
        return jnp.concatenate([obs, last.astype(obs.dtype)], axis=-1) if last_width else obs

    def init(key) -> dict:
        k_agent, k_mixer, key = jax.random.split(key, 3)
        (obs_shape, obs_dtype), (state_shape, state_dtype) = spec.agent_obs, spec.global_state
        obs = agent_input(jnp.zeros((1, n_agents, *obs_shape), obs_dtype), jnp.zeros((1, n_agents, last_width)))
        params = {
            "agent": agent.init(k_agent, jnp.zeros((1, n_agents, config.hidden)), obs, jnp.zeros((1, n_agents), bool)),
            "mixer": mixer.init(k_mixer, jnp.zeros((1, n_agents)), jnp.zeros((1, *state_shape), state_dtype)),
        }
        return {"params": params, "target_params": params, "opt_state": optimizer.init(params),
                "updates": jnp.array(0, jnp.int32), "key": key}

    # ------------------------------------------------------------------------ acting

    def act(params, carry, obs, avail, reset, key, explore):
        """Epsilon-greedy over available actions; params are the agent network's."""
        reset = jnp.broadcast_to(reset[:, None], obs.shape[:2])
        memory, last = carry[..., :config.hidden], jnp.where(reset[..., None], 0.0, carry[..., config.hidden:])
        memory, q = agent.apply(params, memory, agent_input(obs, last), reset)
        q = jnp.where(avail, q, -jnp.inf)
        greedy = jnp.argmax(q, axis=-1)
        k_rand, k_explore = jax.random.split(key)
        random = jax.random.categorical(k_rand, jnp.where(avail, 0.0, -jnp.inf))
        explore_mask = jax.random.uniform(k_explore, greedy.shape) < explore["epsilon"]
        action = jnp.where(explore_mask, random, greedy).astype(jnp.int32)
        if last_width:
            memory = jnp.concatenate([memory, jax.nn.one_hot(action, last_width, dtype=memory.dtype)], axis=-1)
        return action, memory, {}

    def policy_params(train_state):
        return train_state["params"]["agent"]

    epsilon = optax.linear_schedule(config.eps_start, config.eps_end, config.eps_decay_steps)

    def exploration(env_steps):
        return {"epsilon": jnp.float32(epsilon(env_steps))}

    greedy = {"epsilon": jnp.float32(0.0)}

    # -------------------------------------------------------------------------- loss

    def unroll(agent_params, obs, reset, action):
        """Q-values over a window: obs [B, L, agent, obs...], reset [B, L], action [B, L,
        agent] (for last_action) -> [B, L, agent, act]."""
        batch = obs.shape[0]
        last = jax.nn.one_hot(action, last_width, dtype=jnp.float32)
        last = jnp.concatenate([jnp.zeros_like(last[:, :1]), last[:, :-1]], axis=1)
        obs = agent_input(obs, jnp.where(reset[..., None, None], 0.0, last))
        x = jnp.swapaxes(obs, 0, 1)  # time-major for scan
        r = jnp.broadcast_to(jnp.swapaxes(reset, 0, 1)[..., None], x.shape[:3])

        def step(carry, inputs):
            return agent.apply(agent_params, carry, *inputs)

        _, q = jax.lax.scan(step, jnp.zeros((batch, n_agents, config.hidden)), (x, r))
        return jnp.swapaxes(q, 0, 1)

    def td_terms(params, target_params, batch):
        """Q-values and TD targets along windows [B, L]: the loss and reanalysis share it.
        `has_target` [B, L-1]: step t is not cut."""
        # memory restarts at each episode start inside the window (and at its start)
        reset = batch["first"].at[:, 0].set(True)
        real_end = transition.real_end(batch, config.time_limit_bootstrap)
        cut = transition.cut(batch, config.time_limit_bootstrap)
        q = unroll(params["agent"], batch["obs"], reset, batch["action"])
        q_target = unroll(target_params["agent"], batch["obs"], reset, batch["action"])
        avail = batch["avail_actions"]
        chosen = jnp.take_along_axis(q, batch["action"][..., None], axis=-1)[..., 0]
        # double Q: the online net picks the next action, the target net scores it
        next_action = jnp.argmax(jnp.where(avail, q, -jnp.inf), axis=-1)[:, 1:]
        next_q = jnp.take_along_axis(q_target[:, 1:], next_action[..., None], axis=-1)[..., 0]
        q_tot = mixer.apply(params["mixer"], chosen, batch["state"])  # [B, L] (IQL: [B, L, agent])
        next_q_tot = mixer.apply(target_params["mixer"], next_q, batch["state"][:, 1:])
        reward = batch["reward"][:, :-1].mean(axis=-1)
        terminated = real_end[:, :-1].astype(jnp.float32)
        next_cut = jnp.concatenate([cut[:, 1:], jnp.ones_like(cut[:, :1])], axis=1)
        returns = lambda v: lambda_returns(reward, terminated, v, next_cut, config.gamma, config.td_lambda)
        # IQL: one target per agent, all on the team reward
        target = returns(next_q_tot) if next_q_tot.ndim == 2 else jax.vmap(returns, -1, -1)(next_q_tot)
        td = q_tot[:, :-1] - jax.lax.stop_gradient(target)
        return {"q": q, "chosen": chosen, "q_tot": q_tot, "td": td, "has_target": ~cut}

    def loss_fn(params, target_params, batch):
        """Mean squared TD error over the steps that have a target, past the burn-in."""
        terms = td_terms(params, target_params, batch)
        td = terms["td"]
        past_burn_in = jnp.arange(td.shape[1]) >= config.burn_in
        weight = (terms["has_target"] & past_burn_in[None, :]).astype(jnp.float32)
        if td.ndim == 3:  # IQL: a TD error per agent
            weight = weight[..., None] * jnp.ones_like(td)
        counted = jnp.maximum(weight.sum(), 1.0)
        loss = jnp.sum(weight * td**2) / counted
        return loss, {"loss": loss, "q_tot": terms["q_tot"].mean(),
                      "td_abs": jnp.sum(weight * jnp.abs(td)) / counted}

    @jax.jit
    def score_arrays(train_state, batch):
        terms = td_terms(train_state["params"], train_state["target_params"], batch)
        pad = lambda x: jnp.concatenate([x, jnp.full_like(x[:, :1], jnp.nan)], axis=1)
        q_max = jnp.max(jnp.where(batch["avail_actions"], terms["q"], -jnp.inf), axis=-1)
        td = terms["td"]
        no_target = ~terms["has_target"] if td.ndim == 2 else ~terms["has_target"][..., None]
        return {"q_taken": terms["chosen"], "q_max": q_max, "q_tot": terms["q_tot"],
                "td_error": pad(jnp.where(no_target, jnp.nan, td))}

    def score(train_state, batch):
        """Per-step Q-values and TD errors of stored windows (NaN where a step has no
        target: the window's last step and cut steps), each with its dims after (step, env)."""
        out = score_arrays(train_state, batch)
        iql = config.mixer == "none"
        dims = {"q_taken": ("agent",), "q_max": ("agent",),
                "q_tot": ("agent",) if iql else (), "td_error": ("agent",) if iql else ()}
        return {k: (v, dims[k]) for k, v in out.items()}

    # ------------------------------------------------------------------------ update

    def update(train_state, batch):
        """One gradient step on a batch of windows, then the periodic target copy."""
        grads, metrics = jax.grad(loss_fn, has_aux=True)(
            train_state["params"], train_state["target_params"], batch)
        updates, opt_state = optimizer.update(grads, train_state["opt_state"], train_state["params"])
        params = optax.apply_updates(train_state["params"], updates)
        n = train_state["updates"] + 1
        target_params = optax.periodic_update(params, train_state["target_params"], n,
                                              config.target_update_interval)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["lr"] = jnp.asarray(lr(n - 1) if callable(lr) else lr, jnp.float32)  # this step's
        return {**train_state, "params": params, "target_params": target_params,
                "opt_state": opt_state, "updates": n}, metrics

    window = config.burn_in + config.seq_len

    def train(train_state, arrays, ring, n_updates: int):
        """n_updates of (sample windows from the ring mirror, update), fused in one scan."""
        starts = buffer.window_starts(arrays, ring, window, config.episode_windows)

        def body(state, _):
            key, sample_key = jax.random.split(state["key"])
            batch = buffer.sample_windows(sample_key, arrays, ring, starts, config.batch_size, window)
            state, metrics = update({**state, "key": key}, batch)
            return state, metrics

        train_state, metrics = jax.lax.scan(body, train_state, None, n_updates)
        return train_state, jax.tree.map(jnp.mean, metrics)

    return Learner(
        name={"qmix": "qmix", "vdn": "vdn", "none": "iql"}[config.mixer], config=config, spec=spec, init=jax.jit(init), act=act,
        init_carry=init_carry, policy_params=policy_params, exploration=exploration,
        greedy=greedy, update=jax.jit(update),
        train=jax.jit(train, static_argnums=3),
        score=score, loss_fn=loss_fn, agent=agent, mixer=mixer)
