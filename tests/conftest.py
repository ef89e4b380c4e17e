"""Suite-wide defaults. Users get the whole executor ladder (``runtime.executors``); here the
ladder is ``eager, plan`` unless a test asks for more (``inductor=True``, ``executors=``),
so that only the tests of Inductor pay its 20-40 s cold compiles on a 2-core machine.
``tests/test_default_config.py`` trains the zoo under the users' defaults."""

import atexit
import os
import pathlib
import shutil
import tempfile

import pytest

os.environ.setdefault("AUTOPAR_EXECUTORS", "eager,plan")
# The native interpreter likewise: off unless a test asks for it (``native=True``), so that
# the suite's results do not depend on whether an earlier test built it.
os.environ.setdefault("AUTOPAR_NATIVE", "0")
# The profile store: a directory of this session's own, never the user's cache
# (~/.cache/autopar/profiles, profiling.store.default_dir) nor the working tree. Set at
# import, before any test runs, so that the processes the tests start (the warm-up worker,
# torchrun) inherit it; forced, so that a developer's own AUTOPAR_PROFILE_DIR is left alone.
_PROFILE_DIR = tempfile.mkdtemp(prefix="autopar-test-profiles-")
os.environ["AUTOPAR_PROFILE_DIR"] = _PROFILE_DIR
atexit.register(shutil.rmtree, _PROFILE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _forget_verdicts():
    """Each test starts with no remembered verdicts (``runtime.decisions``): the judge's
    verdicts live beside the session's profile store, and a test that trains a model another
    test trained would otherwise start on that verdict with no race."""
    yield
    for path in pathlib.Path(_PROFILE_DIR).glob("*.decisions.json"):
        path.unlink(missing_ok=True)
