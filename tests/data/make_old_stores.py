"""Remakes tests/data/replay-before-*: tiny stores written by earlier storage/replay.py code,
for tests/test_replay_integrity.py::test_stores_written_before_checksums_still_read.

    git show 5aea5fe^:storage/replay.py > /tmp/replay_a.py   # chunks equal to the fill value not written
    git show 9fd7cfc:storage/replay.py > /tmp/replay_b.py    # every chunk written, no crc32c
    python tests/data/make_old_stores.py /tmp/replay_a.py tests/data/replay-before-every-chunk
    python tests/data/make_old_stores.py /tmp/replay_b.py tests/data/replay-before-checksums
"""

import importlib.util
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

from test_replay_integrity import FIELDS, region_data  # noqa: E402

code, out = sys.argv[1:3]
spec = importlib.util.spec_from_file_location("old_replay", code)
old = importlib.util.module_from_spec(spec)
sys.modules["old_replay"] = old  # dataclasses look their module up
spec.loader.exec_module(old)
shutil.rmtree(out, ignore_errors=True)
names = [n for n in FIELDS if n != "obs"]
fields = {n: old.Field(FIELDS[n].shape, FIELDS[n].dtype, FIELDS[n].dims) for n in names}
store = old.ReplayStore.create(out, fields=fields, n_envs=2, steps_per_region=4, n_slots=3, attrs={"env_id": "test"})
for r in range(4):
    data = region_data(r)
    store.write_region(r, {n: data[n] for n in names}, iteration=r // 2, collector=r % 2, param_version=r // 2)
store.mark_trained(2, 1)
