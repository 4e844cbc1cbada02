"""`marl stack up / status / down`: real processes (Prefect server and worker, Dask scheduler
and workers) on free loopback ports in a temp home, one stack for the whole module."""

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from flows.stack import ROOT

pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _marl_stack(*args, env, timeout=400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "stack", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _stack_processes(state: dict) -> list[psutil.Process]:
    """Every live process of the stack: the recorded leaders and all their descendants."""
    procs = []
    for entry in state["components"].values():
        try:
            leader = psutil.Process(entry["pid"])
            procs += [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = str(tmp_path_factory.mktemp("stack") / "home")
    ports = {"prefect": _free_port(), "scheduler": _free_port(), "dashboard": _free_port()}
    # the worker polls every 2 s instead of 10: the deployment run starts sooner
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    flags = ["--home", home, "--prefect-port", str(ports["prefect"]), "--scheduler-port",
             str(ports["scheduler"]), "--dashboard-port", str(ports["dashboard"]), "--workers", "2"]
    started = time.perf_counter()
    up = _marl_stack("up", *flags, env=env)
    print(f"marl stack up: {time.perf_counter() - started:.1f} s")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        with open(os.path.join(home, "stack.json")) as f:
            state = json.load(f)
        yield {"home": home, "ports": ports, "env": env, "flags": flags, "up": up, "state": state}
    finally:  # whatever failed above, nothing may be left running
        if os.path.exists(os.path.join(home, "stack.json")):
            _marl_stack("down", "--home", home, env=env, timeout=120)


def test_up_starts_every_component_on_loopback(stack):
    ports, state = stack["ports"], stack["state"]
    out = stack["up"].stdout
    assert f"Prefect UI:      http://127.0.0.1:{ports['prefect']}" in out
    assert f"Dask dashboard:  http://127.0.0.1:{ports['dashboard']}/status" in out
    assert set(state["components"]) == {"prefect-server", "dask-scheduler", "dask-workers", "prefect-worker"}
    assert state["urls"]["dask_scheduler"] == f"tcp://127.0.0.1:{ports['scheduler']}"
    assert state["home"] == stack["home"]
    listeners = [c.laddr for p in _stack_processes(state) for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert {ports["prefect"], ports["scheduler"], ports["dashboard"]} <= {a.port for a in listeners}
    assert {a.ip for a in listeners} == {"127.0.0.1"}, listeners

    status = _marl_stack("status", "--home", stack["home"], env=stack["env"], timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    for name in state["components"]:
        assert any(line.split()[:2] == [name, "running"] for line in status.stdout.splitlines()), status.stdout
    assert "2/2 cpu workers" in status.stdout


def test_second_up_reuses_the_running_processes(stack):
    again = _marl_stack("up", *stack["flags"], env=stack["env"])
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("(reused)") == 4, again.stdout
    with open(os.path.join(stack["home"], "stack.json")) as f:
        state = json.load(f)
    assert {n: e["pid"] for n, e in state["components"].items()} == \
        {n: e["pid"] for n, e in stack["state"]["components"].items()}


def test_bad_input_is_one_clear_line(stack, tmp_path):
    with socket.socket() as taken:  # a port that some other program holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = _marl_stack("up", "--home", str(tmp_path / "other"), "--prefect-port", str(port), env=stack["env"])
    assert busy.returncode == 2
    first = busy.stderr.splitlines()[0]
    assert f"port {port} for the prefect-server is in use by another process" in first
    assert "--prefect-port" in first
    same = _marl_stack("up", "--home", str(tmp_path / "other"), "--scheduler-port", "4200", env=stack["env"])
    assert same.returncode == 2 and same.stderr.strip() == \
        "marl stack: the ports must differ; got --prefect-port 4200, --scheduler-port 4200, --dashboard-port 8787"
    assert not os.path.exists(tmp_path / "other" / "stack.json")


def test_deployment_run_completes_on_the_stack_scheduler(stack, tmp_path):
    from distributed import Client
    from prefect.client.orchestration import SyncPrefectClient

    urls = stack["state"]["urls"]
    env = {**stack["env"], "PREFECT_API_URL": urls["prefect_api"]}
    run_dir = str(tmp_path / "run")
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "marl-train/qmix-smac",
                          "-p", "preset=qmix-smac-tiny", "-p", "env_steps=1024", "-p", f"run_dir={run_dir}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    flow_run_id = next(line.split("UUID:")[1].strip() for line in run.stdout.splitlines() if "UUID:" in line)

    with SyncPrefectClient(urls["prefect_api"]) as client:
        deadline = time.monotonic() + 480
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state.is_final() or time.monotonic() > deadline:
                break
            time.sleep(2)
        print(f"deployment run: {time.perf_counter() - started:.1f} s, {flow_run.state.type.value}")
        assert flow_run.state.is_completed(), flow_run.state
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        logs = [log.message for log in client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))]
    # the tasks ran on the stack's scheduler, not on a cluster of the flow's own (the flow's
    # INFO log line with the dashboard is not always shipped to the API before the run ends)
    with Client(urls["dask_scheduler"], timeout=30) as dask_client:
        prefixes = dask_client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.task_prefixes))
    assert {"rollout", "write", "train", "evaluate"} <= set(prefixes), prefixes
    assert os.path.isdir(os.path.join(run_dir, "replay"))


