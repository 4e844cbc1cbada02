"""The training flow's GIFs (`--set render_every=N`): every N-th evaluation, and the last one,
one short greedy episode of the checkpoint at that iteration is drawn on a Dask worker
(pipelines/render.py), kept as `<run_dir>/renders/iteration-<I>.gif` and shown in a Prefect
markdown artifact (one key per run dir, so the UI keeps the history of renders).

The evaluated parameters themselves stay on the workers; the checkpoint of that iteration
holds the same ones where checkpoint_every divides the iteration (the presets' evaluations
at multiples of checkpoint_every, and always the last), else the latest checkpoint before
it is drawn, and the artifact says which.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

INLINE_BYTES = 2_000_000  # GIFs up to this size go into the artifact itself (a data: URL)
WAIT_S = 600.0  # how long the end of a run waits for its renders


class TrainingRenders:
    def __init__(self, client, config, logger):
        self.client, self.config, self.logger = client, config, logger
        self.every = int(getattr(config, "render_every", 0) or 0)
        self.running: list[tuple[int, object]] = []  # (iteration, future)
        self.asked: set[int] = set()
        self.published: dict | None = None

    def due(self, row: dict) -> bool:
        """Every render_every-th evaluation, counted by iteration (evaluations come every
        eval_every iterations), so a resumed run keeps the same ones."""
        if not self.every or "test_win_rate" not in row:
            return False
        i, every = int(row["iteration"]), self.config.eval_every
        return i % every == 0 and (i // every) % self.every == 0

    def on_row(self, row: dict, where) -> None:
        if self.due(row):
            self._submit(int(row["iteration"]), where)
        self._publish_done()

    def _submit(self, iteration: int, where) -> None:
        from pipelines.render import render_checkpoint

        if iteration in self.asked:
            return
        self.asked.add(iteration)
        worker = getattr(where, "evaluator", None)
        future = self.client.submit(render_checkpoint, os.path.abspath(self.config.run_dir), iteration,
                                    workers=[worker] if worker else None, allow_other_workers=True,
                                    pure=False, priority=-2)
        self.running.append((iteration, future))

    def _publish_done(self, wait: bool = False) -> None:
        if wait and self.running:
            from distributed import wait as dask_wait

            try:
                dask_wait([f for _, f in self.running], timeout=WAIT_S)
            except TimeoutError:
                pass
        still = []
        for iteration, future in sorted(self.running, key=lambda x: x[0]):
            if future.status == "pending":
                if wait:
                    self.logger.warning("the GIF of iteration %d was not drawn within %.0f s; left out",
                                        iteration, WAIT_S)
                    future.cancel()
                else:
                    still.append((iteration, future))
                continue
            try:
                done = future.result()
            except Exception as e:  # a render is a picture of the run, never a reason to fail it
                from flows.checks import one_line

                self.logger.warning("the GIF of iteration %d could not be drawn: %s: %s", iteration,
                                    type(e).__name__, one_line(e)[:300])
                continue
            if done is not None:
                self._publish(done)
        self.running = still

    def finish(self, history: list[dict], where) -> str | None:
        """The last evaluation's GIF (drawn now if it was not due), every render waited for;
        returns the path of the last one published."""
        if self.every:
            tested = [r for r in history if "test_win_rate" in r]
            if tested:
                self._submit(int(tested[-1]["iteration"]), where)
        self._publish_done(wait=True)
        return self.published["path"] if self.published else None

    def _publish(self, done: dict) -> None:
        """A markdown artifact with the GIF inline (a data: URL, which the Prefect UI's markdown
        shows as an image; an image artifact would also print the whole URL as its text)."""
        from prefect.artifacts import create_markdown_artifact

        from flows.artifacts import artifact_key

        if self.published and self.published["iteration"] > done["iteration"]:
            return
        c = self.config
        path = os.path.join(os.path.abspath(c.run_dir), "renders", f"iteration-{done['iteration']}.gif")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(done["gif"])
        if len(done["gif"]) <= INLINE_BYTES:
            url = "data:image/gif;base64," + base64.b64encode(done["gif"]).decode("ascii")
        else:
            url = Path(path).as_uri()
        (episode,) = done["episodes"]
        which = (f"checkpoint {done['checkpoint']}" if done["checkpoint"] == done["iteration"] else
                 f"checkpoint {done['checkpoint']}, the latest at the evaluation of iteration {done['iteration']}")
        rows = [("policy", f"{which} ({done['env_steps']:,} env steps), greedy"),
                ("episode", f"{episode['length']} env steps, return {episode['return']:.3g}, "
                            f"{'won' if episode['won'] else 'not won'}"),
                ("frames", f"{done['frames']} of {done['width']}x{done['height']} at {done['fps']} fps"),
                ("file", f"`{path}`")]
        markdown = "\n".join([f"# {c.preset}: {c.algo} on {c.env_id}, iteration {done['iteration']}", "",
                               f"![one greedy episode]({url})", "", "| | |", "|---|---|",
                               *(f"| {k} | {v} |" for k, v in rows)])
        create_markdown_artifact(markdown, key=artifact_key(c, "render"),
                                 description=f"{c.algo} on {c.env_id}, {which}: one greedy episode")
        self.published = {"iteration": done["iteration"], "path": path}
