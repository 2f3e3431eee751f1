"""tests.native: a crash, failure or skip in the child process becomes that test's outcome, naming the CPU."""

import os
import signal

import pytest

from tests.native import cpu_description, isolated, run_code


@isolated
def _segfaults(how: str):
    os.kill(os.getpid(), signal.SIGSEGV if how == "segv" else signal.SIGABRT)


@isolated
def _fails(value: int):
    assert value == 2, f"child saw {value}"


@isolated
def _skips():
    pytest.skip("nothing to do on this CPU")


@isolated
def _passes(value: int):
    assert value == 1


def test_a_crash_in_the_child_fails_the_test_naming_signal_and_cpu():
    with pytest.raises(pytest.fail.Exception, match=r"native crash \(signal 11 SIGSEGV\) in .*_segfaults on CPU .+ "
                                                    r"flags ") as info:
        _segfaults(how="segv")
    assert "Fatal Python error: Segmentation fault" in str(info.value)  # faulthandler's stack of the child
    with pytest.raises(pytest.fail.Exception, match=r"native crash \(signal 6 SIGABRT\)"):
        _segfaults(how="abort")
    with pytest.raises(pytest.fail.Exception, match=r"native crash \(signal 11 SIGSEGV\) in code snippet"):
        run_code("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")


def test_failures_skips_and_passes_in_the_child_are_reported_as_such():
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exit status 1.*AssertionError: child saw 1"):
        _fails(value=1)
    with pytest.raises(pytest.skip.Exception, match="nothing to do on this CPU"):
        _skips()
    _passes(value=1)
    run_code("import tests.native")  # the repository root is importable in the child


def test_cpu_description_names_model_and_simd_flags():
    text = cpu_description()
    assert " flags " in text
    if os.path.exists("/proc/cpuinfo") and "avx2" in open("/proc/cpuinfo").read():
        assert "avx2" in text.split(" flags ", 1)[1]
