"""Process set-up before the first JAX computation: simulated CPU devices when there is
no accelerator, and the multi-controller runtime (`jax.distributed`) when the job
spans several processes.

    python scripts/train.py --coordinator 10.0.0.1:1234 --num-processes 4 --process-id 0

Where the processes come from, in order: the flags (`add_flags`); the environment that
`scripts/launch.py` sets (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID);
a cluster that `jax.distributed.initialize()` detects by itself (Slurm, Open MPI,
Cloud TPU, ...); otherwise one process.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.metadata
import logging
import os

# Seconds without a heartbeat after which the coordinator declares a process dead and
# the survivors abort. JAX's default is 100 s; a short one ends a broken job sooner.
HEARTBEAT_TIMEOUT = 30


# XLA's CPU collectives wait for every simulated device's thread: by default they warn
# after 20 s and abort the process after 40 s ("Termination timeout ... only 7 of them
# arrived on time"), which a loaded 2-core machine reaches while a compile runs beside
# the collective. Simulated devices get minutes instead. The names are those of the
# jaxlib versions below (XLA aborts on a flag it does not know); with another jaxlib
# nothing is added.
CPU_COLLECTIVE_TIMEOUTS = {
  "xla_cpu_collective_call_warn_stuck_timeout_seconds": 120,
  "xla_cpu_collective_call_terminate_timeout_seconds": 900,
  "xla_cpu_collective_timeout_seconds": 900,
}
TIMEOUT_FLAGS_JAXLIB = ("0.10.",)

log = logging.getLogger(__name__)


def with_collective_timeouts(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) with XLA's CPU collective timeouts raised
  (`CPU_COLLECTIVE_TIMEOUTS`), each one unless `flags` already sets it."""
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return flags
  if not version.startswith(TIMEOUT_FLAGS_JAXLIB):
    log.info("jaxlib %s: XLA's CPU collective timeouts left at their defaults", version)
    return flags
  for name, seconds in CPU_COLLECTIVE_TIMEOUTS.items():
    if f"--{name}=" not in flags:
      flags = f"{flags} --{name}={seconds}"
  return flags.strip()


# XLA's CPU client runs each device's part of a program on a thread of one pool of
# max(cores, devices) threads, and a part that reaches a collective holds its thread
# until every device's part has arrived. Several programs with collectives in flight at
# once (independent programs dispatched back to back: a model run op by op, or work
# from several Python threads) can fill the pool with parts of different programs, each
# waiting for devices whose parts have no thread left: a deadlock ("Expected 8 threads
# to join the rendezvous, but only 3 of them arrived"), on a loaded 2-core machine
# most easily. The client keeps at most 32 programs in flight per device
# (`max_inflight_computations_per_device` in openxla/xla's cpu_client_options.h), so a
# pool of 32 threads a device can never run dry. XLA sizes its pool from the NPROC
# environment variable (`DefaultThreadPoolSize`), read when the client starts.
INFLIGHT_PER_DEVICE = 32


def safe_cpu_pool(count: int) -> None:
  """Sizes XLA's CPU client pool for `count` simulated devices so that programs with
  collectives cannot deadlock it (see INFLIGHT_PER_DEVICE): NPROC = 32 x count, unless
  NPROC is set already. Before the first JAX computation."""
  os.environ.setdefault("NPROC", str(INFLIGHT_PER_DEVICE * max(1, int(count))))


def release_free_memory() -> bool:
  """Hand the host memory the process has freed back to the system (glibc's
  `malloc_trim`); True where it could. A compile frees most of what it used, but glibc
  keeps the freed heap, and a step's temporaries are fresh mappings that cannot reuse
  it: on 8 simulated devices, fine-tuning Gemma 3 270M held 1.1 GiB of a finished
  compile's garbage through its first step. No-op on other C libraries."""
  name = ctypes.util.find_library("c")
  try:
    trim = ctypes.CDLL(name).malloc_trim if name else None
  except (OSError, AttributeError):
    trim = None
  if trim is None:
    return False
  trim(ctypes.c_size_t(0))
  return True


