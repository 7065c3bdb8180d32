"""Tests for ba_jax.rewards.sandbox_root: what the sandbox's minimal root holds.

What a program can and cannot see inside it is tested by running programs
(tests/test_rewards_code.py); these check the plan itself.
"""

import os
import sys

from ba_jax.rewards import sandbox_root

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_host_chain_records_each_symlink(tmp_path):
    (tmp_path / "real" / "lib").mkdir(parents=True)
    (tmp_path / "real" / "lib" / "libx.so.1.2").write_text("x")
    (tmp_path / "real" / "lib" / "libx.so.1").symlink_to("libx.so.1.2")
    (tmp_path / "lib").symlink_to("real/lib")  # relative, like /lib -> usr/lib
    (tmp_path / "alias").symlink_to(tmp_path / "lib" / "libx.so.1")  # absolute, via a link
    links = {}
    real = sandbox_root._host_chain(str(tmp_path / "alias"), links)
    assert real == str(tmp_path / "real" / "lib" / "libx.so.1.2")
    assert links == {str(tmp_path / "alias"): str(tmp_path / "lib" / "libx.so.1"),
                     str(tmp_path / "lib"): "real/lib",
                     str(tmp_path / "real" / "lib" / "libx.so.1"): "libx.so.1.2"}


def test_plan_holds_the_interpreter_and_nothing_of_the_project():
    python = os.path.realpath(sys.executable)
    plan = sandbox_root.make_root_plan(python)
    binds = {path: kind for path, kind in plan["binds"]}
    assert binds[python] == "file"
    assert binds["/dev/null"] == "dev"
    dirs = [p for p, kind in binds.items() if kind == "dir"]
    assert dirs and all(os.path.isfile(os.path.join(d, "os.py")) or d.endswith("lib-dynload")
                        for d in dirs), dirs  # the standard library, nothing broader
    for path in list(binds) + [link for link, _ in plan["links"]]:
        assert os.path.lexists(path), path
        assert not path.startswith(REPO + "/"), path  # no project file, no venv
    assert all(h.endswith(("/site-packages", "/dist-packages")) for h in plan["hide"])
