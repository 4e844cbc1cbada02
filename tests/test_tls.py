"""TLS for the Dask cluster: self-signed certificates made once into a directory, a
LocalCluster that speaks only TLS, a tiny training run through it, a plain client refused."""

import os
import stat
import subprocess
import sys

import pytest

from flows import checks
from pipelines.cluster import TLS_FILES, make_cluster, tls_security


# Each refused client runs in a process of its own, bounded: in-process, a Client whose
# connect failed can deadlock later (in __del__ when collected; a 13-minute hang was seen).
# os._exit skips that clean-up, and the subprocess timeout bounds whatever else may wait.
_REFUSED = """import os, sys
from distributed import Client
try:
    Client(sys.argv[1], timeout="3s")
except Exception as e:
    print(*(c.__name__ for c in type(e).__mro__), flush=True)
    os._exit(3)
os._exit(0)
"""


def refused(address: str) -> set[str]:
    """The names of the error's classes that a client without certificates gets from
    `address` (fails if it connects)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MARL_DASK", "DASK_DISTRIBUTED__COMM"))}
    proc = subprocess.run([sys.executable, "-c", _REFUSED, address], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, (address, proc.stdout, proc.stderr)
    return set(proc.stdout.split())


def test_self_signed_certificates_are_made_once_and_kept_private(tmp_path):
    directory = tmp_path / "tls"
    first = tls_security(str(directory))
    assert sorted(os.listdir(directory)) == sorted(TLS_FILES)
    assert stat.S_IMODE(os.stat(directory / "key.pem").st_mode) == 0o600
    before = (directory / "cert.pem").read_bytes()
    second = tls_security(str(directory))  # reused, not made again
    assert (directory / "cert.pem").read_bytes() == before
    assert first.require_encryption and second.tls_ca_file == str(directory / "ca.pem")
    os.remove(directory / "key.pem")
    with pytest.raises(ValueError, match="lacks key.pem"):
        tls_security(str(directory))


def test_tls_asked_of_a_threads_cluster_says_it_does_not_apply(tmp_path, caplog):
    # the TPU machines' cluster: workers as threads of this process, nothing on the network
    with make_cluster(n_workers=1, kind="threads", dashboard_address=None,
                      security=tls_security(str(tmp_path / "tls"))) as threads:
        assert all(a.startswith("inproc://") for a in threads.scheduler_info["workers"])
    assert "TLS does not apply to a threads cluster" in caplog.text


def test_scheduler_and_tls_flags_must_agree(tmp_path):
    with pytest.raises(checks.InputError, match="speaks TLS; add --tls"):
        checks.tls_security(False, "tls://127.0.0.1:8786")
    with pytest.raises(checks.InputError, match="needs a tls:// scheduler"):
        checks.tls_security(str(tmp_path / "tls"), "tcp://127.0.0.1:8786")
    assert checks.tls_security(False, "tcp://127.0.0.1:8786") is None


def test_a_tiny_run_through_a_tls_cluster_and_a_plain_client_refused(tmp_path, prefect_server):
    from flows.train import marl_train

    security = tls_security(str(tmp_path / "tls"))
    with make_cluster(n_workers=2, kind="cpu", dashboard_address="127.0.0.1:0", security=security) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://127.0.0.1:")
        # a client without the certificates cannot talk to it, over tcp:// or tls://
        assert refused(address.replace("tls://", "tcp://")) & {"OSError", "TimeoutError"}
        assert refused(address) & {"OSError", "TimeoutError", "TypeError", "ValueError"}
        result = marl_train(preset="qmix-smac-tiny", env_steps=1024, run_dir=str(tmp_path / "run"),
                            scheduler_address=address, tls=str(tmp_path / "tls"))
    assert result["env_steps"] == 1024 and result["iterations"] == 2
