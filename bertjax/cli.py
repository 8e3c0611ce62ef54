"""Shared command-line plumbing for every `python -m bertjax.*` command: absl flags, bad
flags and bad input reported as one `error: ...` line (TensorFlow's start-up noise is kept out
by bertjax/tf_setup.py unless TF_CPP_MIN_LOG_LEVEL is set by the user).

Job commands (pretrain, finetune, finetune_grid) take `--config=FILE:ARG` (ml-collections,
every field overridable as `--config.a.b=value`) and `--workdir`.

A known failure (a BertjaxError, a missing or unwritable file) is one `error: ...` line and exit
status 1; `--verbose` or BERTJAX_TRACEBACK=1 shows its traceback instead (for bug reports).
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import re
import shlex
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

from absl import app, flags, logging

from bertjax import runtime
from bertjax.errors import BertjaxError, ConfigError


def _offending_flag(message: str, argv: Sequence[str]) -> str | None:
    """The --config.* argument that an ml_collections error message refers to, if any."""
    names = re.findall(r"'(\w+)'", message)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg.split("=", 1)[0][len("--config."):].split(".")
        if any(name in path for name in names):
            return arg
    return None


def _config_file_error(message: str) -> str | None:
    """The one line that matters of ml_collections' "Error whilst parsing config file" (which
    embeds a whole traceback): the flag and the error our config code raised."""
    if "Traceback (most recent call last)" not in message:
        return None
    flag = message.split(": ", 1)[0].removeprefix("flag ")  # --config=experiments/x.py:arg
    last = [line.strip() for line in message.splitlines() if line.strip()][-1]
    last = re.sub(r"^(\w+\.)*(\w+Error|\w+Exception): ", "", last)
    return f"{flag}: {last}"


def _check_config_file() -> None:
    """ml_collections defers a --config file that cannot be read until its first use; say so
    now, in one line."""
    if "config" not in flags.FLAGS or not flags.FLAGS["config"].present:
        return
    try:
        config = flags.FLAGS.config
        if not isinstance(config, str):  # `bertjax.tpu --config` is the job's, passed on
            config.get("seed")
    except OSError as e:
        reason = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
        sys.exit(f"error: --config={flags.FLAGS['config'].serialize().split('=', 1)[-1]}: "
                 f"{reason}")


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl flags parser for app.run: any bad flag or config override exits with one line."""
    try:
        rest = flags.FLAGS(argv)
        _check_config_file()
        return rest
    except flags.Error as e:  # several missing flags: one message line each
        message = _config_file_error(str(e)) or "; ".join(
            line.strip() for line in str(e).splitlines() if line.strip())
        sys.exit(f"error: {message} (--help lists the flags)")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        # ml_collections reports unknown fields and bad values as plain exceptions.
        message = " ".join(str(e).replace("\\n", " ").strip("'\"").split())
        culprit = _offending_flag(message, argv)
        where = f"{culprit}: " if culprit else ""
        sys.exit(f"error: bad config override {where}{message}")


def typed_like(current, text: str, where: str):
    """`text` parsed as the type of the config value `current` (bool: true/false/1/0; a list
    or dict: JSON); otherwise ConfigError "<where><text> is not a valid <type>" (`where`
    names the flag, e.g. "--grid: lr=")."""
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(current, int | float):
            return type(current)(text)
        if isinstance(current, str):
            return text
        return json.loads(text)  # json.JSONDecodeError is a ValueError
    except ValueError:
        raise ConfigError(f"{where}{text!r} is not a valid {type(current).__name__}") from None


def define_job_flags(example: str):
    """The flags every job command shares: --config, --workdir, --compilation_cache and the
    multi-process ones (`initialize_distributed`). Returns the config and workdir flag
    holders."""
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file("config", None, f"Config file, e.g. {example}.")
    workdir = flags.DEFINE_string("workdir", None, "Directory (local or gs://) for checkpoints, "
                                  "metrics and outputs; a rerun resumes from it.")
    define_distributed_flags()
    define_compilation_cache_flag()
    return config, workdir


def define_dry_run_flags(what: str) -> None:
    """The --dry_run / --topology / --dry_run_exact / --breakdown / --sweep / --sweep_seconds
    flags of a job command (bertjax.aot.dry_run.from_flags reads them); `what` says what the dry
    run reads (e.g. "the config's data")."""
    flags.DEFINE_bool("dry_run", False, f"Read {what}, print parameters, FLOPs and per-device "
                      "memory of the compiled train step; exit.")
    flags.DEFINE_string("topology", None, "With --dry_run: compile for this Cloud TPU slice "
                        "with the TPU compiler, on any machine (needs the tpu extra): v4-32, "
                        "v5p-128, v5litepod-16, v6e-64, v5p:4x4x4. The steps of 2 and 3 "
                        "unrolled layers are compiled and extrapolated to the model's layers.")
    flags.DEFINE_bool("dry_run_exact", False, "With --topology: compile the full step, every "
                      "layer unrolled, instead of extrapolating (slower).")
    flags.DEFINE_bool("breakdown", False, "With --topology: print where the step's HBM bytes, "
                      "FLOPs and time go, by category and by op.")
    flags.DEFINE_bool("sweep", False, "With --dry_run --topology: try meshes, batch sizes "
                      "and remat; list those that fit, fastest first, with their flags.")
    flags.DEFINE_integer("sweep_seconds", 600, "Compile-time budget of --sweep.")


