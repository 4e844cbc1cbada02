"""What learners' networks see first: the conv encoder of image observations and states
(EnvSpec.obs_shape / state_shape), and each agent's one-hot id beside a shared network's input.

Learners put it in front of their networks where the spec's observation (or state) is an
image: MAPPO/IPPO's actor and critic, QMIX/VDN/IQL's agent network and QMIX's mixer,
MADDPG's actors and critics. It
takes the uint8 pixels as stored and scales them to [0, 1] itself, so the replay, the
collectors and an exported policy all carry uint8 and only the network sees floats. Vector
observations get no encoder (`for_image` answers None), so their networks are as before.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


# a large image is average-pooled first, by the integer factor that brings its short side
# to about this many pixels (pistonball's 457x120 crop: by 3, to 152x40): 9x less compute
# than convolving it whole, and a 40-pixel piston is still 13 pixels wide
SHORT_SIDE = 40


class ImageEncoder(nn.Module):
    """uint8 images [..., H, W, C] -> features [..., features]: pixels scaled to [0, 1],
    average-pooled where large (SHORT_SIDE), two strided ReLU convs (Nature DQN's first two,
    padded so that an image of any size fits: pistonball's crop is 19x5x32 after them) and a
    dense ReLU layer. Leading axes (env, time, agent) are folded into one batch. (A third
    conv added a third to the compile time, which dominates tiny runs on a CPU.)"""

    features: int = 64

    @nn.compact
    def __call__(self, image):
        lead = image.shape[:-3]
        x = image.reshape(-1, *image.shape[-3:]).astype(jnp.float32) / 255.0
        pool = max(1, min(x.shape[1:3]) // SHORT_SIDE)
        if pool > 1:
            x = nn.avg_pool(x, (pool, pool), strides=(pool, pool))
        for channels, size, stride in ((16, 8, 4), (32, 4, 2)):
            x = nn.relu(nn.Conv(channels, (size, size), strides=(stride, stride), padding="SAME")(x))
        x = nn.relu(nn.Dense(self.features)(x.reshape(x.shape[0], -1)))
        return x.reshape(*lead, self.features)


def for_image(image_shape: tuple[int, ...]) -> ImageEncoder | None:
    """The encoder for an observation or state of this image shape; None for a vector (())."""
    return ImageEncoder() if image_shape else None


def encode(encoder: nn.Module | None, x):
    """x through the encoder where there is one (an image), else x as it is (a vector)."""
    return x if encoder is None else encoder(x)


def with_agent_ids(x):
    """x [..., agent, d] + each agent's one-hot id, so one shared network tells agents apart."""
    n_agents = x.shape[-2]
    ids = jnp.broadcast_to(jnp.eye(n_agents, dtype=x.dtype), (*x.shape[:-2], n_agents, n_agents))
    return jnp.concatenate([x, ids], axis=-1)
