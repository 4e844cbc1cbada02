"""MAPPO (Yu et al., 2022) and IPPO (de Witt et al., 2020): PPO with one actor shared by
all agents, the critic being the difference between them:

    central (MAPPO)  the critic sees the global state (plus the agent's one-hot id) and
                     gives one value per agent and env step
    agent   (MAPPO)  the global state and the agent's own observation beside it (plus its
                     id): MAPPO's agent-specific global state, for values that follow what
                     each agent itself sees (its position, its targets, whether it is alive)
    joint   (MAPPO)  every agent's observation, the agent's own first and the others in id
                     order after it (plus its id): MAPPO's concatenated local observations,
                     central like the state but in the agents' own relative terms
    local   (IPPO)   the critic sees only the agent's own observation (plus its id)

Reads top to bottom:

    config -> networks -> action distributions -> acting -> GAE -> loss -> train -> score

The actor is feed-forward, or recurrent (a GRU) with `recurrent=True`. Discrete actions
are a masked categorical (an unavailable action has probability 0, so it is never
sampled); continuous actions are a diagonal Gaussian with a state-independent log-std,
clipped to [action_low, action_high] for the env while the stored `action_raw` keeps the
unclipped sample that the log-probability belongs to.

On-policy data goes through the replay store like any other: each collect writes a region
[T, N] with the behaviour log-probability `logp` (and the actor's hidden state `actor_h`
when recurrent) beside each step, and the train stage hands exactly those regions to
`train`, which runs `epochs` x `minibatches` clipped-surrogate updates over envs. Values
are recomputed at train time with the current critic, which is the critic that acted:
the train stage runs right after the collect, with the same parameters.

Reward shaping (`reward_shaping_horizon` > 0, as JaxMARL's IPPO on Overcooked): where the env
has a shaping term (EnvSpec.shaped_reward; the store's `shaped_reward` beside the sparse
`reward`), the advantages and value targets are of reward + coef * shaped_reward, coef
falling linearly from 1 to 0 over that many env steps (per seed). A train call takes coef at
the env steps collected before its regions (train calls done x env steps per call), the
value JaxMARL uses for the update that collected them. Collection, its training return and
every evaluation stay on the env's own reward; 0 (the default) trains on `reward` alone.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen.initializers import constant, orthogonal

from marl import encoders, transition
from marl.envs import EnvSpec
from marl.learner import Learner


@dataclasses.dataclass(frozen=True)
class Config:
    # "central" (MAPPO: global state), "agent" (state + own obs), "joint" (every agent's obs,
    # its own first), "local" (IPPO: own obs) or "counterfactual" (COMA's baseline: the state
    # and the other agents' actions -> a Q per own action; the advantage is the taken
    # action's Q minus the policy's mean Q, so each agent is credited with its own choice)
    critic: str = "central"
    recurrent: bool = False  # GRU actor; its hidden state is stored per step as `actor_h`
    hidden: int = 64
    activation: str = "tanh"  # "tanh" or "relu"
    # LayerNorm on the input features and after each hidden layer, in actor and critic (the
    # MAPPO paper's feature normalisation and its MLP blocks); on SMAX's marine maps it learns
    # slower and ends lower (8m 0.80 against 0.82 at 2M, BENCHMARKS.md), so it is off
    layer_norm: bool = False
    lr: float = 5e-4
    # linear decay of the learning rate to 0 over this many train calls (0: constant)
    anneal_lr_iterations: int = 0
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2  # surrogate ratio clip
    # clip the ratio around the policy at the update's start (not the one that acted), and
    # weight each step by how much likelier that policy made its action than the acting one
    # (decoupled PPO, Hilton et al. 2022): a region acted on by older params (max_policy_lag
    # > 0) then gets a whole trust region of updates; where they acted, it is plain PPO
    decoupled_clip: bool = False
    value_clip_eps: float = 0.2  # value clip around the values before the update
    # the critic learns targets normalised by their running mean and std (MAPPO's ValueNorm):
    # its outputs and the value clip live in that space, GAE and `score` in the return's
    value_norm: bool = False
    # leave an agent with no choice (one available action: SMAX's dead units) out of every
    # loss term and of the advantages' normalisation (MAPPO's active masks on SMAC); its
    # policy has no gradient there anyway, but its steps dilute the means and its values
    # are fitted to returns it can no longer change
    active_masks: bool = False
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5  # per network (actor and critic have their own optimiser)
    epochs: int = 4  # passes over each collected batch
    minibatches: int = 4  # per epoch, split over envs (must divide envs x collectors)
    log_std_init: float = 0.0  # continuous actions: initial log standard deviation
    # train on reward + coef * the env's shaping term (envs with EnvSpec.shaped_reward:
    # Overcooked), coef falling linearly 1 -> 0 over this many env steps (per seed); 0: off
    reward_shaping_horizon: int = 0


CRITICS = ("central", "agent", "joint", "local", "counterfactual")
SHAPING_NEEDS = ("reward_shaping_horizon={horizon} needs an env with a shaping term beside its reward "
                 "(jaxmarl:overcooked, jaxmarl:overcooked_v2, or smax:* with --set "
                 "env_kwargs='{{\"health_lost_shaping\": true}}' or own_health_lost_shaping) and {env} has none; "
                 "drop the setting")
ACTION_SPACES = ("discrete", "continuous")
ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu}
MASKED = -1e9  # logit of an unavailable action: probability exactly 0 in float32, no NaN
# value_norm's moments: so slow an average that, debiased, it is about the mean over every
# train call so far (MAPPO's ValueNorm: beta 0.99999, the variance floored at 1e-2)
VALUE_NORM_BETA = 0.99999
VALUE_NORM_MIN_VAR = 1e-2


# --------------------------------------------------------------------------- networks


def normed(x, layer_norm: bool):
    return nn.LayerNorm()(x) if layer_norm else x


def hidden_layer(x, hidden: int, activation: str, layer_norm: bool):
    h = ACTIVATIONS[activation](nn.Dense(hidden, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x))
    return normed(h, layer_norm)


class Actor(nn.Module):
    """obs [..., agent, obs] (an image: through the conv encoder) + agent id -> Dense ->
    (GRU) -> Dense -> logits (discrete) or mean (continuous).

    The caller zeroes the GRU memory where an episode starts, so the stored hidden state
    is exactly what the actor saw."""

    hidden: int
    n_out: int
    activation: str
    recurrent: bool
    continuous: bool
    log_std_init: float
    encoder: nn.Module | None = None  # image observations (marl.encoders)
    layer_norm: bool = False

    @nn.compact
    def __call__(self, carry, obs):
        x = encoders.with_agent_ids(normed(encoders.encode(self.encoder, obs), self.layer_norm))
        h = hidden_layer(x, self.hidden, self.activation, self.layer_norm)
        if self.recurrent:
            carry, h = nn.GRUCell(self.hidden)(carry, h)
        h = hidden_layer(h, self.hidden, self.activation, self.layer_norm)
        out = nn.Dense(self.n_out, kernel_init=orthogonal(0.01), bias_init=constant(0.0))(h)
        log_std = (self.param("log_std", constant(self.log_std_init), (self.n_out,))
                   if self.continuous else jnp.zeros(()))
        return carry, out, log_std


class Critic(nn.Module):
    """What the critic sees + agent id -> Dense -> Dense -> one value per agent: the global
    state, the same for every agent (central, MAPPO), the state with the agent's own obs
    beside it (agent), every agent's obs with its own first (joint), or the agent's own obs
    alone (local, IPPO); an image through a conv encoder (a state's once per state, not per
    agent). `counterfactual`: the state and every other agent's action (one-hot, the agent's
    own slot zero) -> one Q per action of the agent's own (n_actions)."""

    hidden: int
    activation: str
    n_agents: int
    sees: str  # one of CRITICS
    encoder: nn.Module | None = None  # an image state (central, agent) or image obs (joint, local)
    obs_encoder: nn.Module | None = None  # the agent critic's image obs
    layer_norm: bool = False
    n_actions: int = 0  # counterfactual: the Q head's width

    @nn.compact
    def __call__(self, obs, state, action=None):  # [..., agent, obs], [..., state], [..., agent] -> [..., agent]
        if self.sees == "local":
            x = encoders.encode(self.encoder, obs)
        elif self.sees == "joint":
            own = encoders.encode(self.encoder, obs)
            # row i lists agents i, i+1, ..., i-1: each agent reads the team from its own place
            order = (np.arange(self.n_agents)[:, None] + np.arange(self.n_agents)) % self.n_agents
            x = own[..., order, :].reshape(*own.shape[:-2], self.n_agents, -1)
        else:
            shared = encoders.encode(self.encoder, state)
            x = jnp.broadcast_to(shared[..., None, :], (*shared.shape[:-1], self.n_agents, shared.shape[-1]))
            if self.sees == "agent":
                own = encoders.encode(self.obs_encoder, obs)
                x = jnp.concatenate([x, own.astype(x.dtype)], axis=-1)
            if self.sees == "counterfactual":  # row i: every agent's action but i's own
                others = jax.nn.one_hot(action, self.n_actions, dtype=x.dtype)[..., None, :, :]
                others = others * (1.0 - jnp.eye(self.n_agents, dtype=x.dtype))[..., None]
                x = jnp.concatenate([x, others.reshape(*x.shape[:-1], -1)], axis=-1)
        x = encoders.with_agent_ids(normed(x, self.layer_norm))
        h = hidden_layer(x, self.hidden, self.activation, self.layer_norm)
        h = hidden_layer(h, self.hidden, self.activation, self.layer_norm)
        if self.sees == "counterfactual":
            return nn.Dense(self.n_actions, kernel_init=orthogonal(1.0), bias_init=constant(0.0))(h)
        return nn.Dense(1, kernel_init=orthogonal(1.0), bias_init=constant(0.0))(h)[..., 0]


