"""MADDPG (Lowe et al., 2017): deterministic per-agent actors on local observations, trained
through centralised critics Q_i(all observations, all actions), one per agent.

Reads top to bottom:

    config -> networks -> actions (continuous / Gumbel-softmax) -> acting -> losses -> update

Every agent has its own actor and its own critic (separate parameters, stacked along a
leading agent axis and applied with `vmap`), as in the original algorithm; with
`share_params` one actor and one critic serve all agents, told apart by a one-hot id. Continuous
actions are tanh outputs mapped to the env's bounds, explored with clipped Gaussian noise
whose scale decays with env steps, or (`learned_std`, as PARL's continuous MADDPG) sampled
as tanh(mean + std * N(0, 1)) with the std a second actor head, the sample also being what
the actor is trained through and what the target actors answer with. Discrete actions use the straight-through
Gumbel-softmax: a hard one-hot forward, the soft sample's gradient backward; unavailable
actions get a logit of -1e9, so they are never chosen. Targets use target actors and
critics that follow the online ones by Polyak averaging (tau). With `twin_critics` each
agent has two critics and bootstraps on the smaller target value, TD3's fix for
overestimated Q values (as MATD3).

Training data are (s, a, r, end, s') transitions: windows of two steps sampled from the
replay ring (n + 1 steps for `n_step` returns; they run across region boundaries). The store
records obs and actions at step t and the reward and end (`terminated` or `truncated`) of
the step t led to; after an end the next obs are the reset obs, so a `terminated` end zeroes
the bootstrap, and a time limit's transition is left out while the ones before it bootstrap
through the limit (`time_limit_bootstrap`, the default; False treats every end as terminal).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from marl import buffer, encoders, transition
from marl.envs import EnvSpec
from marl.learner import Learner

MASKED_LOGIT = -1e9  # an unavailable discrete action's logit: zero probability, never argmax
ACTION_SPACES = ("discrete", "continuous")  # Gumbel-softmax actors for discrete ones
LOG_STD_MIN, LOG_STD_MAX = -10.0, 2.0  # learned_std: keeps exp(log std) finite early on


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 64  # two hidden layers, actors and critics
    actor_lr: float = 1e-2
    critic_lr: float = 1e-2
    gamma: float = 0.95
    # n-step returns: the critic's target sums n rewards before it bootstraps (n - 1 of
    # them from the replay's older behaviour, a bias that stays small at low noise)
    n_step: int = 1
    tau: float = 0.01  # Polyak rate: target <- (1 - tau) target + tau online, every update
    max_grad_norm: float = 0.5  # per agent, as PARL
    batch_size: int = 1024  # transitions per update
    updates_per_region: int = 32  # gradient updates per newly collected region
    learning_starts: int = 25_600  # env steps in the store before the first update
    actor_reg: float = 1e-3  # weight of the squared pre-activation penalty (PARL, OpenAI)
    # continuous exploration: Gaussian noise, std in units of half the action range, decayed
    # linearly from noise_start to noise_end over noise_decay_steps env steps, then clipped
    noise_start: float = 0.3
    noise_end: float = 0.05
    noise_decay_steps: int = 500_000
    # continuous, True: the actor also outputs a log std per action dim (PARL 2022): exploring
    # and training use tanh(mean + std * noise), the greedy action is tanh(mean), and the
    # noise_* schedule is unused; the regulariser covers the log std too, pulling it to 0
    learned_std: bool = False
    # TD3's fix for Q overestimation (MATD3, Ackermann et al. 2019): two critics per agent,
    # both fitted to the smaller of their two target values; the actor follows the first
    twin_critics: bool = False
    actor_every: int = 1  # TD3's policy delay: one actor step per this many critic steps
    gumbel_temperature: float = 1.0  # discrete actions
    # one actor and one critic for all agents, told apart by a one-hot agent id (each
    # network then learns from every agent's transitions); False: one per agent (original)
    share_params: bool = False
    # True: an end the store marks `truncated` (a time limit: MPE's every end) is not a
    # terminal state, so the critic bootstraps through it (observations carry no clock, so
    # value targets that drop to zero at step 25 cannot be fitted) and the transitions that
    # end an episode by truncation, whose next obs are already the reset obs, are left out
    # of the loss; a `terminated` end (SMAX: a side wiped out) still zeroes the bootstrap.
    # False: every end (terminated | truncated) zeroes the bootstrap
    time_limit_bootstrap: bool = True


# --------------------------------------------------------------------------- networks


class MLP(nn.Module):
    """Two ReLU layers and a linear head: the actor (obs -> action) and critic (-> Q). With
    image observations the images go through the conv encoder first and their features come
    before the rest of the input: [..., H, W, C] (an actor's own) or [..., agent, H, W, C]
    (a critic's, every agent's features side by side)."""

    hidden: int
    out: int
    encoder: nn.Module | None = None  # image observations (marl.encoders)

    @nn.compact
    def __call__(self, x, images=None):
        if images is not None:
            x = jnp.concatenate([self.encoder(images).reshape(*x.shape[:-1], -1), x], axis=-1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.out)(x)


def masked_logits(logits, avail):
    return jnp.where(avail, logits, MASKED_LOGIT)


def gumbel_straight_through(key, logits, avail, temperature: float = 1.0):
    """A hard one-hot Gumbel-softmax sample over the available actions whose gradient is
    the soft sample's (straight-through)."""
    g = jax.random.gumbel(key, logits.shape)
    soft = jax.nn.softmax((masked_logits(logits, avail) + g) / temperature)
    hard = jax.nn.one_hot(jnp.argmax(soft, axis=-1), logits.shape[-1])
    return hard + soft - jax.lax.stop_gradient(soft)


def transitions(windows, gamma: float, time_limit_bootstrap: bool, n_step: int = 1):
    """[B, L] windows -> n-step transitions from every start with n steps after it, flattened
    to [B(L-n)]: (s, a) of the start, the discounted sum of the rewards up to the bootstrap
    step, its obs s' and the discount on Q(s'), and the transition's weight in the loss.

    The first stop inside the n steps ends the sum:
    - a real end (`terminated`; without time_limit_bootstrap, every end): the rewards up to
      and including it count and there is no bootstrap;
    - a cut (`transition.cut`: a time limit, or a collector's restart; without
      time_limit_bootstrap only the restart): the sum stops before it and bootstraps on its
      obs, a real state of the same episode (the obs after it are the next episode's); a
      transition that starts at a cut has no target (weight 0)."""
    length = windows["terminated"].shape[1]
    steps = jnp.arange(n_step)
    real_end = transition.real_end(windows, time_limit_bootstrap)
    cut = transition.cut(windows, time_limit_bootstrap)
    cut = jnp.concatenate([cut, jnp.zeros_like(cut[:, :1])], axis=1)  # [B, L]

    def from_start(t):
        window = lambda x, size: jax.lax.dynamic_slice_in_dim(x, t, size, axis=1)
        real, stop = window(real_end, n_step), window(real_end | cut, n_step)  # [B, n]
        # s: the first stop (n where there is none); m: the step whose obs bootstrap
        s = jnp.where(stop.any(axis=1), jnp.argmax(stop, axis=1), n_step)
        s_real = jnp.take_along_axis(jnp.pad(real, ((0, 0), (0, 1))), s[:, None], axis=1)[:, 0]
        counted = ((steps[None] < s[:, None]) | ((steps[None] == s[:, None]) & s_real[:, None]))
        discount = jnp.where(s_real, 0.0, gamma ** s.astype(jnp.float32))
        weight = jnp.where(~s_real & (s == 0), 0.0, 1.0)
        m = jnp.where(s_real, 0, s)  # a real end does not bootstrap: any obs will do

        def at(x, i):  # x at step i (per window) of this start's n + 1 steps
            return jnp.take_along_axis(window(x, n_step + 1), i.reshape(-1, 1, *[1] * (x.ndim - 2)), axis=1)[:, 0]

        first = lambda x: window(x, 1)[:, 0]
        return {"obs": first(windows["obs"]), "action": first(windows["action"]),
                "avail": first(windows["avail_actions"]),
                "reward": jnp.sum((gamma**steps * counted)[..., None] * window(windows["reward"], n_step),
                                  axis=1),
                "discount": discount, "weight": weight,
                "next_obs": at(windows["obs"], m), "next_avail": at(windows["avail_actions"], m)}

    # [B, L-n] flattened window-major, the layout that score() reshapes back
    per_start = jax.vmap(from_start, out_axes=1)(jnp.arange(length - n_step))
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), per_start)


