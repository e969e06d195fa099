"""The suite itself: a private cache per test session, and the `slow` marker on the long statistical tests."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from castspec.cost import CostProfile, profile_key, profile_path
from castspec.env import cache_dir
from conftest import TEST_CACHE

ROOT = Path(__file__).resolve().parent.parent


def test_the_session_cache_is_a_fresh_temporary_directory():
    user_cache = Path.home() / ".cache" / "castspec"
    assert cache_dir() == Path(TEST_CACHE) != user_cache
    assert Path(TEST_CACHE).parent == Path(tempfile.gettempdir())
    # what castspec saves goes there (a cost profile, as Engine.cost_profile saves one after its probe)
    path = profile_path(cache_dir(), profile_key("cpu", "float32", "t", "d"))
    CostProfile({"device": "cpu"}, [1, 2], [10], [[1.0, 2.0]], [1.0]).save(path)
    assert path.is_relative_to(TEST_CACHE) and path.is_file()


def test_subprocesses_use_the_session_cache():
    """Servers and CLI runs started by tests resolve the same directory."""
    code = "from castspec.models.load import cache_dir; print(cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == TEST_CACHE == os.environ["CASTSPEC_CACHE"]


def test_a_process_that_imports_conftest_again_shares_the_session_cache():
    """A Ray worker or nested pytest imports conftest afresh: it must neither make (and leak) a directory of its
    own nor own, and so remove, the session's."""
    code = "import conftest; print(conftest.TEST_CACHE, conftest.OWNS_TEST_CACHE)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == [TEST_CACHE, "False"]


def collected(*args: str) -> set[str]:
    """Test ids pytest collects from test_sampling.py with `args` (the project's addopts apply, as in make test)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "--strict-markers", *args,
                          "tests/test_sampling.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return {line for line in run.stdout.splitlines() if "::" in line}


def test_slow_marks_the_statistical_law_tests_and_plain_pytest_still_runs_them():
    everything, quick = collected(), collected("-m", "not slow")  # --strict-markers: `slow` is registered
    slow = everything - quick
    assert slow and quick < everything  # plain pytest, as make test runs it, keeps the slow tests
    assert all("law" in name for name in slow)
    assert any("test_sampled_decoding_preserves_the_target_law" in name for name in slow)
