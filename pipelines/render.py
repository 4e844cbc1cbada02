"""Watching a trained team: greedy episodes of a saved run, drawn by the env's own
visualiser and written as a GIF (Pillow) or an MP4 (ffmpeg, where it is installed).

    run = load_run("runs/qmix-smac")
    summary = render_run(run, "team.gif", episodes=2)

SMAX: jaxmarl's SMAX renderer (what its SMAXVisualizer animates: the world sub-steps the
env ticks between two env steps, so units move and bullets fly). MPE: jaxmarl's
MPEVisualizer. PettingZoo: the env's own render_mode="rgb_array" frames. Frames go through
matplotlib's movie writers, so no encoder beyond Pillow (a matplotlib dependency) is needed
for a GIF.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os

import jax
import jax.numpy as jnp
import numpy as np

from marl import teams
from marl.envs import EnvError
from pipelines.saved_run import SavedRun, seed_params

FORMATS = {".gif": "pillow", ".mp4": "ffmpeg"}
SMAX_DPI = 80  # jaxmarl's 6x5 in SMAX figure -> 480x400 px frames
SMAX_SUBSTEP_STRIDE = 2  # draw every 2nd of the 8 world sub-steps per env step: a GIF half the size, still smooth


class RenderError(ValueError):
    """Cannot render: the message is one line naming the problem and the fix."""


@dataclasses.dataclass
class Episode:
    """One greedy episode: what the drawing needs of each step, and its outcome."""

    steps: list  # JAX envs: (jaxmarl step key, the whole env's state, every agent's actions); PettingZoo: RGB frames
    ret: float = 0.0
    won: bool = False
    teams: dict = dataclasses.field(default_factory=dict)  # team runs: {team: {"return", "won"}}, opponents too

    def score(self, names, reward, won) -> None:
        """Adds one step's [team] rewards and wins (marl.teams.team_scores) to `teams`."""
        for name, r, w in zip(names, np.asarray(reward), np.asarray(won)):
            team = self.teams.setdefault(name, {"return": 0.0, "won": False})
            team["return"] += float(r)
            team["won"] = team["won"] or bool(w)


