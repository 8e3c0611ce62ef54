"""Process set-up of every command, nothing done at import time: faster memory allocation on
CPU machines (a restart with a glibc tunable), the multi-process start-up and its watchdog,
a CPU split into devices, JAX's persistent compilation cache, and ending the process with one
line (`exit_now`). `bertjax.cli` calls these with its flags' values."""

from __future__ import annotations

import os
import sys
import threading

from bertjax import accelerators
from bertjax.errors import BertjaxError, ConfigError

# XLA:CPU allocates a step's temporary buffers afresh on every call; glibc maps them fresh and
# the kernel zero-fills them 4 KiB page by page. Huge pages for malloc (glibc >= 2.35; older
# ones ignore the tunable) make those faults rare (docs/performance.md, "Speed on CPU", has
# the speed-up).
MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def restart_with_malloc_tunable() -> None:
    """On a Linux machine with no accelerator, runs this command again in place (same process
    id, arguments and environment, plus MALLOC_TUNABLE in GLIBC_TUNABLES), which glibc reads
    only at start-up. A GLIBC_TUNABLES that already sets glibc.malloc.hugetlb is left alone
    (=0 turns this off)."""
    import platform

    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if ("glibc.malloc.hugetlb" in tunables or not sys.platform.startswith("linux")
            or platform.libc_ver()[0] != "glibc" or accelerators.attached()):
        return
    env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, [tunables, MALLOC_TUNABLE])))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def initialize_distributed(config=None, *, distributed: bool = False,
                           coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """jax.distributed.initialize(): with `coordinator_address` (and `num_processes`,
    `process_id`) as given, with `distributed` from the detected cluster (a TPU pod slice);
    nothing without either. Call it before any other JAX call.

    config.distributed.timeout_s (multihost.distributed_timeout_s): once a process has
    sent no heartbeat for that long (its host dead, its process killed), every other one ends
    with one line naming it (multihost.Watchdog), and a finishing process waits that long for
    the others."""
    if not (coordinator_address or distributed):
        return
    import jax

    from bertjax.train import multihost

    timeout = int(multihost.distributed_timeout_s(config))
    if timeout <= 0:
        raise ConfigError(f"config.distributed.timeout_s={timeout} must be positive")
    # JAX's own heartbeat timeout is the fallback: bertjax's watchdog (multihost.Watchdog)
    # names a silent process after `timeout`, in one line on every process.
    bounds = dict(heartbeat_timeout_seconds=2 * timeout, shutdown_timeout_seconds=timeout)
    if coordinator_address:
        # Cross-process collectives on CPU (tests, laptops) go through gloo; no effect elsewhere.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                                   process_id=process_id, **bounds)
    else:
        try:
            jax.distributed.initialize(**bounds)
        except ValueError as e:  # no cluster detected (not a TPU pod slice, SLURM, ...)
            raise ConfigError(f"--distributed: {e} (no cluster was detected here; give "
                              "--coordinator_address, --num_processes and --process_id)"
                              ) from None
    multihost.start_watchdog(timeout, lambda line: exit_now(line, 1, lost=True))


# At most this many devices a CPU is split into (`split_cpu`); each holds a copy of the weights.
MAX_CPU_DEVICES = 4


def split_cpu(count: int | None = None) -> int:
    """On a machine with no accelerator, makes JAX's CPU backend `count` devices (None: one
    per core, at most MAX_CPU_DEVICES); call it before JAX starts. Returns the devices made,
    0 where nothing changed: an accelerator in use, one core, a count of 1, or the count
    already set by JAX_NUM_CPU_DEVICES or XLA_FLAGS (--xla_force_host_platform_device_count;
    then an explicit `count` is an error naming --cpu_devices)."""
    if count is not None and count < 1:
        raise ConfigError(f"--cpu_devices={count} must be positive")
    preset = ("JAX_NUM_CPU_DEVICES" if "JAX_NUM_CPU_DEVICES" in os.environ else "XLA_FLAGS"
              if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
              else None)
    if preset:
        if count is not None:
            raise ConfigError(f"--cpu_devices={count}: the CPU device count is already set by "
                              f"{preset}; give one of them")
        return 0
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if (platforms.split(",")[0] != "cpu") if platforms else accelerators.attached():
        return 0
    if count is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        count = min(cores, MAX_CPU_DEVICES)
    if count == 1:
        return 0
    import jax

    jax.config.update("jax_num_cpu_devices", count)
    return count


def turn_devices(cpu_devices: int | None, multi_process: bool) -> list | None:
    """The devices to run whole batches on in turn, or None: on a machine with no
    accelerator, in one process, the CPU split into `cpu_devices` (--cpu_devices;
    `split_cpu`); call it before JAX starts."""
    if multi_process:
        if cpu_devices is not None:
            raise ConfigError("--cpu_devices is for one process; a pod slice shards the "
                              "batches over the run's mesh")
        return None
    if not split_cpu(cpu_devices):
        return None
    import jax

    return jax.devices()


# The persistent compilation cache's bound when bertjax chooses its directory (least recently
# used programs go first).
COMPILATION_CACHE_BYTES = 2 << 30


def use_compilation_cache(given: str | None) -> str | None:
    """Keeps every compiled program, however quick to compile, in the --compilation_cache
    directory `given` (see the flag's help; None: JAX's or bertjax's default, '' none);
    returns the directory, None for none. A resumed or repeated run,
    a grid's next cell, a prediction over batches of the same shapes: each loads the programs
    instead of compiling them (on a CPU, compiling an input's batch shapes can take longer
    than running them)."""
    import jax

    directory = given if given is not None else jax.config.jax_compilation_cache_dir
    if directory is None:  # neither the flag nor JAX_COMPILATION_CACHE_DIR: bertjax's own
        home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        directory = os.path.join(home, "bertjax", "jax")
        jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)
    if not directory:
        return None
    if "://" not in directory:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            if given is None:  # an unwritable home: no cache, no failure
                return None
            raise ConfigError(f"--compilation_cache={directory}: {e.strerror} (give another "
                              "directory, or '' for none)") from None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return directory


