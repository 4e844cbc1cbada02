"""Shared, real fixtures: one Prefect test server and one 2-worker LocalCluster per session,
and `marl` started as a user starts it, for the tests that stop it from outside."""

import os
import subprocess
import sys
import tempfile
import time

_TMP = tempfile.mkdtemp(prefix="marl-tests-")
# before anything imports prefect or jax: own Prefect home, shared JAX compile cache
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP, "prefect"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "marl-jax-cache-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_server():
    # Prefect binds its console log handler to the sys.stderr of its first full import; made
    # here, it is the session's, not the stream of the first test's capsys, which closes with
    # that test (the server's stop line then failed on it)
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.testing.utilities import prefect_test_harness

    ensure_logging_setup()

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def dask_cluster():
    from pipelines.cluster import make_cluster

    with make_cluster(n_workers=2, kind="cpu", dashboard_address="127.0.0.1:0") as cluster:
        yield cluster


@pytest.fixture
def embedded_env(tmp_path):
    """A subprocess environment for embedded Prefect, as on a user's machine: no server or
    database from the test session, and a fresh Prefect home, tmp_path/prefect."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "PREFECT_SERVER_DATABASE"))}
    return {**env, "PREFECT_HOME": str(tmp_path / "prefect")}


@pytest.fixture
def embedded_marl(tmp_path, embedded_env):
    """start(*args, ready=..., **popen): `marl ARGS` in a subprocess on embedded Prefect (its
    own temporary server, in a fresh Prefect home), returned once `ready(run)` holds while it
    runs; stderr piped, stdout dropped, popen's keywords (its own session, ...) passed on."""
    marl = os.path.join(os.path.dirname(sys.executable), "marl")

    def start(*args, ready, **popen):
        run = subprocess.Popen([marl, *args], env=embedded_env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, **popen)
        deadline = time.time() + 300
        while run.poll() is None and time.time() < deadline and not ready(run):
            time.sleep(0.2)
        assert run.poll() is None, f"`marl {args[0]}` ended before it was stopped: {run.stderr.read()}"
        return run

    return start