def define_distributed_flags() -> None:
    """--distributed and the explicit multi-process flags (`initialize_distributed`)."""
    flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (one process "
                      "per host; auto-detected on TPU pod slices).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (without a "
                        "cluster to detect it, e.g. on CPUs).")
    flags.DEFINE_integer("num_processes", None, "Number of processes.")
    flags.DEFINE_integer("process_id", None, "This process's index.")


def initialize_distributed(config=None) -> None:
    """runtime.initialize_distributed as --distributed / --coordinator_address, --num_processes
    and --process_id ask (config.distributed.timeout_s: the watchdog's bound)."""
    FLAGS = flags.FLAGS
    runtime.initialize_distributed(config, distributed=FLAGS.distributed,
                                   coordinator_address=FLAGS.coordinator_address,
                                   num_processes=FLAGS.num_processes,
                                   process_id=FLAGS.process_id)


def define_cpu_devices_flag() -> None:
    """--cpu_devices (`turn_devices`)."""
    flags.DEFINE_integer("cpu_devices", None, "On a machine with no accelerator: JAX devices "
                         "the CPU is split into, whole batches on each in turn, the same "
                         "outputs (default: one per core, at most "
                         f"{runtime.MAX_CPU_DEVICES}; 1: one device).")


def turn_devices() -> list | None:
    """runtime.turn_devices as --cpu_devices asks (None on a multi-process run)."""
    FLAGS = flags.FLAGS
    return runtime.turn_devices(FLAGS.cpu_devices,
                                multi_process=FLAGS.distributed or bool(FLAGS.coordinator_address))


def define_compilation_cache_flag() -> None:
    """--compilation_cache (`use_compilation_cache`)."""
    flags.DEFINE_string("compilation_cache", None, "Directory keeping compiled programs across "
                        "runs (JAX's persistent compilation cache): a later run with the same "
                        "model and batch shapes skips compiling them. Default: "
                        "$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/bertjax/jax "
                        "(~/.cache/bertjax/jax); '' for none.")


def use_compilation_cache() -> str | None:
    """runtime.use_compilation_cache in the --compilation_cache directory."""
    return runtime.use_compilation_cache(flags.FLAGS.compilation_cache)


def require(value, flag: str, example: str):
    if not value:
        sys.exit(f"error: {flag} is required, e.g. {flag}={example}")
    return value


def show_tracebacks() -> bool:
    """--verbose or BERTJAX_TRACEBACK=1: known failures raise with their traceback."""
    verbose = "verbose" in flags.FLAGS and flags.FLAGS.is_parsed() and flags.FLAGS.verbose
    return verbose or os.environ.get("BERTJAX_TRACEBACK", "") not in ("", "0")


