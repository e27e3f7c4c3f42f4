r"""Start N local processes of a script over `jax.distributed`: multi-host on one box.

    python scripts/launch.py --processes 2 --devices-per-process 4 -- \
        scripts/train.py --attention ring --steps 100

Every process gets the coordinator (127.0.0.1 and a free port), the process count and
its index in the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID; `models.runtime.initialize_distributed` reads them), and
`--xla_force_host_platform_device_count=D` in XLA_FLAGS, so that each process has D
simulated CPU devices (collectives between processes use gloo). Output lines are
prefixed with `[pI]`.

When a process exits with an error, or the `--timeout` passes, the others are killed
with SIGKILL (a JAX process swallows SIGTERM) and the launcher exits non-zero: the
failing process's code, or 124 on a timeout. It exits 0 once every process has. After a
failure it prints one line per process with how it ended (exit code or signal, and the
first error line of its traceback, or "killed by the launcher"). A traceback is shown
whole or not at all: one the launcher's kill would cut is left out. gloo's per-rank
"connected" lines are left out too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """The docstring as written, each option's default after its help (as models.cli's,
  which imports jax: this one serves the scripts that must not, this launcher and
  scripts/aot.py)."""

  def _get_help_string(self, action):
    return action.help if "(default" in (action.help or "") else super()._get_help_string(action)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
  p.add_argument("--processes", type=int, default=2, help="how many processes")
  p.add_argument("--devices-per-process", type=int, default=4, help="simulated CPU devices per process")
  p.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
  p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
  args = p.parse_args(argv)
  if args.command and args.command[0] == "--":
    args.command = args.command[1:]
  if not args.command:
    p.error("give the script to run after --, e.g. -- scripts/train.py --steps 10")
  if args.processes < 1 or args.devices_per_process < 1:
    p.error(f"--processes={args.processes} and --devices-per-process={args.devices_per_process} must be >= 1")
  return args


def free_port() -> int:
  """A TCP port that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(index: int, processes: int, devices: int, port: int) -> dict[str, str]:
  """The environment of process `index`."""
  env = dict(os.environ)
  flags = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
  )
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
  env["JAX_NUM_PROCESSES"] = str(processes)
  env["JAX_PROCESS_ID"] = str(index)
  env["PYTHONUNBUFFERED"] = "1"
  return env


# gloo prints one "[Gloo] Rank r is connected to n peer ranks. Expected number of
# connected peer ranks is : n" line per rank, from threads that interleave them.
_GLOO = re.compile(
  r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : ?"
)
_TRACEBACK_HEADS = ("Traceback (most recent call last)", "During handling of", "The above exception")
# A traceback held this long with its process still running is complete: shown.
_IDLE_FLUSH = 2.0


class _Output:
  """One process's output on its way to the launcher's stdout: gloo's per-rank lines
  (whole or torn by threads) are dropped, and a traceback is held until it is known
  to be whole (its process exited on its own, or kept running after it), so that one
  cut by the launcher's kill is left out instead of shown in part."""

  def __init__(self, index: int, lock: threading.Lock):
    self.index, self.lock = index, lock
    self.held: list[str] = []
    self.last = 0.0
    self.gloo = 0  # gloo line heads whose count has not come yet
    self.error: str | None = None  # the first error line of its first traceback

  def _write(self, lines) -> None:
    for line in lines:
      sys.stdout.write(f"[p{self.index}] {line}")
    sys.stdout.flush()

  def _clean(self, line: str) -> str | None:
    """The line without gloo's noise; None when nothing else is left."""
    line, heads = _GLOO.subn("", line)
    self.gloo += heads
    if self.gloo and re.fullmatch(r"\s*\d+\s*", line):
      self.gloo -= 1
      return None
    return None if heads and not line.strip() else line

  def add(self, line: str) -> None:
    line = self._clean(line)
    if line is None:
      return
    with self.lock:
      if line.startswith(_TRACEBACK_HEADS[0]) or self.held:
        self.held.append(line)
        self.last = time.monotonic()
        if self.error is None and line[:1].strip() and not line.startswith(_TRACEBACK_HEADS):
          self.error = line.strip()
      else:
        self._write([line])

  def flush(self, idle: float = 0.0) -> None:
    """Shows the held traceback (only if nothing came for `idle` seconds)."""
    with self.lock:
      if self.held and time.monotonic() - self.last >= idle:
        self._write(self.held)
        self.held = []

  def drop(self) -> None:
    with self.lock:
      self.held = []


def _relay(output: _Output, stream) -> None:
  for line in iter(stream.readline, ""):
    output.add(line)
  stream.close()


def _kill(procs) -> None:
  for proc in procs:
    if proc.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
  for proc in procs:
    proc.wait()


def exit_cause(code: int, killed: bool, error: str | None) -> str:
  """One line on how a process ended: exit code or signal, and its first error line."""
  if killed:
    return "killed by the launcher (SIGKILL)"
  if code < 0:
    try:
      cause = f"killed by {signal.Signals(-code).name}"
    except ValueError:
      cause = f"killed by signal {-code}"
  else:
    cause = f"exit code {code}"
  return cause if error is None else f"{cause}: {error}"


def launch(args) -> int:
  """Runs the processes; returns the launcher's exit code."""
  port = args.port or free_port()
  command = [sys.executable, *args.command] if args.command[0].endswith(".py") else args.command
  lock = threading.Lock()
  procs, relays, outputs = [], [], []
  print(
    f"[launch] {args.processes} processes x {args.devices_per_process} devices, coordinator 127.0.0.1:{port}"
  )
  for i in range(args.processes):
    env = process_env(i, args.processes, args.devices_per_process, port)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(proc)
    print(f"[launch] process {i}: pid {proc.pid}", flush=True)
    outputs.append(_Output(i, lock))
    relay = threading.Thread(target=_relay, args=(outputs[i], proc.stdout), daemon=True)
    relay.start()
    relays.append(relay)

  def on_signal(signum, _frame):
    _kill(procs)
    sys.exit(128 + signum)

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  deadline = None if args.timeout is None else time.monotonic() + args.timeout
  code = 0
  while True:
    codes = [p.poll() for p in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      i, c = failed[0]
      print(f"[launch] process {i} exited with {c}; killing the others", flush=True)
      code = c if c > 0 else 128 - c  # -9 (killed by SIGKILL) -> 137
      break
    if all(c == 0 for c in codes):
      break
    if deadline is not None and time.monotonic() > deadline:
      print(f"[launch] timeout after {args.timeout:g} s; killing every process", flush=True)
      code = 124
      break
    for output, c in zip(outputs, codes):
      output.flush(idle=_IDLE_FLUSH if c is None else 0.0)
    time.sleep(0.05)
  # Those that ended by themselves finish their output first (whole tracebacks).
  ended = [p.poll() is not None for p in procs]
  for relay, done in zip(relays, ended):
    if done:
      relay.join(timeout=5)
  _kill(procs)
  for relay in relays:
    relay.join(timeout=5)
  for output, done in zip(outputs, ended):
    output.flush() if done else output.drop()
  if code:
    for i, (proc, done) in enumerate(zip(procs, ended)):
      cause = exit_cause(proc.returncode, not done, outputs[i].error)
      print(f"[launch] process {i}: {cause}", flush=True)
  print(f"[launch] exit {code}", flush=True)
  return code


def main(argv=None):
  sys.exit(launch(parse_args(argv)))


if __name__ == "__main__":
  main()
