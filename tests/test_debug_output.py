"""AUTOPAR_DEBUG_DIR's run folders (``pipeline.run_dir``) are their user's only: they hold
the model's graphs, its profile and its errors."""

from __future__ import annotations

import os

from autopar.pipeline import run_dir


def test_a_run_folder_is_its_users_only(tmp_path):
    old = os.umask(0o022)  # the common default, which would leave it world-readable
    try:
        d = run_dir(str(tmp_path / "debug"))
    finally:
        os.umask(old)
    assert os.path.dirname(d) == str(tmp_path / "debug")
    assert os.path.basename(d).startswith(f"run-{os.getpid()}-")
    assert os.stat(d).st_mode & 0o7777 == 0o700
    assert run_dir(str(tmp_path / "debug")) == d  # claimed once per process