def error_line(e: BaseException) -> str:
    """The one `error: ...` line of a known failure (an OSError names its file)."""
    if isinstance(e, OSError) and not isinstance(e, BertjaxError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"error: {where}{e.strerror}"
    return f"error: {e}"


# What a user can cause: our own errors, and files that are missing, unreadable or unwritable
# (a workdir that is a file, a read-only or full disk).
KNOWN_ERRORS = (BertjaxError, OSError)


def report_errors(fn: Callable[[], object], known: tuple[type[BaseException], ...] = ()
                  ) -> object:
    """Runs `fn`; a known failure (KNOWN_ERRORS and `known`) becomes one `error:` line and
    exit status 1, or raises as it is with --verbose / BERTJAX_TRACEBACK=1."""
    try:
        return fn()
    except KNOWN_ERRORS + known as e:
        if show_tracebacks():
            raise
        sys.exit(error_line(e))


def _ours(filename: str) -> bool:
    return os.sep + "bertjax" + os.sep in filename and "site-packages" not in filename


class _OneLineLibraryReports(std_logging.Filter):
    """A library's log record that carries a traceback prints its message alone: under load, a
    failed checkpoint read's abandoned reads report late, each with a traceback, though the
    failure itself was already said in one line."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        if record.exc_info and not _ours(record.pathname) and not show_tracebacks():
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(error).__name__}: {error})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _library_frames_only(tb) -> bool:
    """No frame of bertjax's own in `tb` (none at all: a callback from native code)."""
    return not any(_ours(frame.filename) for frame in traceback.extract_tb(tb))


def quiet_library_reports() -> None:
    """Reports that libraries print with a traceback when their own background work fails
    (log records, an exception in one of their threads, one ignored in a finalizer) print as
    one line instead; --verbose or BERTJAX_TRACEBACK=1 keeps them whole. bertjax's own code
    is never shortened."""
    logging.get_absl_handler().addFilter(_OneLineLibraryReports())
    previous_thread_hook, previous_unraisable_hook = threading.excepthook, sys.unraisablehook

    def thread_hook(args):
        if show_tracebacks() or not _library_frames_only(args.exc_traceback):
            return previous_thread_hook(args)
        name = args.thread.name if args.thread is not None else "a thread"
        print(f"warning: {name}: {args.exc_type.__name__}: {args.exc_value}", file=sys.stderr)

    def unraisable_hook(unraisable):
        if show_tracebacks() or not _library_frames_only(unraisable.exc_traceback):
            return previous_unraisable_hook(unraisable)
        error = unraisable.exc_value
        print(f"warning: ignored {type(error).__name__}: {error}", file=sys.stderr)

    threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook


def run(main: Callable[[list[str]], None], define_flags: Callable[[], None] | None = None
        ) -> None:
    """absl's app.run with our flag parser; library INFO logs (orbax, jax) stay quiet, and a
    known failure (KNOWN_ERRORS, another process of the job lost) is one `error:` line, after
    which the process exits at once (runtime.exit_now). On CPU machines the
    command first restarts itself with faster memory allocation
    (runtime.restart_with_malloc_tunable).

    define_flags: defines the command's flags first (commands that define them in a function,
    so that modules imported together, e.g. by pytest, do not compete for flag names).
    """
    runtime.restart_with_malloc_tunable()
    if define_flags is not None:
        define_flags()
    if "verbose" not in flags.FLAGS:
        flags.DEFINE_bool("verbose", False, "Show the traceback of an error (as "
                          "BERTJAX_TRACEBACK=1 does) instead of its one line.")

    def quiet_main(argv):
        logging.set_verbosity(logging.WARNING)  # they would drown the progress line
        quiet_library_reports()
        try:
            return main(argv)
        except SystemExit as e:
            if isinstance(e.code, str):  # a failure the command reported in one line
                runtime.exit_now(e.code, 1)
            raise
        except KeyboardInterrupt as e:
            if show_tracebacks():
                raise
            # Training's Ctrl-C says what it saved (loop.Interrupted); 130 as for any Ctrl-C,
            # so a script's `pretrain && finetune` stops there.
            runtime.exit_now(str(e) or "error: interrupted (Ctrl-C)", 130)
        except Exception as e:
            if show_tracebacks():
                raise
            # A process of the job gone surfaces as whatever step failed (a collective, a
            # checkpoint save): it is named first.
            lost = runtime.lost_process(e)
            if lost is not None:
                from bertjax.train import multihost

                runtime.exit_now(multihost.exit_line(lost), 1, lost=True)
            if isinstance(e, KNOWN_ERRORS):
                runtime.exit_now(error_line(e), 1)
            raise

    app.run(quiet_main, flags_parser=parse_flags)


def run_command(args: list[str]) -> None:
    """Runs one of bertjax's own commands as a step of a demo: printed first, TensorFlow's
    info logs off. A failed step has already printed its own `error:` line; this adds one
    line naming the step instead of a traceback."""
    print("\n$ " + shlex.join(args), flush=True)
    code = subprocess.run(args, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")).returncode
    if code:
        raise BertjaxError(f"the step above failed (exit {code}): {shlex.join(args[1:3])}")


def run_flags_command(main: Callable[[flags.FlagValues], None],
                      define_flags: Callable[[], None]) -> None:
    """`run` for a command that takes flags only: main(flags.FLAGS); a positional argument, a
    BertjaxError or a ValueError (a flag value out of range) is one `error:` line."""
    def flags_main(argv: list[str]) -> None:
        if len(argv) > 1:
            sys.exit(f"error: unexpected arguments {argv[1:]}; flags are --name=value")
        report_errors(lambda: main(flags.FLAGS), known=(ValueError,))

    run(flags_main, define_flags)


def command_args(argv: Sequence[str], commands: dict) -> tuple[Callable, object]:
    """For commands with sub-commands (`python -m bertjax.convert from_tf ...`):
    `commands` maps a name to (function, required flag names, optional flag names). Returns
    (function, namespace of its flag values); misuse exits with one line."""
    import types

    names = ", ".join(commands)
    if len(argv) < 2:
        sys.exit(f"error: name a command ({names}); see --help")
    command, *extra = argv[1:]
    if command not in commands:
        sys.exit(f"error: unknown command {command!r}; expected one of {names}")
    if extra:
        sys.exit(f"error: {command}: unexpected argument {extra[0]!r}")
    function, required, optional = commands[command]
    for name in required:
        if flags.FLAGS[name].value is None:
            sys.exit(f"error: {command}: --{name} is required")
    ours = {name for _, req, opt in commands.values() for name in req + opt}
    for name in sorted(ours - set(required) - set(optional)):
        if flags.FLAGS[name].present:
            sys.exit(f"error: {command} does not take --{name}")
    values = {name: flags.FLAGS[name].value for name in required + optional}
    return function, types.SimpleNamespace(**values)


def load_config(spec: str):
    """The config of `FILE:ARG`, loaded from the file as `--config=FILE:ARG` loads it (bertjax
    never imports experiments/ as a package; commands take configs as files)."""
    from ml_collections import config_flags

    path = spec.split(":", 1)[0]
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    return config_flags.config_flags.ConfigFileFlagParser(name="config").parse(spec)