_EXITING = threading.Lock()  # held by the thread that ends the process


def exit_now(line: str, status: int, linger: bool = True, lost: bool = False) -> None:
    """Prints `line` to stderr and ends the process at once, skipping the interpreter's
    shutdown: threads still running there (an asynchronous checkpoint save, orbax's and
    asyncio's finalisers, an XLA compile cut short) would print tracebacks after the one line,
    and JAX's shutdown barrier would wait for processes that are gone. Nothing is lost: orbax
    renames a checkpoint into place only once it is complete, and every file the run writes
    itself is closed or replaced whole before an error reaches here. Only the first thread to
    call this prints; another one waits for the end.

    On a multi-process run: linger: first wait (boundedly) for the other processes to stop too
    (they share the error). lost: `line` names a lost process (multihost.exit_line); every
    process prints the same one (the first recorded), and process 0, whose exit would end the
    others at once, waits for the others to have printed it."""
    if not _EXITING.acquire(blocking=False):
        threading.Event().wait()
    watchdog = None
    if "jax" in sys.modules:
        from bertjax.train import multihost

        watchdog = multihost.watchdog()
    if lost and watchdog is not None:
        line = watchdog.agree(line)
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    if watchdog is not None:
        watchdog.leave(line, wait_for_others=lost)
    if linger and not lost:
        _leave_other_processes()
    os._exit(status)


SHUTDOWN_GRACE_S = 10.0


def _leave_other_processes() -> None:
    """On a multi-process run, JAX's shutdown (a barrier of every process) for at most
    SHUTDOWN_GRACE_S: process 0 hosts the coordination service, and its exit ends the other
    processes at once, before they have printed their own line."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return
    leaving = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    leaving.start()
    leaving.join(SHUTDOWN_GRACE_S)


def lost_process(error: Exception) -> BertjaxError | None:
    """On a multi-process run, `error` as the loss of another process (multihost.lost_process);
    None for anything else (a bug: its traceback is shown)."""
    if "jax" not in sys.modules:  # no JAX, no other processes
        return None
    from bertjax.train import multihost

    return multihost.lost_process(error)