# --------------------------------------------------------------- action distributions


def masked_logits(logits, avail):
    return jnp.where(avail, logits, MASKED)


def taken(x, action):
    """x [..., agent, action] (log-probabilities, Qs) at each agent's action [..., agent] -> [..., agent]."""
    return jnp.take_along_axis(x, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def categorical_log_prob(logits, action):
    return taken(jax.nn.log_softmax(logits), action)


def categorical_entropy(logits, avail):
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.where(avail, jnp.exp(logp) * logp, 0.0), axis=-1)


def gaussian_log_prob(mean, log_std, x):
    z = (x - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z**2 - log_std - 0.5 * math.log(2 * math.pi), axis=-1)


def gaussian_entropy(mean, log_std):
    return jnp.sum(jnp.broadcast_to(log_std + 0.5 * (1.0 + math.log(2 * math.pi)), mean.shape), axis=-1)


# ------------------------------------------------------------------------------- GAE


def gae(reward, terminated, cut, value, gamma: float, lam: float):
    """Generalised advantage estimates along axis 1.

    reward [B, L, ...], terminated and cut [B, L] of transitions t = 0..L-1, value
    [B, L + 1, ...]. terminated[t]: step t ended its episode for real, so it does not
    bootstrap; cut[t] (`transition.cut`: a time limit or a restart): the state after t is not
    stored, so A_t has no estimate (the caller leaves t out of the loss) and the steps before
    t bootstrap on V_t instead of carrying A_t. Returns (advantages, value targets), [B, L, ...]:
        delta_t = r_t + gamma (1 - term_t) V_{t+1} - V_t
        A_t     = delta_t + gamma lam (1 - term_t) (1 - cut_{t+1}) A_{t+1}
    """
    as_reward = lambda x: jnp.broadcast_to(
        x.astype(jnp.float32).reshape(x.shape + (1,) * (reward.ndim - x.ndim)), reward.shape)
    live = 1.0 - as_reward(terminated)
    next_uncut = 1.0 - as_reward(jnp.concatenate([cut[:, 1:], jnp.zeros_like(cut[:, :1])], axis=1))
    delta = reward + gamma * live * value[:, 1:] - value[:, :-1]

    def step(next_adv, inputs):
        d, carry_on = inputs
        adv = d + gamma * lam * carry_on * next_adv
        return adv, adv

    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (delta, live * next_uncut))
    _, adv = jax.lax.scan(step, jnp.zeros_like(xs[0][0]), xs, reverse=True)
    adv = jnp.swapaxes(adv, 0, 1)
    return adv, adv + value[:, :-1]


