"""TLS for the Dask cluster: self-signed certificates made once into a directory, a
LocalCluster that speaks only TLS, a tiny training run through it, a plain client refused."""

import os
import stat

import pytest

from flows import checks
from pipelines.cluster import TLS_FILES, make_cluster, tls_security


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


def test_scheduler_and_tls_flags_must_agree(tmp_path):
    with pytest.raises(checks.InputError, match="speaks TLS; add --tls"):
        checks.tls_security(False, "tls://127.0.0.1:8786")
    with pytest.raises(checks.InputError, match="needs a tls:// scheduler"):
        checks.tls_security(str(tmp_path / "tls"), "tcp://127.0.0.1:8786")
    assert checks.tls_security(False, "tcp://127.0.0.1:8786") is None


def test_a_tiny_run_through_a_tls_cluster_and_a_plain_client_refused(tmp_path, prefect_server):
    from distributed import Client

    from flows.train import marl_train

    security = tls_security(str(tmp_path / "tls"))
    with make_cluster(n_workers=2, kind="cpu", dashboard_address="127.0.0.1:0", security=security) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://127.0.0.1:")
        # a client without the certificates cannot talk to it, over tcp:// or tls://
        with pytest.raises((OSError, TimeoutError)):
            Client(address.replace("tls://", "tcp://"), timeout="3s")
        with pytest.raises((OSError, TimeoutError, TypeError, ValueError)):
            Client(address, timeout="3s")
        result = marl_train(preset="qmix-smac-tiny", env_steps=1024, run_dir=str(tmp_path / "run"),
                            scheduler_address=address, tls=str(tmp_path / "tls"))
    assert result["env_steps"] == 1024 and result["iterations"] == 2