def simulate_devices(count: int) -> None:
  """Asks XLA for `count` host-platform (CPU) devices, with its CPU collective timeouts
  raised (`with_collective_timeouts`) and a client pool that collectives cannot
  deadlock (`safe_cpu_pool`); call before the first JAX computation (importing jax is
  fine). A flag already in XLA_FLAGS wins; on a machine with accelerators the CPU
  devices are simply not the default."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    flags = f"{flags} --xla_force_host_platform_device_count={count}"
  os.environ["XLA_FLAGS"] = with_collective_timeouts(flags)
  safe_cpu_pool(count)


def add_flags(parser: argparse.ArgumentParser, devices: int = 8) -> None:
  """--devices, --coordinator, --num-processes, --process-id, --heartbeat-timeout."""
  parser.add_argument(
    "--devices", type=int, default=devices, help="simulated CPU devices per process when no accelerator"
  )
  parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordinator")
  parser.add_argument("--num-processes", type=int, default=None, help="processes in the job")
  parser.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1")
  parser.add_argument(
    "--heartbeat-timeout",
    type=int,
    default=HEARTBEAT_TIMEOUT,
    help="seconds after which a silent process counts as dead and the job aborts",
  )


def _cluster_detected() -> bool:
  """Whether a cluster that `jax.distributed.initialize()` configures by itself is around."""
  try:
    from jax._src.clusters import ClusterEnv
  except ImportError:  # the detection moved: fall back to explicit settings only
    return False
  envs = getattr(ClusterEnv, "_cluster_types", [])
  return any(not env.opt_in_only_method and env.is_env_present() for env in envs)


def initialize_distributed(
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  heartbeat_timeout: int = HEARTBEAT_TIMEOUT,
) -> bool:
  """Starts `jax.distributed` when the job has several processes; returns whether it
  did. Arguments left None come from the environment (see the module docstring)."""
  import jax

  env = os.environ
  coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = int(env["JAX_PROCESS_ID"])
  if coordinator is not None:
    if num_processes is None or process_id is None:
      raise ValueError(
        f"coordinator={coordinator!r} needs num_processes and process_id too; got "
        f"{num_processes=}, {process_id=}"
      )
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if num_processes == 1:
      return False
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
      heartbeat_timeout_seconds=heartbeat_timeout,
    )
    return True
  if num_processes is not None or process_id is not None:
    raise ValueError(f"{num_processes=} and {process_id=} need a coordinator HOST:PORT too")
  if _cluster_detected():
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout)
    return jax.process_count() > 1
  return False


def limit_malloc(arenas: int = 2, mmap_threshold: int = 131072) -> bool:
  """glibc's allocator settings `run_demo.sh` exports (MALLOC_ARENA_MAX=2,
  MALLOC_MMAP_THRESHOLD_=131072), set from inside the process with `mallopt`, before
  JAX starts its threads: at most `arenas` heaps, and blocks from `mmap_threshold` bytes
  up mapped on their own, so freed step buffers go back to the system. Without them
  glibc keeps an arena per thread and its freed memory: Gemma 3 270M's fine-tuning step
  on 8 simulated devices peaked about 0.9 GiB higher. An environment that sets either
  variable keeps its own. False where glibc is not the C library (nothing changed)."""
  import ctypes
  import ctypes.util
  import os

  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  m_mmap_threshold, m_arena_max = -3, -8  # glibc's malloc.h
  done = True
  if "MALLOC_ARENA_MAX" not in os.environ:
    done &= mallopt(m_arena_max, arenas) == 1
  if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    done &= mallopt(m_mmap_threshold, mmap_threshold) == 1
  return bool(done)


def setup(args: argparse.Namespace) -> None:
  """Devices, then the distributed runtime, from the flags of `add_flags`."""
  simulate_devices(args.devices)
  initialize_distributed(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)


def is_main_process() -> bool:
  """True on process 0: the one that prints, writes reports and plots."""
  import jax

  return jax.process_index() == 0
