"""Start N local processes of a script over `jax.distributed`: multi-host on one box.

    python scripts/launch.py --processes 2 --devices-per-process 4 -- \\
        scripts/train.py --attention ring --steps 100

Every process gets the coordinator (127.0.0.1 and a free port), the process count and
its index in the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID; `models.runtime.initialize_distributed` reads them), and
`--xla_force_host_platform_device_count=D` in XLA_FLAGS, so that each process has D
simulated CPU devices (collectives between processes use gloo). Output lines are
prefixed with `[pI]`.

When a process exits with an error, or the `--timeout` passes, the others are killed
with SIGKILL (a JAX process swallows SIGTERM) and the launcher exits non-zero: the
failing process's code, or 124 on a timeout. It exits 0 once every process has.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _relay(index: int, stream, lock: threading.Lock) -> None:
  for line in iter(stream.readline, ""):
    with lock:
      sys.stdout.write(f"[p{index}] {line}")
      sys.stdout.flush()
  stream.close()


def _kill(procs) -> None:
  for proc in procs:
    if proc.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
  for proc in procs:
    proc.wait()


def launch(args) -> int:
  """Runs the processes; returns the launcher's exit code."""
  port = args.port or free_port()
  command = [sys.executable, *args.command] if args.command[0].endswith(".py") else args.command
  lock = threading.Lock()
  procs, relays = [], []
  print(
    f"[launch] {args.processes} processes x {args.devices_per_process} devices, coordinator 127.0.0.1:{port}"
  )
  for i in range(args.processes):
    env = process_env(i, args.processes, args.devices_per_process, port)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(proc)
    print(f"[launch] process {i}: pid {proc.pid}", flush=True)
    relay = threading.Thread(target=_relay, args=(i, proc.stdout, lock), daemon=True)
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
    time.sleep(0.05)
  _kill(procs)
  for relay in relays:
    relay.join(timeout=5)
  print(f"[launch] exit {code}", flush=True)
  return code


def main(argv=None):
  sys.exit(launch(parse_args(argv)))


if __name__ == "__main__":
  main()