def counterfactual_advantage(q, logits, action):
    """COMA's advantage of each agent's taken action: its Q minus the Q the agent's policy
    expects with the other agents' actions held fixed. q and logits [..., agent, action]
    (logits masked), action [..., agent] -> [..., agent]."""
    return taken(q, action) - jnp.sum(jax.nn.softmax(logits) * q, axis=-1)


def explained_variance(target, prediction, weight):
    """1 - Var(target - prediction) / Var(target) over the steps `weight` keeps: how much of
    the value targets' spread the critic that acted explains (1: all of it; 0: no more than
    their mean would; below 0: worse), the critic's health in one number."""
    total = jnp.maximum(weight.sum(), 1.0)
    var = lambda x: jnp.sum(weight * (x - jnp.sum(weight * x) / total) ** 2) / total
    return 1.0 - var(target - prediction) / jnp.maximum(var(target), 1e-8)


# ---------------------------------------------------------------------- reward shaping


def reward_shaping(horizon: int):
    """env steps -> the shaping coefficient: 1 at 0 steps, falling linearly to 0 at `horizon`
    and 0 after it (JaxMARL's IPPO anneals Overcooked's shaped reward so, over 2.5M steps)."""
    return optax.linear_schedule(init_value=1.0, end_value=0.0, transition_steps=horizon)