def test_down_stops_everything(stack):
    procs = _stack_processes(stack["state"])
    assert len(procs) >= 6  # 4 leaders, 2 Dask worker processes under their nanny
    started = time.perf_counter()
    down = _marl_stack("down", "--home", stack["home"], env=stack["env"], timeout=120)
    print(f"marl stack down: {time.perf_counter() - started:.1f} s")
    assert down.returncode == 0, down.stdout + down.stderr
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, alive
    assert all(_port_free(port) for port in stack["ports"].values())
    status = _marl_stack("status", "--home", stack["home"], env=stack["env"], timeout=60)
    assert status.returncode == 1 and "down" in status.stdout


def test_up_with_tls_serves_tls_only_and_marl_train_connects_with_the_certificates(tmp_path):
    """`marl stack up --tls DIR` (a stack of its own): the scheduler and workers speak tls://
    with DIR's self-signed set, every listener on 127.0.0.1 (the dashboard http there);
    `marl train --scheduler tls://... --tls DIR` trains through it; a plain client, a tls://
    client without the certificates and `marl train` without --tls are refused; flow runs of
    its Prefect worker get the certificates (MARL_DASK_TLS), and connect() uses them."""
    from distributed import Client

    from pipelines.cluster import SCHEDULER_ENV, TLS_ENV, tls_security

    home, tls, run = str(tmp_path / "home"), str(tmp_path / "tls"), str(tmp_path / "run")
    ports = {"prefect": _free_port(), "scheduler": _free_port(), "dashboard": _free_port()}
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    flags = ["--home", home, "--prefect-port", str(ports["prefect"]), "--scheduler-port",
             str(ports["scheduler"]), "--dashboard-port", str(ports["dashboard"]), "--workers", "2"]
    started = time.perf_counter()
    up = _marl_stack("up", *flags, "--tls", tls, env=env)
    print(f"marl stack up --tls: {time.perf_counter() - started:.1f} s")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        address = f"tls://127.0.0.1:{ports['scheduler']}"
        assert f"Dask scheduler:  {address}" in up.stdout
        assert f"--scheduler {address} --tls {tls}" in up.stdout
        assert sorted(os.listdir(tls)) == ["ca.pem", "cert.pem", "key.pem"]
        with open(os.path.join(home, "stack.json")) as f:
            state = json.load(f)
        assert state["tls"] == tls
        listeners = [c.laddr for p in _stack_processes(state) for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert {a.ip for a in listeners} == {"127.0.0.1"}, listeners
        # the Dask processes were started with the certificates and encryption required
        for name in ("dask-scheduler", "dask-workers"):
            proc = psutil.Process(state["components"][name]["pid"])
            assert os.path.join(tls, "cert.pem") in proc.cmdline()
            assert proc.environ()["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
        worker_env = psutil.Process(state["components"]["prefect-worker"]["pid"]).environ()
        assert worker_env[SCHEDULER_ENV] == address and worker_env[TLS_ENV] == tls

        # refused: plain tcp://, tls:// without certificates (each in a process of its own,
        # left by os._exit: a Client whose connect failed can deadlock in its clean-up)
        for plain_address in (address.replace("tls://", "tcp://"), address):
            refused = subprocess.run(
                [sys.executable, "-c", "import os, sys\nfrom distributed import Client\n"
                 "try:\n    Client(sys.argv[1], timeout='5s')\nexcept Exception as e:\n"
                 "    print(type(e).__name__, flush=True); os._exit(3)\nos._exit(0)", plain_address],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            assert refused.returncode == 3, (plain_address, refused.stdout, refused.stderr)
        with Client(address, security=tls_security(tls), timeout=30) as client:
            assert len(client.scheduler_info()["workers"]) == 2
            assert all(a.startswith("tls://127.0.0.1:") for a in client.scheduler_info()["workers"])
        # a flow run of the stack's Prefect worker: connect() with its environment alone
        probe = subprocess.run(
            [sys.executable, "-c", "from pipelines.cluster import connect\n"
             "with connect() as c: print(c.scheduler.address, len(c.scheduler_info()['workers']))"],
            cwd=ROOT, env={**env, SCHEDULER_ENV: address, TLS_ENV: tls}, capture_output=True, text=True,
            timeout=120)
        assert probe.returncode == 0 and probe.stdout.split() == [address, "2"], probe.stdout + probe.stderr

        marl = [sys.executable, "-m", "flows.cli", "train", "qmix-smac-tiny", "--run-dir", run,
                "--env-steps", "1024", "--scheduler", address]
        plain = subprocess.run(marl, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert plain.returncode == 2 and "speaks TLS; add --tls" in plain.stderr, plain.stdout + plain.stderr
        assert len(plain.stderr.strip().splitlines()) == 1 and not os.path.exists(run)
        started = time.perf_counter()
        train = subprocess.run([*marl, "--tls", tls], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=400)
        print(f"marl train through the TLS stack: {time.perf_counter() - started:.1f} s")
        assert train.returncode == 0, train.stdout + train.stderr
        with Client(address, security=tls_security(tls), timeout=30) as client:
            prefixes = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.task_prefixes))
        assert {"rollout", "write", "train"} <= set(prefixes), prefixes  # on the stack's workers
        assert os.path.isdir(os.path.join(run, "checkpoints"))

        # plain `up` on the running TLS stack: one line, nothing restarted
        again = _marl_stack("up", *flags, env=env)
        assert again.returncode == 2 and "runs its dask-scheduler and dask-workers with --tls" in again.stderr
        assert psutil.Process(state["components"]["dask-scheduler"]["pid"]).is_running()
    finally:
        if os.path.exists(os.path.join(home, "stack.json")):
            _marl_stack("down", "--home", home, env=env, timeout=120)
