"""Where each thread's time went, from a py-spy raw profile (`py-spy record --threads --idle
--format raw`): per process and thread (thread ids dropped, so a pool's threads add up), its
share of the samples, the share in which it was not parked (waiting for work, a socket or a
child), and its most frequent innermost frames, busiest threads first, as a markdown table.

    python bench/profile_summary.py PROFILE.txt [--threads 12] [--frames 6] [--min-share 0.01]
                                    [--stacks-with FUNCTION]

bench/gpu.sh runs a loop part under py-spy with GPU_CHECK_PROFILE=1 and appends this table
to its tables.md: it shows what the store write waits on inside the loop (the GIL, zarr's
event loop, the disk, the device copy) where timing alone cannot.
"""

from __future__ import annotations

import argparse
import collections
import re


# innermost frames of a thread that is parked (waiting for work, a socket or a child), not
# working or waiting on something the loop's work asked for
PARKED = ("EpollSelector.select", "Condition.wait", "Event.wait", "_worker (concurrent/futures/thread.py:81)",
          "Connection._recv", "Popen.poll", "main (multiprocessing/resource_tracker.py")


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
    parser.add_argument("--threads", type=int, default=12, help="threads shown, most samples first")
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
