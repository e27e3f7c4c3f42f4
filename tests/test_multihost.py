"""Multi-process runs on this machine: 2 processes x 4 simulated CPU devices over
jax.distributed (gloo), started by scripts/launch.py.

Every wait has a hard timeout, and a launcher that overstays it is killed with its
whole process group (SIGKILL: JAX swallows SIGTERM), so a hang fails a test instead of
stalling the suite.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jax_ring.models.train.scratch import TrainConfig, train
from jax_ring.models.train.tasks import KeyValueTask

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, str(ROOT / "scripts" / "launch.py")]
TRAIN = ["scripts/train.py", "--seq-len=64", "--batch=4", "--dim=32", "--layers=1", "--eval-batches=0"]
SMALL = TrainConfig(batch=4, dim=32, layers=1, eval_batches=0, progress=False, out=None)
TASK = KeyValueTask(seq_len=64)
STEPS, EVERY = 20, 4  # schedule length and checkpoint interval of the training runs


def start(*args):
  """The launcher, in a process group of its own (it and the processes it starts)."""
  return subprocess.Popen(
    [*LAUNCH, *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )


def finish(proc, timeout: float) -> tuple[int, str]:
  """(exit code, output) of a started launcher; kills its group and fails past `timeout`."""
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"launcher still running after {timeout} s:\n{out[-3000:]}")
  return proc.returncode, out


def run(*args, timeout: float = 240):
  return finish(start(*args), timeout)


def no_noise(out: str) -> str:
  return "\n".join(line for line in out.splitlines() if "[Gloo]" not in line)


@pytest.mark.slow
def test_attention_across_two_processes():
  code, out = run("--timeout=220", "--", "tests/multihost_worker.py")
  assert code == 0, no_noise(out)[-4000:]
  for name in (
    "ring_causal_zigzag_segments_gqa_explicit",
    "ring_causal_zigzag_segments_gqa_auto",
    "ring_process_local_inputs",
    "dilated_subring_across_processes",
    "differing_host_inputs_rejected",
  ):
    assert f"[p0] ok {name}" in out and f"[p1] ok {name}" in out, no_noise(out)[-4000:]


def test_simulated_devices_raise_xla_cpu_collective_timeouts():
  """`runtime.simulate_devices` raises XLA's CPU collective timeouts unless the user set
  one (theirs stays), and this jaxlib knows every flag (XLA aborts on one it does not):
  a child process starts with them and runs a collective over its 4 devices."""
  child = (
    "import os\n"
    "from jax_ring.models import runtime\n"
    "runtime.simulate_devices(4)\n"
    "import jax, jax.numpy as jnp\n"
    "mesh = jax.make_mesh((4,), ('x',), axis_types=(jax.sharding.AxisType.Auto,))\n"
    "psum = lambda a: jax.lax.psum(a, 'x')\n"
    "total = jax.jit(jax.shard_map(psum, mesh=mesh, in_specs=jax.P('x'), out_specs=jax.P()))\n"
    "print(os.environ['XLA_FLAGS'])\n"
    "print(jax.device_count(), float(total(jnp.arange(4.0))[0]))\n"
  )
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_collective_timeout_seconds=7", JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  flags, result = done.stdout.splitlines()[-2:]
  assert result == "4 6.0"
  assert "--xla_force_host_platform_device_count=4" in flags.split()
  assert "--xla_cpu_collective_timeout_seconds=7" in flags.split()  # the user's own
  assert "--xla_cpu_collective_timeout_seconds=900" not in flags
  assert "--xla_cpu_collective_call_terminate_timeout_seconds=900" in flags.split()
  assert "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120" in flags.split()


def test_launcher_kills_everything_on_failure_and_on_timeout():
  """The others sleep 60 s: that the launcher, not their own end, stopped them shows in
  its report (each "killed by the launcher"); the hard timeout of 30 s kills a hang.
  Seconds are the benchmark's (bench_multihost.py), not a pass condition here."""
  py = sys.executable
  one_fails = "import os, sys, time\nif os.environ['JAX_PROCESS_ID'] == '1': sys.exit(3)\ntime.sleep(60)"
  code, out = run("--processes=3", "--", py, "-c", one_fails, timeout=30)
  assert code == 3 and "process 1 exited with 3" in out, out
  for survivor in (0, 2):
    assert f"process {survivor}: killed by the launcher" in out, out
  code, out = run("--timeout=1", "--", py, "-c", "import time; time.sleep(60)", timeout=30)
  assert code == 124 and "timeout after 1 s" in out, out
  assert "process 0: killed by the launcher" in out and "process 1: killed by the launcher" in out, out


# Process 1 fails only once process 0 has printed all it will (its greeting and the
# start of a traceback), which process 0 signals by creating the file named by argv[1]:
# the order is the event's, not sleeps' (a loaded machine can delay either process).
DYING = """
import os, sys, time
i = os.environ["JAX_PROCESS_ID"]
ready = sys.argv[1]
gloo = "[Gloo] Rank {} is connected to 7 peer ranks. Expected number of connected peer ranks is : "
print(gloo.format(2 * int(i)) + gloo.format(2 * int(i) + 1) + "7", flush=True)  # torn by threads
print("7", flush=True)
print("hello from", i, flush=True)
if i == "1":
  deadline = time.monotonic() + 20
  while not os.path.exists(ready):
    if time.monotonic() > deadline:
      raise TimeoutError("process 0 never signalled")
    time.sleep(0.01)
  raise RuntimeError("worker one broke")
print("Traceback (most recent call last):", flush=True)  # one the launcher's kill cuts
print('  File "survivor.py", line 3, in <module>', flush=True)
open(ready, "w").close()
time.sleep(60)
"""


