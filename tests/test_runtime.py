"""Simulated CPU devices that cannot deadlock: independent programs with collectives in
flight at once (tests/deadlock_worker.py) finish with `runtime.simulate_devices`'s pool,
and, as a check that the worker still meets the failure it guards against, deadlock with
XLA's default pool. Each process is killed with SIGKILL past a hard timeout."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("deadlock_worker.py")


def _run(args, timeout):
  """(finished, output) of the worker; killed (SIGKILL, its whole process group) past `timeout`."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC", "JAX_ENABLE_X64")}
  proc = subprocess.Popen(
    [sys.executable, str(WORKER), *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    start_new_session=True,
  )
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    return False, out
  return proc.returncode == 0 and "done" in out, out


def test_collectives_in_flight_at_once_finish_with_the_sized_pool():
  finished, out = _run([], timeout=240)
  assert finished, out[-3000:]


@pytest.mark.slow  # 15 s: the control, killed when it hangs
def test_the_same_programs_deadlock_with_xlas_default_pool():
  finished, out = _run(["--default-pool"], timeout=15)  # the sized pool finishes in about 3.5 s
  assert not finished, "with XLA's default pool the worker finished: it no longer shows the deadlock"