def make_learner(spec: EnvSpec, config: Config):
    n_agents, discrete = spec.n_agents, spec.discrete
    act_size = spec.n_actions if discrete else spec.action_dim
    learned_std = config.learned_std and not discrete
    # image observations: each actor and each critic has a conv encoder of its own
    actor = MLP(config.hidden, 2 * act_size if learned_std else act_size, encoders.for_image(spec.obs_shape))
    n_q = 2 if config.twin_critics else 1  # critics per agent
    # twin: two independent MLPs, their outputs on the last axis
    critic_cls = nn.vmap(MLP, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=None, out_axes=-1, axis_size=2) if config.twin_critics else MLP
    critic = critic_cls(config.hidden, 1, encoders.for_image(spec.obs_shape))
    low, high = spec.action_low, spec.action_high
    # networks live stacked on a leading axis; agent i uses network net_of[i]
    n_nets = 1 if config.share_params else n_agents
    net_of = jnp.zeros(n_agents, jnp.int32) if config.share_params else jnp.arange(n_agents)
    agent_ids = jnp.eye(n_agents) if config.share_params else jnp.zeros((n_agents, 0))
    joint_size = n_agents * (spec.obs_dim + act_size)

    def per_agent(params):
        """Each agent's network parameters, [agent, ...] (shared ones gathered n times, so
        their gradients sum over agents)."""
        return jax.tree.map(lambda p: p[net_of], params)

    def clipped_adam(lr):
        return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr))

    actor_opt, critic_opt = clipped_adam(config.actor_lr), clipped_adam(config.critic_lr)

    def init_carry(n_envs):
        return jnp.zeros((n_envs, 0), jnp.float32)  # feed-forward: no memory

    def init(key) -> dict:
        k_actor, k_critic, key = jax.random.split(key, 3)
        if spec.obs_shape:  # the images apart, through the encoder
            image = jnp.zeros((1, *spec.obs_shape), spec.agent_obs[1])
            obs, joint = (jnp.zeros((1, agent_ids.shape[1])), image), (
                jnp.zeros((1, n_agents * act_size + agent_ids.shape[1])), image[:, None].repeat(n_agents, 1))
        else:
            obs = (jnp.zeros((1, spec.obs_dim + agent_ids.shape[1])),)
            joint = (jnp.zeros((1, joint_size + agent_ids.shape[1])),)
        params = {
            "actor": jax.vmap(actor.init, (0, *[None] * len(obs)))(jax.random.split(k_actor, n_nets), *obs),
            "critic": jax.vmap(critic.init, (0, *[None] * len(joint)))(jax.random.split(k_critic, n_nets), *joint),
        }
        return {"params": params, "target_params": params,
                "actor_opt": jax.vmap(actor_opt.init)(params["actor"]),
                "critic_opt": jax.vmap(critic_opt.init)(params["critic"]),
                "updates": jnp.array(0, jnp.int32), "key": key}

    # ------------------------------------------------------------------------ actions

    def to_env(u):
        """[-1, 1] (tanh) -> the env's [low, high]."""
        return low + (u + 1.0) * 0.5 * (high - low)

    def from_env(a):
        return 2.0 * (a - low) / (high - low) - 1.0

    def actor_outputs(actor_params, obs):
        """obs [..., agent, obs_dim] -> each agent's actor output [..., agent, act_size]."""
        if spec.obs_shape:  # [..., agent, H, W, C]: each actor its own agent's image
            ids = jnp.broadcast_to(agent_ids, (*obs.shape[:-3], agent_ids.shape[1]))
            return jax.vmap(actor.apply, in_axes=(0, -2, -4), out_axes=-2)(per_agent(actor_params), ids, obs)
        ids = jnp.broadcast_to(agent_ids, (*obs.shape[:-1], agent_ids.shape[1]))
        x = jnp.concatenate([obs, ids], axis=-1)
        return jax.vmap(actor.apply, in_axes=(0, -2), out_axes=-2)(per_agent(actor_params), x)

    def squashed_sample(out, key, scale=1.0):
        """learned_std: tanh(mean + scale * std * noise) from the actor's [mean, log std]."""
        mean, log_std = jnp.split(out, 2, axis=-1)
        std = jnp.exp(jnp.clip(log_std, LOG_STD_MIN, LOG_STD_MAX))
        return jnp.tanh(mean + scale * std * jax.random.normal(key, mean.shape))

    def policy_actions(actor_params, obs, avail, key):
        """What the actors do in training (critic inputs): [..., agent, act_size], and the
        actors' raw outputs (for the regulariser)."""
        out = actor_outputs(actor_params, obs)
        if discrete:
            return gumbel_straight_through(key, out, avail, config.gumbel_temperature), out
        if learned_std:
            return squashed_sample(out, key), out
        return jnp.tanh(out), out

    def critic_actions(action):
        """Stored actions as critic inputs: one-hot (discrete) or scaled to [-1, 1]."""
        if discrete:
            return jax.nn.one_hot(action, act_size)
        return from_env(action)

    def critic_q(p, agent_id, obs, actions):
        """One agent's Q(all obs, all actions), each of its n_q critics: obs [B, agent, obs],
        actions [B, agent, act] -> [B, n_q]."""
        batch = obs.shape[0]
        if spec.obs_shape:  # every agent's image through this critic's own encoder
            x = jnp.concatenate([actions.reshape(batch, -1),
                                 jnp.broadcast_to(agent_id, (batch, agent_id.shape[0]))], axis=-1)
            return critic.apply(p, x, obs).reshape(batch, n_q)
        x = jnp.concatenate([obs.reshape(batch, -1), actions.reshape(batch, -1),
                             jnp.broadcast_to(agent_id, (batch, agent_id.shape[0]))], axis=-1)
        return critic.apply(p, x).reshape(batch, n_q)

    def q_values(critic_params, obs, actions):
        """Q_i(all obs, all actions) for every agent i -> [B, agent, n_q]."""
        q = jax.vmap(critic_q, in_axes=(0, 0, None, None))(per_agent(critic_params), agent_ids, obs, actions)
        return jnp.moveaxis(q, 0, 1)

    # ------------------------------------------------------------------------ acting

    def act(params, carry, obs, avail, reset, key, explore):
        """params are the actors'. Continuous: tanh + clipped Gaussian noise of std
        explore["noise_std"] (learned_std: the actor's own sample when explore["sample"] > 0,
        else tanh(mean)); discrete: a Gumbel-max sample over available actions when
        explore["sample"] > 0, else the greedy available action."""
        out = actor_outputs(params, obs)
        if discrete:
            logits = masked_logits(out, avail)
            g = jax.random.gumbel(key, logits.shape) * (explore["sample"] > 0)
            actions = jnp.argmax(logits / config.gumbel_temperature + g, axis=-1).astype(jnp.int32)
            return actions, carry, {}
        if learned_std:
            return to_env(squashed_sample(out, key, explore["sample"])).astype(jnp.float32), carry, {}
        noise = explore["noise_std"] * jax.random.normal(key, out.shape)
        u = jnp.clip(jnp.tanh(out) + noise, -1.0, 1.0)
        return to_env(u).astype(jnp.float32), carry, {}

    def policy_params(train_state):
        return train_state["params"]["actor"]

    noise_std = optax.linear_schedule(config.noise_start, config.noise_end, config.noise_decay_steps)

    def exploration(env_steps):
        return {"noise_std": jnp.float32(noise_std(env_steps)), "sample": jnp.float32(1.0)}

    greedy = {"noise_std": jnp.float32(0.0), "sample": jnp.float32(0.0)}

    # ------------------------------------------------------------------------ losses

    def td_terms(params, target_params, batch, key):
        """Q_i of the stored actions [B, agent, n_q], their one-step targets and the weight
        of each transition in the loss, [B, agent] each (see time_limit_bootstrap)."""
        next_actions, _ = policy_actions(target_params["actor"], batch["next_obs"],
                                         batch["next_avail"], key)
        next_q = q_values(target_params["critic"], batch["next_obs"], next_actions).min(-1)
        target = batch["reward"] + batch["discount"][:, None] * next_q
        weight = jnp.broadcast_to(batch["weight"][:, None], next_q.shape)
        q = q_values(params["critic"], batch["obs"], critic_actions(batch["action"]))
        return q, jax.lax.stop_gradient(target), weight

    def critic_loss(critic_params, params, target_params, batch, key):
        q, target, weight = td_terms({**params, "critic": critic_params}, target_params, batch, key)
        td, weight = q - target[..., None], weight[..., None]  # every critic on the same target
        loss = jnp.sum(weight * td**2) / jnp.maximum(weight.sum(), 1.0)
        return loss, {"critic_loss": loss, "q": q.mean(),
                      "td_abs": jnp.sum(weight * jnp.abs(td)) / jnp.maximum(n_q * weight.sum(), 1.0)}

    def actor_loss(actor_params, critic_params, batch, key):
        """-Q_i with agent i's action from its actor and the others' from the replay."""
        new, raw = policy_actions(actor_params, batch["obs"], batch["avail"], key)
        stored = critic_actions(batch["action"])
        own = jnp.eye(n_agents, dtype=bool)[:, None, :, None]  # [agent i, 1, agent j, 1]
        joint = jnp.where(own, new[None], stored[None])  # [agent i, B, agent j, act]

        critics = per_agent(jax.lax.stop_gradient(critic_params))
        q = jax.vmap(critic_q, in_axes=(0, 0, None, 0))(critics, agent_ids, batch["obs"], joint)[..., 0]  # [agent, B]
        if discrete:  # penalise only the available actions' logits
            raw = jnp.where(batch["avail"], raw, 0.0)
        reg = jnp.mean(raw**2)
        loss = -q.mean() + config.actor_reg * reg
        return loss, {"actor_loss": loss, "actor_q": q.mean()}

    loss_fn = critic_loss

    # ------------------------------------------------------------------------ update

    def apply_per_network(optimizer, grads, opt_state, params):
        """Each network's gradients are clipped and applied on their own (vmap over networks)."""
        updates, opt_state = jax.vmap(optimizer.update)(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def update(train_state, windows):
        """One critic and one actor step on a batch of transitions, then the soft target update."""
        key, k_target, k_actor = jax.random.split(train_state["key"], 3)
        params, target_params = train_state["params"], train_state["target_params"]
        batch = transitions(windows, config.gamma, config.time_limit_bootstrap, config.n_step)
        # the sum over agents gives each agent's network the gradient of its own loss
        c_grads, c_metrics = jax.grad(critic_loss, has_aux=True)(
            params["critic"], params, target_params, batch, k_target)
        new_critic, critic_opt_state = apply_per_network(critic_opt, c_grads, train_state["critic_opt"],
                                                       params["critic"])
        a_grads, a_metrics = jax.grad(actor_loss, has_aux=True)(params["actor"], new_critic, batch, k_actor)
        new_actor, actor_opt_state = apply_per_network(actor_opt, a_grads, train_state["actor_opt"],
                                                     params["actor"])
        if config.actor_every > 1:  # TD3's delayed policy updates: the other steps keep the actor
            step = train_state["updates"] % config.actor_every == 0
            new_actor, actor_opt_state = jax.tree.map(lambda new, old: jnp.where(step, new, old),
                                                      (new_actor, actor_opt_state),
                                                      (params["actor"], train_state["actor_opt"]))
        params = {"actor": new_actor, "critic": new_critic}
        metrics = {**c_metrics, **a_metrics, "loss": c_metrics["critic_loss"],
                   "critic_grad_norm": optax.global_norm(c_grads),
                   "actor_grad_norm": optax.global_norm(a_grads)}
        # soft target update: (1 - tau) x target + tau x online, leaf by leaf
        target_params = optax.incremental_update(params, target_params, config.tau)
        return {**train_state, "params": params, "target_params": target_params,
                "actor_opt": actor_opt_state, "critic_opt": critic_opt_state,
                "updates": train_state["updates"] + 1, "key": key}, metrics

    def train(train_state, arrays, ring, n_updates: int):
        """n_updates of (sample (n + 1)-step windows from the ring mirror, update), in one scan."""
        starts = buffer.window_starts(arrays, ring, config.n_step + 1)

        def body(state, _):
            key, sample_key = jax.random.split(state["key"])
            windows = buffer.sample_windows(sample_key, arrays, ring, starts, config.batch_size,
                                            config.n_step + 1)
            return update({**state, "key": key}, windows)

        train_state, metrics = jax.lax.scan(body, train_state, None, n_updates)
        return train_state, jax.tree.map(jnp.mean, metrics)

    # --------------------------------------------------------------------- reanalysis

    @jax.jit
    def score_arrays(train_state, windows):
        batch_size, length = windows["terminated"].shape
        n = config.n_step
        # the training target itself (n-step, the same stops), from every start with n steps after it
        _, target, weight = td_terms(train_state["params"], train_state["target_params"],
                                     transitions(windows, config.gamma, config.time_limit_bootstrap, n),
                                     jax.random.PRNGKey(0))
        flat = lambda x: x.reshape(batch_size * length, *x.shape[2:])
        q_taken = q_values(train_state["params"]["critic"], flat(windows["obs"]),
                           critic_actions(flat(windows["action"])))[..., 0]  # the first critic's
        q_taken = q_taken.reshape(batch_size, length, n_agents)
        td = q_taken[:, :length - n] - target.reshape(batch_size, length - n, n_agents)
        td = jnp.where(weight.reshape(td.shape) > 0, td, jnp.nan)
        td = jnp.concatenate([td, jnp.full((batch_size, n, n_agents), jnp.nan, td.dtype)], axis=1)
        return {"q_taken": q_taken, "td_error": td}

    def score(train_state, windows):
        """Per-agent Q_i of the stored actions and the TD errors against the learner's own
        (n-step) targets, of stored windows [B, L] (NaN where there is no target: the last n
        steps, and starts at a cut), each with its dims after (step, env)."""
        return {k: (v, ("agent",)) for k, v in score_arrays(train_state, windows).items()}

    return Learner(
        name="maddpg", config=config, spec=spec, init=jax.jit(init), act=act,
        init_carry=init_carry, policy_params=policy_params, exploration=exploration,
        greedy=greedy, update=jax.jit(update), train=jax.jit(train, static_argnums=3),
        score=score, loss_fn=loss_fn, agent=actor)