def test_launcher_names_each_exit_cause_and_never_cuts_a_traceback(tmp_path):
  """After a failure: one line per process with its exit cause (the failing one's
  code and first error line; the survivor killed by the launcher), the failing
  process's traceback whole, the survivor's unfinished one absent, gloo's lines gone."""
  code, out = run("--", sys.executable, "-c", DYING, str(tmp_path / "ready"), timeout=60)
  assert code == 1, out
  assert "[launch] process 1: exit code 1: RuntimeError: worker one broke" in out, out
  assert "[launch] process 0: killed by the launcher (SIGKILL)" in out, out
  lines = out.splitlines()
  start = lines.index("[p1] Traceback (most recent call last):")
  assert lines[start + 1].startswith("[p1]   File") and "[p1] RuntimeError: worker one broke" in lines[start:]
  assert "survivor.py" not in out and "[p0] Traceback" not in out, out
  assert "Gloo" not in out and "[p0] 7" not in out and "[p1] 7" not in out, out
  assert "[p0] hello from 0" in out and "[p1] hello from 1" in out


def _losses(**changes):
  return np.array(train(dataclasses.replace(SMALL, **changes), TASK, log=lambda *_: None)["loss"])


def _keep_up_to(src, dst, step: int) -> str:
  """A copy of checkpoint folder `src` holding only the steps <= `step`."""
  shutil.copytree(src, dst)
  for entry in Path(dst).iterdir():
    if entry.name.isdigit() and int(entry.name) > step:
      shutil.rmtree(entry)
  return str(dst)


def _history(folder) -> np.ndarray:
  return np.array(json.loads((Path(folder) / "history.json").read_text())["loss"])


def _checkpoints(folder) -> list[int]:
  """Finalized orbax checkpoint steps in `folder`."""
  if not Path(folder).exists():
    return []
  return sorted(int(p.name) for p in Path(folder).iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_training_across_processes_layouts_and_a_killed_process(tmp_path):
  common = [*TRAIN, f"--steps={STEPS}", f"--ckpt-every={EVERY}", "--ckpt-keep=0", "--resume"]
  # One process x 8 devices: the uninterrupted run, whose checkpoint of step 4 the
  # others start from (writing checkpoints changes no loss: the resumes below say so).
  one = str(tmp_path / "one")
  full = _losses(steps=STEPS, ckpt_every=EVERY, ckpt_dir=one, ckpt_keep=0)

  # 2 processes x 4 devices resume the 1 x 8 checkpoint: each step equals 1 x 8's.
  two = _keep_up_to(one, tmp_path / "two", EVERY)
  code, out = run("--timeout=200", "--", *common, f"--ckpt-dir={two}", f"--out={tmp_path / 'h2'}")
  assert code == 0, no_noise(out)[-3000:]
  two_losses = _history(tmp_path / "h2")
  assert len(two_losses) == STEPS - EVERY
  np.testing.assert_allclose(two_losses[:EVERY], full[EVERY : 2 * EVERY], rtol=1e-6)

  # 1 x 8 resumes a checkpoint written by 2 x 4 (step 8).
  back = _keep_up_to(two, tmp_path / "back", 2 * EVERY)
  resumed = _losses(steps=STEPS, ckpt_every=EVERY, ckpt_dir=back, resume=True, stop_after=3 * EVERY)
  assert len(resumed) == EVERY
  np.testing.assert_allclose(resumed, two_losses[EVERY : 2 * EVERY], rtol=1e-6)

  # Kill one process of a 2 x 4 run once step 8 is checkpointed: the job fails at once.
  faulty = _keep_up_to(one, tmp_path / "faulty", EVERY)
  proc = start("--timeout=200", "--", *common, f"--ckpt-dir={faulty}", "--out=")
  pid = _pid_of_process_1(proc)
  deadline = time.monotonic() + 150
  while max(_checkpoints(faulty), default=0) < 2 * EVERY:
    if proc.poll() is not None or time.monotonic() > deadline:
      os.killpg(proc.pid, signal.SIGKILL)
      out = no_noise(proc.communicate()[0])[-3000:]
      pytest.fail(f"no checkpoint {2 * EVERY} (launcher exit {proc.poll()}):\n{out}")
    time.sleep(0.05)
  os.kill(pid, signal.SIGKILL)
  code, out = finish(proc, timeout=30)  # the hard limit; how soon it ends is bench_multihost.py's
  assert code != 0 and "process 1 exited with -9" in out, no_noise(out)[-3000:]
  assert "process 0: killed by the launcher" in out, no_noise(out)[-3000:]  # not left to finish

  # Resume from the last complete checkpoint: the losses of the uninterrupted run, exactly.
  latest = max(_checkpoints(faulty))
  assert latest >= 2 * EVERY
  code, out = run("--timeout=200", "--", *common, f"--ckpt-dir={faulty}", f"--out={tmp_path / 'h3'}")
  assert code == 0, no_noise(out)[-3000:]
  np.testing.assert_array_equal(_history(tmp_path / "h3"), two_losses[latest - EVERY :])


def _pid_of_process_1(proc, timeout: float = 60) -> int:
  """Reads the launcher's first lines, up to the one naming process 1's pid; a watchdog
  SIGKILLs the launcher's group past `timeout`, which ends the read."""
  watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
  watchdog.start()
  try:
    for line in proc.stdout:
      if "process 1: pid" in line:
        return int(line.split()[-1])
  finally:
    watchdog.cancel()
  pytest.fail(f"the launcher never named process 1's pid (killed after {timeout} s if it hung)")