# ---------------------------------------------------------------------------- learner


def make_learner(spec: EnvSpec, config: Config):
    if config.critic not in CRITICS:
        raise ValueError(f"unknown critic {config.critic!r}; valid: {', '.join(CRITICS)} "
                         "(central = MAPPO, agent = MAPPO with each agent's obs beside the state, "
                         "joint = MAPPO on every agent's obs, local = IPPO, counterfactual = COMA's baseline)")
    if config.activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {config.activation!r}; valid: {', '.join(ACTIVATIONS)}")
    counterfactual = config.critic == "counterfactual"
    if counterfactual and not spec.discrete:
        raise ValueError(f"critic=counterfactual scores each of an agent's discrete actions and {spec.env_id} "
                         "has continuous ones; use critic=central")
    if config.reward_shaping_horizon > 0 and not spec.shaped_reward:
        raise ValueError(SHAPING_NEEDS.format(horizon=config.reward_shaping_horizon, env=spec.env_id))
    shaping = reward_shaping(config.reward_shaping_horizon) if config.reward_shaping_horizon > 0 else None
    n_agents, discrete = spec.n_agents, spec.discrete
    n_out = spec.n_actions if discrete else spec.action_dim
    actor = Actor(config.hidden, n_out, config.activation, config.recurrent, not discrete,
                  config.log_std_init, encoders.for_image(spec.obs_shape), config.layer_norm)
    sees_obs = config.critic in ("joint", "local")  # a critic of observations, not of the state
    critic = Critic(config.hidden, config.activation, n_agents, config.critic,
                    encoders.for_image(spec.obs_shape if sees_obs else spec.state_shape),
                    encoders.for_image(spec.obs_shape) if config.critic == "agent" else None,
                    config.layer_norm, spec.n_actions if counterfactual else 0)
    updates_per_call = config.epochs * config.minibatches

    # linear to 0 over anneal_lr_iterations train calls, one lr for all the updates of a call
    lr_decay = (optax.linear_schedule(config.lr, 0.0, config.anneal_lr_iterations)
                if config.anneal_lr_iterations > 0 else None)

    def lr_schedule(count):
        return config.lr if lr_decay is None else lr_decay(count // updates_per_call)

    def optimizer():
        return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                           optax.adam(lr_schedule, eps=1e-5))

    actor_opt, critic_opt = optimizer(), optimizer()

    def init_carry(n_envs):
        # a feed-forward actor carries nothing (one placeholder per env)
        return jnp.zeros((n_envs, n_agents, config.hidden) if config.recurrent else (n_envs,))

    def init(key) -> dict:
        k_actor, k_critic, key = jax.random.split(key, 3)
        (obs_shape, obs_dtype), (state_shape, state_dtype) = spec.agent_obs, spec.global_state
        obs = jnp.zeros((1, n_agents, *obs_shape), obs_dtype)
        carry = jnp.zeros((1, n_agents, config.hidden))
        params = {"actor": actor.init(k_actor, carry, obs),
                  "critic": critic.init(k_critic, obs, jnp.zeros((1, *state_shape), state_dtype),
                                        jnp.zeros((1, n_agents), jnp.int32))}
        train_state = {"params": params, "actor_opt": actor_opt.init(params["actor"]),
                       "critic_opt": critic_opt.init(params["critic"]),
                       "updates": jnp.array(0, jnp.int32), "key": key}
        if config.value_norm:
            train_state["value_norm"] = {k: jnp.float32(0.0) for k in ("mean", "mean_sq", "debias")}
        return train_state

    # ---------------------------------------------------------------------- acting

    def act(params, carry, obs, avail, reset, key, explore):
        """Samples (or, with explore["greedy"], takes the mode of) each agent's action.

        Extras stored per step: the behaviour log-probability of the action taken, the
        unclipped Gaussian sample (continuous) and the actor memory it started from
        (recurrent)."""
        if config.recurrent:
            carry = jnp.where(reset[:, None, None], 0.0, carry)
        start_carry = carry
        carry, out, log_std = actor.apply(params, carry, obs)
        if not config.recurrent:
            carry = start_carry
        extras = {}
        if discrete:
            logits = masked_logits(out, avail)
            sampled = jax.random.categorical(key, logits)
            action = jnp.where(explore["greedy"], jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
            extras["logp"] = categorical_log_prob(logits, action)
        else:
            noise = jax.random.normal(key, out.shape)
            raw = jnp.where(explore["greedy"], out, out + jnp.exp(log_std) * noise)
            extras["logp"] = gaussian_log_prob(out, log_std, raw)
            extras["action_raw"] = raw
            action = jnp.clip(raw, spec.action_low, spec.action_high)
        if config.recurrent:
            extras["actor_h"] = start_carry
        return action, carry, extras

    extra_fields = {"logp": ((n_agents,), "float32", ("agent",))}
    if not discrete:
        extra_fields["action_raw"] = ((n_agents, spec.action_dim), "float32", ("agent", "act_dim"))
    if config.recurrent:
        extra_fields["actor_h"] = ((n_agents, config.hidden), "float32", ("agent", "hidden"))

    def policy_params(train_state):
        return train_state["params"]["actor"]

    def exploration(env_steps):
        return {"greedy": jnp.array(False)}

    greedy = {"greedy": jnp.array(True)}

    # ------------------------------------------------------------ along sequences

    def actor_outputs(actor_params, batch):
        """Actor outputs along sequences [B, L]: (out [B, L, agent, n_out], log_std).

        A recurrent actor unrolls from the stored memory at each sequence's first step,
        zeroing it after every episode end inside the sequence, as the collector did."""
        x = batch["obs"]
        if not config.recurrent:
            _, out, log_std = actor.apply(actor_params, jnp.zeros(()), x)
            return out, log_std
        reset = batch["first"]  # step 0's stored memory is already the reset one

        def step(carry, inputs):
            x_t, reset_t = inputs
            carry = jnp.where(reset_t[:, None, None], 0.0, carry)
            carry, out, log_std = actor.apply(actor_params, carry, x_t)
            return carry, (out, log_std)

        time_major = lambda a: jnp.swapaxes(a, 0, 1)
        _, (out, log_std) = jax.lax.scan(step, batch["actor_h"][:, 0], (time_major(x), time_major(reset)))
        return time_major(out), log_std[0]

    def log_prob_and_entropy(actor_params, batch):
        out, log_std = actor_outputs(actor_params, batch)
        if discrete:
            logits = masked_logits(out, batch["avail_actions"])
            return (categorical_log_prob(logits, batch["action"]),
                    categorical_entropy(logits, batch["avail_actions"]))
        return (gaussian_log_prob(out, log_std, batch["action_raw"]),
                gaussian_entropy(out, log_std))

    def values(critic_params, batch, every_action=False):
        """[..., agent]: each agent's state value, or (counterfactual) its taken action's Q
        ([..., agent, action], every action's, with every_action)."""
        if not counterfactual:
            return critic.apply(critic_params, batch["obs"], batch["state"])
        q = critic.apply(critic_params, batch["obs"], batch["state"], batch["action"])
        return q if every_action else taken(q, batch["action"])

    # ---------------------------------------------------------- value normalisation

    def value_moments(stats):
        """The running mean and std of the value targets (debiased exponential averages)."""
        debias = jnp.maximum(stats["debias"], 1e-5)
        mean = stats["mean"] / debias
        return mean, jnp.sqrt(jnp.maximum(stats["mean_sq"] / debias - mean**2, VALUE_NORM_MIN_VAR))

    def value_norm_update(stats, targets, weight):
        """The running moments with one train call's targets (those `weight` keeps) folded in."""
        weight = jnp.broadcast_to(weight.reshape(weight.shape + (1,) * (targets.ndim - weight.ndim)), targets.shape)
        total = jnp.maximum(weight.sum(), 1.0)
        batch = {"mean": jnp.sum(weight * targets) / total, "mean_sq": jnp.sum(weight * targets**2) / total,
                 "debias": jnp.float32(1.0)}
        return jax.tree.map(lambda old, new: VALUE_NORM_BETA * old + (1.0 - VALUE_NORM_BETA) * new, stats, batch)

    def raw_values(train_state, batch, every_action=False):
        """State values (or Qs: `values`) on the return's scale, whatever space the critic learns in."""
        value = values(train_state["params"]["critic"], batch, every_action)
        if not config.value_norm:
            return value
        mean, std = value_moments(train_state["value_norm"])
        return value * std + mean

    # ------------------------------------------------------------------------ loss

    def prepare(old_state, batch, shaping_coef=None):
        """Advantages and value targets of sequences [B, T] with the critic that acted, of
        the env's reward plus `shaping_coef` x its shaping term where shaping is on (and,
        with decoupled_clip, the actor's log-probabilities before the update). Returns the
        prepared batch and `old_state`'s value_norm moments with its targets folded in
        (None without value_norm); targets and old values are then in the critic's space.

        The last step of each sequence has no next observation here (it is the first
        step of the next region), so its transition is dropped from the loss and its
        value only bootstraps step T-2: targets cover steps 0..T-2. `weight` [B, T-1] leaves
        out the cut steps too (a time limit, a restart), which have no target."""
        if counterfactual:  # value: the taken actions' Q, so GAE's targets are its TD(lambda) returns
            q = jax.lax.stop_gradient(raw_values(old_state, batch, every_action=True))  # [B, T, agent, action]
            value = taken(q, batch["action"])
        else:
            value = jax.lax.stop_gradient(raw_values(old_state, batch))  # [B, T, agent]
        cut = transition.cut(batch)
        weight = (~cut).astype(jnp.float32)
        reward = batch["reward"]
        if shaping is not None:
            reward = reward + shaping_coef * batch["shaped_reward"]
        adv, targets = gae(reward[:, :-1], batch["terminated"][:, :-1], cut, value,
                           config.gamma, config.gae_lambda)
        if counterfactual:  # each agent's own choice against its policy's mean, the others' fixed
            logits = masked_logits(actor_outputs(old_state["params"]["actor"], batch)[0], batch["avail_actions"])
            adv = jax.lax.stop_gradient(counterfactual_advantage(q, logits, batch["action"])[:, :-1])
        value_old, stats = value[:, :-1], None
        if config.value_norm:  # the critic learns in the space of the moments with these targets in
            stats = value_norm_update(old_state["value_norm"], targets, weight)
            mean, std = value_moments(stats)
            targets, value_old = (targets - mean) / std, (value_old - mean) / std
        if config.decoupled_clip:  # the proximal policy: the actor before this update
            batch = {**batch, "logp_proximal": log_prob_and_entropy(old_state["params"]["actor"], batch)[0]}
        return {**batch, "advantage": adv, "target": targets, "value_old": value_old, "weight": weight}, stats

    def ppo_loss(params, batch):
        """The PPO loss of prepared sequences (see `prepare`) and its parts, averaged over
        the steps (and agents) that `weight` keeps."""
        logp, entropy = log_prob_and_entropy(params["actor"], batch)
        logp, entropy = logp[:, :-1], entropy[:, :-1]
        weight = jnp.broadcast_to(batch["weight"][..., None], logp.shape)
        if config.active_masks and discrete:
            weight = weight * (batch["avail_actions"][:, :-1].sum(-1) > 1)
        mean = lambda x: jnp.sum(weight * x) / jnp.maximum(weight.sum(), 1.0)
        behaviour = batch["logp"][:, :-1]
        proximal = batch["logp_proximal"][:, :-1] if config.decoupled_clip else behaviour
        log_ratio = logp - proximal
        ratio = jnp.exp(log_ratio)
        adv = batch["advantage"]
        adv_mean = mean(adv)
        adv = (adv - adv_mean) / (jnp.sqrt(mean((adv - adv_mean) ** 2)) + 1e-8)
        clipped = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)
        surrogate = jnp.minimum(ratio * adv, clipped * adv)
        if config.decoupled_clip:  # the acting policy -> the proximal one (no gradient)
            surrogate = jnp.exp(proximal - behaviour) * surrogate
        actor_loss = -mean(surrogate)
        value = values(params["critic"], batch)[:, :-1]
        old = batch["value_old"]
        value_clipped = old + jnp.clip(value - old, -config.value_clip_eps, config.value_clip_eps)
        value_loss = 0.5 * mean(jnp.maximum((value - batch["target"]) ** 2,
                                            (value_clipped - batch["target"]) ** 2))
        entropy = mean(entropy)
        loss = actor_loss - config.ent_coef * entropy + config.vf_coef * value_loss
        return loss, {"loss": loss, "actor_loss": actor_loss, "value_loss": value_loss,
                      "entropy": entropy, "approx_kl": mean((ratio - 1.0) - log_ratio),
                      "clip_frac": mean(jnp.abs(ratio - 1.0) > config.clip_eps)}

    def loss_fn(params, old_state, batch, shaping_coef=0.0):
        """The PPO loss of `params` on sequences that the train state `old_state` collected
        (its params give the advantages and the values to clip around, like QMIX's target
        params); with shaping on, of reward + shaping_coef x the shaping term."""
        return ppo_loss(params, prepare(old_state, batch, shaping_coef)[0])

    def update(train_state, batch):
        """One gradient step on a prepared minibatch; actor and critic have their own
        optimiser (and grad-norm clip), as in MAPPO."""
        grads, metrics = jax.grad(ppo_loss, has_aux=True)(train_state["params"], batch)
        params = train_state["params"]
        a_updates, actor_state = actor_opt.update(grads["actor"], train_state["actor_opt"], params["actor"])
        c_updates, critic_state = critic_opt.update(grads["critic"], train_state["critic_opt"], params["critic"])
        params = {"actor": optax.apply_updates(params["actor"], a_updates),
                  "critic": optax.apply_updates(params["critic"], c_updates)}
        metrics["actor_grad_norm"] = optax.global_norm(grads["actor"])
        metrics["critic_grad_norm"] = optax.global_norm(grads["critic"])
        return {**train_state, "params": params, "actor_opt": actor_state, "critic_opt": critic_state,
                "updates": train_state["updates"] + 1}, metrics

    # ----------------------------------------------------------------------- train

    def sequences(arrays):
        """Regions [R, T, N, ...] -> one sequence per (region, env): [R * N, T, ...]."""
        def merge(x):
            x = jnp.swapaxes(x, 1, 2)
            return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
        return {k: merge(v) for k, v in arrays.items()}

    def train(train_state, arrays, ring, n_updates: int):
        """One PPO update on the regions the last collect wrote: `epochs` passes, each over
        `minibatches` random splits of the envs. (`ring` is unused and `n_updates` is the
        number of regions: an on-policy learner trains on all of them once.)"""
        if shaping is None:  # the shaping term is not trained on: the update is as without it
            arrays = {k: v for k, v in arrays.items() if k != "shaped_reward"}
            shaping_coef = None
        else:
            shaping_coef = shaping_coefficient(train_state, arrays)
        batch, value_stats = prepare(train_state, sequences(arrays), shaping_coef)
        if value_stats is not None:
            train_state = {**train_state, "value_norm": value_stats}
        n_seq = batch["obs"].shape[0]
        if n_seq % config.minibatches:
            raise ValueError(f"minibatches={config.minibatches} does not divide the {n_seq} env "
                             "sequences per update (envs_per_collector x n_collectors); "
                             "pick a divisor, e.g. --set minibatches=1")
        size = n_seq // config.minibatches

        def epoch(state, _):
            key, perm_key = jax.random.split(state["key"])
            order = jax.random.permutation(perm_key, n_seq)
            split = jax.tree.map(lambda x: x[order].reshape(config.minibatches, size, *x.shape[1:]), batch)
            state, metrics = jax.lax.scan(update, {**state, "key": key}, split)
            return state, metrics

        train_state, metrics = jax.lax.scan(epoch, train_state, None, config.epochs)
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics["value"] = batch["value_old"].mean()
        metrics["explained_variance"] = explained_variance(
            batch["target"], batch["value_old"], jnp.broadcast_to(batch["weight"][..., None], batch["target"].shape))
        if config.value_norm:  # on the return's scale
            mean, std = value_moments(value_stats)
            metrics["value"] = metrics["value"] * std + mean
        metrics["lr"] = jnp.asarray(lr_schedule(train_state["updates"]), jnp.float32)
        if shaping is not None:
            metrics["shaping_coef"] = jnp.asarray(shaping_coef, jnp.float32)
        return train_state, metrics

    def shaping_coefficient(train_state, arrays):
        """The shaping coefficient for regions [R, T, N, ...] at the env steps collected
        before them: the train calls done so far (each runs epochs x minibatches updates) x
        the R x T x N env steps of a call, the count the pipeline's env_steps keeps."""
        steps_per_call = math.prod(arrays["reward"].shape[:3])
        calls_done = (train_state["updates"] // updates_per_call).astype(jnp.float32)
        return shaping(calls_done * steps_per_call)

    # ----------------------------------------------------------------------- score

    @jax.jit
    def score_arrays(train_state, batch):
        logp, entropy = log_prob_and_entropy(train_state["params"]["actor"], batch)
        return {"value": raw_values(train_state, batch), "logp_current": logp,
                "logp_behaviour": batch["logp"], "log_ratio": logp - batch["logp"],
                "entropy": entropy}

    def score(train_state, windows):
        """Per-step state values, current and behaviour log-probabilities (and their log
        ratio) and policy entropy of stored windows [B, L], each per agent."""
        return {k: (v, ("agent",)) for k, v in score_arrays(train_state, windows).items()}

    name = "ippo" if config.critic == "local" else "mappo"
    return Learner(
        name=name, config=config, spec=spec, init=jax.jit(init), act=act, init_carry=init_carry,
        policy_params=policy_params, exploration=exploration, greedy=greedy,
        update=jax.jit(update), train=jax.jit(train, static_argnums=3), on_policy=True,
        extra_fields=extra_fields, score=score, loss_fn=loss_fn, agent=actor, mixer=critic)
