"""Export a replay store to a Minari dataset (the Farama offline-RL format).

Minari datasets are single-agent and gymnasium-style, so the agents are flattened into
the joint observation (Box of n_agents*obs_dim; image observations keep their shape, a uint8
Box of [n_agents, H, W, C], stored losslessly) and the joint action (MultiDiscrete of
n_actions per agent, or Box of n_agents*action_dim), with the team reward (the agents'
mean, as the collectors' episode stats count it). One Minari episode per complete stored
episode (see storage.episodes); partial ones are left out. An episode's last step is a
Minari termination or truncation as the store's `terminated` / `truncated` say. The store
keeps no terminal observation (the envs auto-reset), so each episode's final observation
repeats its last one. infos hold the global state (an image state as its uint8 image) and
the joint action mask per step.

Needs the optional extra: pip install "marl-dataflow[minari]".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import numpy as np

from .episodes import episodes, iter_episodes
from .replay import ReplayStore, StoreError, open_replay

BATCH = 256  # episodes buffered before they are written


@contextlib.contextmanager
def _datasets_root(out_dir):
    if out_dir is None:
        yield
        return
    before = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = os.path.abspath(out_dir)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = before


def spaces(spec: dict):
    """(observation space, action space) of the joint, flattened agents (images: stacked)."""
    from gymnasium import spaces as gs

    n = len(spec["agents"])
    if spec.get("obs_shape"):
        obs = gs.Box(0, 255, (n, *spec["obs_shape"]), np.uint8)
    else:
        obs = gs.Box(-np.inf, np.inf, (n * spec["obs_dim"],), np.float32)
    if spec["discrete"]:
        act = gs.MultiDiscrete(np.full(n, spec["n_actions"], dtype=np.int64))
    else:
        act = gs.Box(float(spec["action_low"]), float(spec["action_high"]),
                     (n * spec["action_dim"],), np.float32)
    return obs, act


def _episode_buffer(data: dict, spec: dict):
    from minari.data_collector import EpisodeBuffer

    length = len(data["reward"])
    if spec.get("obs_shape"):  # [step, agent, H, W, C] pixels as the env gave them
        obs = np.asarray(data["obs"], np.uint8)
    else:
        obs = data["obs"].reshape(length, -1).astype(np.float32)
    state = np.asarray(data["state"], np.uint8 if spec.get("state_shape") else np.float32)
    action = data["action"].reshape(length, -1)
    action = action.astype(np.int64) if spec["discrete"] else action.astype(np.float32)
    last = lambda x: np.concatenate([x, x[-1:]])  # the terminal obs is not stored
    return EpisodeBuffer(
        observations=last(obs), actions=action,
        rewards=data["reward"].astype(np.float64).mean(axis=-1),
        terminations=np.asarray(data["terminated"], bool),
        truncations=np.asarray(data["truncated"], bool),
        infos={"state": last(state),
               "action_mask": last(data["avail_actions"].reshape(length, -1))})


def export_minari(store_path, dataset_id: str, out_dir=None) -> dict:
    """Writes the store's complete episodes as Minari dataset `dataset_id` (under `out_dir`,
    default $MINARI_DATASETS_PATH or ~/.minari/datasets); returns what was written."""
    try:
        from minari.dataset.minari_dataset import parse_dataset_id
        from minari.storage import get_dataset_path
    except ImportError:
        raise StoreError('Minari export needs the minari package; pip install "marl-dataflow[minari]"') from None
    store = ReplayStore.open(store_path)
    spec = store.attrs.get("env_spec")
    need = ("obs", "action", "reward", "terminated", "truncated", "state", "avail_actions")
    if not spec or any(f not in store.fields for f in need):
        raise StoreError(f"replay store at {store.path} lacks the env spec or fields {list(need)}; "
                         f"only stores written by `marl train` can be exported")
    with _datasets_root(out_dir):
        try:
            parse_dataset_id(dataset_id)
        except ValueError:
            raise StoreError(f"bad Minari dataset id {dataset_id!r}; write (namespace/)name-v<N>, "
                             f"e.g. marl/smax-3m-qmix-v0") from None
        path = get_dataset_path(dataset_id)
        if os.path.exists(path):
            raise StoreError(f"a Minari dataset {dataset_id!r} already exists at {path}; pass "
                             f"another id (e.g. bump -v0 to -v1) or --out DIR")
        ds = open_replay(store.path)
        table = episodes(ds)
        if not table["complete"].any():
            raise StoreError(f"replay store at {store.path} holds no complete episode; collect "
                             f"more before exporting")
        dataset, batch, steps = None, [], 0
        try:
            for row, data in iter_episodes(ds, need, table):
                batch.append(_episode_buffer(data, spec))
                steps += int(row["length"])
                if len(batch) == BATCH:
                    dataset, batch = _write(dataset, dataset_id, batch, store, spec), []
            if batch:
                dataset = _write(dataset, dataset_id, batch, store, spec)
        except BaseException:  # no half-written dataset left behind under that id
            shutil.rmtree(path, ignore_errors=True)
            raise
    return {"dataset_id": dataset_id, "path": str(path), "episodes": int(table["complete"].sum()),
            "steps": steps, "skipped": int((~table["complete"]).sum())}


def _write(dataset, dataset_id: str, batch: list, store: ReplayStore, spec: dict):
    """Creates the dataset with the first batch of episodes, appends the later ones."""
    import minari

    if dataset is not None:
        dataset.storage.update_episodes(batch)
        return dataset
    try:
        observation_space, action_space = spaces(spec)
        with warnings.catch_warnings():  # minari nags about author/permalink metadata
            warnings.simplefilter("ignore", UserWarning)
            return minari.create_dataset_from_buffers(
                dataset_id, batch, observation_space=observation_space, action_space=action_space,
                algorithm_name=store.attrs.get("algorithm"), data_format="hdf5", jpeg_encoding=False,
                description=(f"Exported from the marl-dataflow replay store {os.path.abspath(store.path)} "
                             f"(env {spec['env_id']}, {len(spec['agents'])} agents flattened into joint "
                             f"obs/actions (images stacked), team reward = mean over agents; the final observation "
                             f"repeats the last stored one)."))
    except ValueError as e:
        raise StoreError(f"Minari refused dataset {dataset_id!r}: {e}") from None
