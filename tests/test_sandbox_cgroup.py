"""Tests for ba_jax.rewards.sandbox_cgroup: where the memory cgroups go, and their life.

That a program's memory (its processes together, and tmpfs pages) is held under the
ceiling is tested by running programs (tests/test_rewards_code.py); these check the probe
and that a slot's cgroup is made, limited and removed.
"""

import os

import pytest

from ba_jax.rewards import sandbox_cgroup


def _probe_or_skip():
    found, why = sandbox_cgroup.probe()
    if found is None:
        pytest.skip(f"no memory cgroup on this machine: {why}")
    return found


def test_probe_says_where_or_why_not():
    found, why = sandbox_cgroup.probe()
    if found is None:
        assert why.startswith("no memory cgroup: ") and len(why) > 30, why
    else:
        version, base = found
        assert version in ("v2", "v1") and os.path.isdir(base) and why == ""
        assert not [n for n in os.listdir(base) if n.startswith(sandbox_cgroup.PREFIX + "probe")]


def test_environment_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(sandbox_cgroup.ENV, str(tmp_path / "absent"))
    found, why = sandbox_cgroup.probe()
    assert found is None and sandbox_cgroup.ENV in why and "absent" in why


def test_slot_cgroup_is_made_limited_and_removed():
    version, base = _probe_or_skip()
    uid = 69999  # no slot uses it (slots are 60000..60063)
    group = sandbox_cgroup.SlotCgroup(version, base, uid)
    try:
        assert os.path.isdir(group.path) and group.path.startswith(base)
        group.set_limit(100 << 20)
        group.set_limit(300 << 20)  # raising and lowering both work (v1: memsw order)
        group.set_limit(200 << 20)
        name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        assert int(open(os.path.join(group.path, name)).read()) == 200 << 20
        assert group.oom_kills() == 0
        os.close(group.procs_fd())
    finally:
        group.remove()
    assert not os.path.exists(group.path)
