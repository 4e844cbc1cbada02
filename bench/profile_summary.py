"""Where each thread's time went, from a raw profile (`ThreadSampler`'s below, or py-spy's
`record --threads --idle --format raw`): per process and thread (thread ids dropped, so a
pool's threads add up), its share of the samples, the share in which it was not parked
(waiting for work, a socket or a child), and its most frequent innermost frames, busiest
threads first, as a markdown table.

    python bench/profile_summary.py PROFILE.txt [--threads 12] [--frames 6] [--min-share 0.01]
                                    [--stacks-with FUNCTION]

bench/gpu.sh with GPU_CHECK_PROFILE=1 samples each stages run of a loop part (ThreadSampler,
in the process: py-spy found no Python process to attach to on the TPU machine) and appends
this table to its tables.md: it shows what the store write waits on inside the loop (zarr's
event loop, the disk, the device copy) where timing alone cannot.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import threading


# innermost frames of a thread that is parked (waiting for work, a socket or a child), not
# working or waiting on something the loop's work asked for
PARKED = ("EpollSelector.select", "Condition.wait", "Event.wait", "_worker (concurrent/futures/thread.py:81)",
          "Connection._recv", "Popen.poll", "main (multiprocessing/resource_tracker.py")


class ThreadSampler:
    """Samples the Python stack of every thread of this process every `interval` seconds
    (sys._current_frames) while the block runs, and writes them to `path` in py-spy's raw
    format (one line per distinct stack: frames outermost first, then the count). A thread
    waiting for the GIL shows where it will go on; threads without Python frames (a device
    runtime's own) are not seen."""

    def __init__(self, path: str, interval: float = 0.02):
        self.path, self.interval = path, interval
        self.stacks: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._roots = sorted({os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)}, key=len, reverse=True)
        self._files: dict[str, str] = {}  # a code file -> its name as py-spy writes it, worked out once

    def _where(self, code) -> str:
        if code.co_filename not in self._files:
            name = os.path.abspath(code.co_filename)
            root = next((r for r in self._roots if name.startswith(r + os.sep)), None)
            self._files[code.co_filename] = name[len(root) + 1:] if root else os.path.basename(name)
        return self._files[code.co_filename]

    def _sample(self):
        me, pid = threading.get_ident(), os.getpid()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                frames = []
                while frame is not None:
                    code = frame.f_code
                    frames.append(f"{code.co_qualname} ({self._where(code)}:{frame.f_lineno})")
                    frame = frame.f_back
                thread = f"thread ({ident}): {names.get(ident, '')}"
                self.stacks[";".join([f"process {pid}:sampled", thread, *reversed(frames)])] += 1

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, name="profile-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        with open(self.path, "w") as f:
            f.writelines(f"{stack} {n}\n" for stack, n in self.stacks.items())


def threads_of(path: str, stacks_with: str = "") -> dict[str, collections.Counter]:
    """(process, thread name) -> Counter of innermost frames, weighted by samples; only the
    stacks that pass through `stacks_with` (e.g. a function's name), where it is given."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit() or stacks_with not in stack:
            continue
        frames = stack.split(";")
        process = [f.split(":", 1)[0] for f in frames if re.match(r"process \d+:", f)][-1:] or ["process ?"]
        thread = next((f for f in frames if f.startswith("thread (")), "thread (?)")
        name = re.sub(r"thread \(\d+\):?\s*", "", thread) or "(unnamed)"
        name = re.sub(r"[-_]\d+$", "", name)  # a pool's numbered threads as one
        inner = frames[-1] if frames[-1] != thread else "(no Python frame)"
        out[f"{process[0]} / {name}"][inner] += int(count)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--threads", type=int, default=12, help="threads shown, busiest first")
    parser.add_argument("--frames", type=int, default=6, help="innermost frames shown per thread")
    parser.add_argument("--min-share", type=float, default=0.01, help="hide frames under this share of the thread")
    parser.add_argument("--stacks-with", default="",
                        help="only the samples inside this function (e.g. write_region): where its time went")
    args = parser.parse_args()
    threads = threads_of(args.profile, args.stacks_with)
    total = sum(sum(c.values()) for c in threads.values()) or 1
    busy = {name: sum(c for f, c in frames.items() if not f.startswith(PARKED)) for name, frames in threads.items()}
    print("| process / thread | share of samples | not parked | innermost frames (share of the thread's samples) |")
    print("|---|---:|---:|---|")
    for name, frames in sorted(threads.items(), key=lambda kv: -busy[kv[0]])[:args.threads]:
        n = sum(frames.values())
        top = [f"{frame} {c / n:.0%}" for frame, c in frames.most_common(args.frames) if c / n >= args.min_share]
        print(f"| {name} | {n / total:.1%} | {busy[name] / n:.0%} | {'; '.join(top)} |")


if __name__ == "__main__":
    main()