def check_output(path: str) -> str:
    """The matplotlib writer for `path`'s extension, or RenderError (cheap: before any run is loaded)."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in FORMATS:
        raise RenderError(f"--render {path}: write a .gif or an .mp4 file, e.g. --render team.gif")
    from matplotlib import animation

    if not animation.writers.is_available(FORMATS[ext]):
        raise RenderError(f"--render {path}: writing {ext} needs {FORMATS[ext]}, which is not installed "
                          "(e.g. apt-get install ffmpeg); or write a .gif")
    return FORMATS[ext]


def _greedy_act(run: SavedRun):
    learner = run.parts.single_seed
    act = jax.jit(lambda params, carry, obs, avail, first, key:
                  learner.act(params, carry, obs[None], avail[None], first[None], key, learner.greedy)[:2])
    return act, learner.init_carry


def play_episodes(run: SavedRun, episodes: int, seed_index: int = 0, max_steps: int | None = None,
                  seed: int = 0) -> list[Episode]:
    """`episodes` greedy episodes of seed `seed_index`'s policy on fresh envs, each cut at
    `max_steps` env steps if given, recorded for drawing."""
    if not 0 <= seed_index < run.config.n_seeds:
        raise RenderError(f"the run has seeds 0..{run.config.n_seeds - 1}, not {seed_index}; pass one of those")
    params = seed_params(run, seed_index)
    act, init_carry = _greedy_act(run)
    key = jax.random.PRNGKey(run.config.seed + 30_000 + seed)
    env = run.parts.env
    # a whole episode: the evaluator's horizon (jaxmarl's MPE runs max_steps + 1 steps)
    limit = max_steps or (env.spec.episode_limit + 1 if env.spec.episode_limit else 10_000)
    if env.spec.backend == "jax":
        scores = teams.team_scores(env)
        env, names, score = scores or (env, (), None)
        reset, step = jax.jit(env.reset), jax.jit(env.step)  # compiled once for every episode
        score = None if score is None else jax.jit(score)
        return [_play_jax(env, reset, step, score, names, params, act, init_carry, k, limit)
                for k in jax.random.split(key, episodes)]
    return _play_pettingzoo(run, params, act, init_carry, key, episodes, limit)


def _whole_step(env, key, state, actions, next_state) -> tuple:
    """What the drawing replays of a step: (the key jaxmarl's step_env got, the whole env's
    state, every agent's actions); a team's view adds its opponents' (TeamJaxEnv.whole_step)."""
    if isinstance(env, teams.TeamJaxEnv):
        return env.whole_step(key, state, actions, next_state)
    # JaxEnv.step hands jaxmarl the first half of its key: the SMAX drawing replays the
    # step's world sub-steps with that same key, so the frames show the game played
    return jax.random.split(key)[0], state, actions


def _play_jax(env, reset, step, score, names, params, act, init_carry, key, limit: int) -> Episode:
    key, reset_key = jax.random.split(key)
    ts, state = reset(reset_key)
    carry, episode = init_carry(1), Episode([])
    for _ in range(limit):
        key, act_key, step_key = jax.random.split(key, 3)
        actions, carry = act(params, carry, ts.obs, ts.avail_actions, ts.first, act_key)
        actions = actions[0]
        before = state
        ts, state = step(step_key, state, actions)
        episode.steps.append(_whole_step(env, step_key, before, actions, state))
        episode.ret += float(jnp.mean(ts.reward))
        if score is not None:
            episode.score(names, *score(ts, state))
        if bool(ts.first):  # the episode ended (the env has already reset)
            episode.won = bool(np.asarray(ts.won).flat[0])  # (a whole SMAX's [allies, enemies]: the allies')
            break
    return episode


def _play_pettingzoo(run: SavedRun, params, act, init_carry, key, episodes: int, limit: int) -> list[Episode]:
    from marl import envs

    c = run.config
    try:
        env = envs.make(c.env_id, **{**c.env_kwargs, "render_mode": "rgb_array"})
    except EnvError:
        raise RenderError(f"{c.env_id} cannot render: its parallel_env takes no render_mode; "
                          "only envs with render_mode='rgb_array' can be rendered") from None
    scores = teams.team_scores(env)
    out = []
    for e in range(episodes):
        ts, carry, episode = env.reset(seed=c.seed + 30_000 + e), init_carry(1), Episode([])
        for _ in range(limit):
            frame = env.env.render()
            if not isinstance(frame, np.ndarray) or frame.ndim != 3:
                raise RenderError(f"{c.env_id} cannot render: render() with render_mode='rgb_array' "
                                  f"gave {type(frame).__name__}, not an RGB frame")
            episode.steps.append(frame)
            key, act_key = jax.random.split(key)
            actions, carry = act(params, carry, ts.obs, ts.avail_actions, ts.first, act_key)
            ts = env.step(np.asarray(actions[0]))
            episode.ret += float(np.mean(ts.reward))
            if scores is not None:
                episode.score(scores[1], *scores[2](ts, env))
            if ts.first:
                episode.won = bool(ts.won)
                break
        out.append(episode)
    env.env.close()
    return out


# ---------------------------------------------------------------------------- drawing
# Each drawer has a figure; its frames() draws one frame into it per step of the generator,
# and render_run grabs each.


class _SmaxDrawer:
    """jaxmarl's SMAX renderer: init_render draws one world sub-step into an axes."""

    def __init__(self, env, episodes: list[Episode]):
        from matplotlib.figure import Figure

        self.env = env.env  # jaxmarl's HeuristicEnemySMAX, or a team run's whole SMAX
        self.fig = Figure(figsize=(6, 5), dpi=SMAX_DPI)  # SMAXVisualizer's figure size
        self.ax = self.fig.add_subplot()
        self.fps = 16 // SMAX_SUBSTEP_STRIDE  # SMAXVisualizer's 64 ms a sub-step
        self.episodes = episodes

    def frames(self):
        agents, sub_steps = self.env.agents, self.env.world_steps_per_env_step
        # every unit that can shoot: the heuristic env's agents are the allies only
        units = getattr(self.env, "all_agents", agents)
        for episode in self.episodes:
            for t, (key, state, actions) in enumerate(episode.steps):
                act = {a: actions[i] for i, a in enumerate(agents)}
                states = jax.tree.map(np.asarray, self.env.step_env(key, state, act, get_state_sequence=True))
                for s in range(0, sub_steps, SMAX_SUBSTEP_STRIDE):
                    sub = jax.tree.map(lambda x: x[s], states)
                    shots = {a: int(sub.prev_attack_actions[i]) for i, a in enumerate(units)}
                    self.env.init_render(self.ax, (key, sub, shots), s, t)
                    yield


class _MpeDrawer:
    """jaxmarl's MPEVisualizer, over the states of every episode in turn."""

    def __init__(self, env, episodes: list[Episode]):
        from jaxmarl.environments.mpe.mpe_visualizer import MPEVisualizer

        states = [jax.tree.map(np.asarray, state) for e in episodes for _, state, _ in e.steps]
        with contextlib.redirect_stdout(io.StringIO()):  # it prints whether agents communicate
            self.vis = MPEVisualizer(env.env, states)
        self.fig, self.fps, self.n = self.vis.fig, 1000 // self.vis.interval, len(states)

    def frames(self):
        for i in range(self.n):
            self.vis.update(i)
            yield

    def close(self):
        import matplotlib.pyplot as plt

        plt.close(self.fig)  # the visualiser made it with pyplot


class _FrameDrawer:
    """PettingZoo's RGB frames, shown pixel for pixel."""

    def __init__(self, env, episodes: list[Episode]):
        from matplotlib.figure import Figure

        self.frames_ = [f for e in episodes for f in e.steps]
        h, w = self.frames_[0].shape[:2]
        self.fig = Figure(figsize=(w / 100, h / 100), dpi=100)
        ax = self.fig.add_axes((0, 0, 1, 1))
        ax.set_axis_off()
        self.image = ax.imshow(self.frames_[0])
        self.fps = int(getattr(env.env, "metadata", {}).get("render_fps", 10))

    def frames(self):
        for f in self.frames_:
            self.image.set_data(f)
            yield


def _drawer(run: SavedRun, episodes: list[Episode]):
    env = run.parts.env
    if env.spec.backend != "jax":
        return _FrameDrawer(env, episodes)
    if env.kind == "smax":
        return _SmaxDrawer(env, episodes)
    if env.kind == "mpe":
        return _MpeDrawer(env, episodes)
    raise RenderError(f"{run.config.env_id} cannot render: no visualiser for jaxmarl {env.kind} envs "
                      "(SMAX, MPE and PettingZoo envs can)")


def render_run(run: SavedRun, path: str, episodes: int = 2, seed_index: int = 0,
               max_steps: int | None = None) -> dict:
    """Plays and writes `episodes` greedy episodes to `path` (.gif or .mp4); returns what
    was written: frames, their size in pixels, and each episode's return, length and win."""
    from matplotlib import animation

    writer_name = check_output(path)
    played = [e for e in play_episodes(run, episodes, seed_index, max_steps) if e.steps]
    if not played:
        raise RenderError("no step was played; pass --render-steps 1 or more")
    drawer = _drawer(run, played)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    writer = animation.writers[writer_name](fps=drawer.fps)
    n = 0
    try:
        with writer.saving(drawer.fig, path, dpi=drawer.fig.dpi):
            for _ in drawer.frames():
                writer.grab_frame()
                n += 1
    finally:
        getattr(drawer, "close", lambda: None)()
    width, height = drawer.fig.canvas.get_width_height()
    return {"path": path, "frames": n, "width": width, "height": height, "fps": drawer.fps,
            "checkpoint": run.checkpoint, "seed": seed_index,
            "episodes": [{"return": e.ret, "length": len(e.steps), "won": e.won, **({"teams": e.teams} if e.teams else {})}
                         for e in played]}


# the training flow's GIFs (RunConfig.render_every): one greedy episode, cut this short so
# that drawing it costs a few seconds of one worker
TRAINING_RENDER_STEPS = 25


def render_checkpoint(run_dir: str, iteration: int, max_steps: int = TRAINING_RENDER_STEPS) -> dict | None:
    """A Dask task of the training flow: one greedy episode (at most `max_steps` env steps)
    of the run's checkpoint at `iteration` (the latest one before it where there is none
    there), drawn as a GIF; returns render_run's summary with the GIF's bytes ("gif") and the
    iteration asked for, or None while the run has no checkpoint at or before it."""
    import tempfile

    from pipelines.saved_run import load_run
    from storage import Checkpointer

    with Checkpointer(os.path.join(run_dir, "checkpoints")) as checkpoints:
        steps = [s for s in checkpoints.all_steps() if s <= iteration]
    if not steps:
        return None
    run = load_run(run_dir, checkpoint=steps[-1])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "episode.gif")
        done = render_run(run, path, episodes=1, max_steps=max_steps)
        with open(path, "rb") as f:
            gif = f.read()
    return {**done, "path": None, "gif": gif, "iteration": iteration,
            "env_steps": int(run.meta.get("env_steps", 0))}
