r"""Launch bertjax on a Cloud TPU VM slice with gcloud: create, set up, run, watch, delete.

  python -m bertjax.tpu create --name=bert --zone=us-east5-a --accelerator_type=v5p-32 --spot
  python -m bertjax.tpu setup --name=bert --zone=us-east5-a
  python -m bertjax.tpu run --name=bert --zone=us-east5-a --accelerator_type=v5p-32 \
      --config=experiments/pretrain.py:base --workdir=gs://BUCKET/runs/base \
      -- --config.phases.phase1.data='gs://BUCKET/data/seq128/*.tfrecord'
  python -m bertjax.tpu logs|status|tensorboard|delete --name=bert --zone=us-east5-a

Everything after `--` goes to the job command unchanged (config overrides). Every command is
printed before it runs; `--print_only` prints them and runs nothing. The slice is requested
as a queued resource (named like the TPU) and `delete` removes both. `run` starts the same
command on every worker (one process per host, `--distributed` on multi-host slices), in the
background with its output in ~/bertjax-run.log, then follows worker 0's log (Ctrl-C stops
following, not the job). See docs/tpu.md.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence

from absl import flags

from bertjax import cli
from bertjax.errors import ConfigError

# The TPU software version per family (Cloud TPU docs, "TPU software versions": PyTorch/JAX).
RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}
# Accelerator type suffixes: v4/v5p count TensorCores (2 per chip), v5e/v6e count chips.
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5litepod": 1, "v6e": 1}
SINGLE_HOST_SIZES = {"v5litepod": (1, 4, 8), "v6e": (1, 4, 8)}
POD_SIZES = {"v5litepod": (16, 32, 64, 128, 256), "v6e": (16, 32, 64, 128, 256)}
CHIPS_PER_HOST = 4  # every multi-host slice of these families

REMOTE_DIR = "~/bertjax"
REMOTE_LOG = "~/bertjax-run.log"
JOBS = ("pretrain", "finetune")


@dataclasses.dataclass(frozen=True)
class Slice:
    """A Cloud TPU accelerator type, e.g. `v5p-32`: 16 chips on 4 hosts."""
    name: str
    family: str
    chips: int
    hosts: int


def parse_accelerator_type(name: str) -> Slice:
    """`v4-8`, `v5p-32`, `v5litepod-16`, `v6e-64` → Slice; anything else is a ConfigError."""
    accepted = ("v4-N (N = TensorCores: 8, 16, 32, ...), v5p-N (8, 16, 32, ...), "
                "v5litepod-N or v6e-N (N = chips: 1, 4, 8, 16, 32, 64, 128, 256)")
    match = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", name or "")
    if not match:
        raise ConfigError(f"--accelerator_type={name!r} is not a Cloud TPU type; expected "
                          f"{accepted}")
    family, size = match.group(1), int(match.group(2))
    if family in SINGLE_HOST_SIZES:
        if size not in SINGLE_HOST_SIZES[family] + POD_SIZES[family]:
            raise ConfigError(f"--accelerator_type={name}: no such {family} slice; expected "
                              f"{accepted}")
        chips = size
        hosts = 1 if size in SINGLE_HOST_SIZES[family] else size // CHIPS_PER_HOST
    else:
        if size < 8 or size % 8:
            raise ConfigError(f"--accelerator_type={name}: {family} sizes count TensorCores, "
                              f"a multiple of 8; expected {accepted}")
        chips = size // CORES_PER_CHIP[family]
        hosts = chips // CHIPS_PER_HOST
    return Slice(name, family, chips, hosts)


def runtime_version(tpu: Slice, version: str | None) -> str:
    """The --version to create the slice with: the family's default, or the user's, checked
    not to be another family's image."""
    if not version:
        return RUNTIME_VERSIONS[tpu.family]
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", version):
        raise ConfigError(f"--version={version!r} is not a TPU software version, e.g. "
                          f"{RUNTIME_VERSIONS[tpu.family]}")
    for family, default in RUNTIME_VERSIONS.items():
        if version == default and family != tpu.family:
            raise ConfigError(f"--version={version} is the {family} image; a {tpu.name} "
                              f"needs {RUNTIME_VERSIONS[tpu.family]}")
    return version


def _where(args) -> list[str]:
    """The zone (and project) flags every gcloud TPU command takes."""
    out = [f"--zone={args.zone}"]
    if args.project:
        out.append(f"--project={args.project}")
    return out


def _ssh(args, worker: str, command: str, extra: Sequence[str] = ()) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *_where(args),
            f"--worker={worker}", f"--command={command}", *extra]


def create(args) -> list[list[str]]:
    tpu = parse_accelerator_type(args.accelerator_type)
    if args.spot and args.reserved:
        raise ConfigError("--spot and --reserved exclude each other; pick one (or neither for "
                          "on-demand)")
    command = ["gcloud", "compute", "tpus", "queued-resources", "create", args.name,
               f"--node-id={args.name}", *_where(args),
               f"--accelerator-type={tpu.name}",
               f"--runtime-version={runtime_version(tpu, args.version)}"]
    command += ["--spot"] * bool(args.spot) + ["--reserved"] * bool(args.reserved)
    return [command]


def _install_script(python: str) -> tuple[str, str]:
    """Shell run on every worker: (get a Python that has jaxlib wheels -- the TPU images ship
    Ubuntu's 3.10 --, install bertjax with its pins and libtpu into a venv in the source)."""
    if not re.fullmatch(r"3\.\d+", python):
        raise ConfigError(f"--python={python!r}: expected a version such as 3.11")
    exe = f"python{python}"
    get_python = (f"command -v {exe} >/dev/null || {{ sudo add-apt-repository -y "
                  f"ppa:deadsnakes/ppa && sudo apt-get update -q && sudo apt-get install -y -q "
                  f"{exe} {exe}-venv; }}")
    install = (f"cd {REMOTE_DIR} && {exe} -m venv .venv && "
               f'.venv/bin/pip install --quiet --upgrade pip && '
               f'.venv/bin/pip install --quiet -e ".[tpu]"')
    return get_python, install


def setup(args) -> list[list[str]]:
    """Copies the source to every worker (this checkout's committed HEAD, or a git URL with an
    optional #revision) and installs it there."""
    source = args.source
    if "://" in source or source.startswith("git@"):
        url, _, revision = source.partition("#")
        fetch = f"rm -rf {REMOTE_DIR} && git clone --quiet {shlex.quote(url)} {REMOTE_DIR}"
        if revision:
            fetch += f" && git -C {REMOTE_DIR} checkout --quiet {shlex.quote(revision)}"
        commands = []
    else:
        archive = f"/tmp/bertjax-{args.name}.tar.gz"
        commands = [
            # HEAD only: uncommitted edits are not shipped (commit them first).
            ["git", "-C", source, "archive", "--format=tar.gz", f"--output={archive}", "HEAD"],
            ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive, f"{args.name}:bertjax.tar.gz",
             *_where(args), "--worker=all"],
        ]
        fetch = (f"rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && "
                 f"tar -xzf ~/bertjax.tar.gz -C {REMOTE_DIR}")
    get_python, install = _install_script(args.python)
    # `a || b && c` is `(a || b) && c` in sh: the Python check goes first.
    return commands + [_ssh(args, "all", f"{get_python} && {fetch} && {install}")]


def _logs(args, follow: bool) -> list[str]:
    tail = "tail -n +1 -F" if follow else "tail -n 100"
    return _ssh(args, "0", f"{tail} {REMOTE_LOG}")


def run(args, job_args: Sequence[str] = ()) -> list[list[str]]:
    """The same job command on every worker, in the background, then worker 0's log."""
    tpu = parse_accelerator_type(args.accelerator_type)
    if args.job not in JOBS:
        raise ConfigError(f"--job={args.job!r}: expected one of {', '.join(JOBS)}")
    if tpu.hosts > 1 and "://" not in args.workdir:
        raise ConfigError(f"--workdir={args.workdir} is local, but a {tpu.name} has {tpu.hosts} "
                          f"hosts that must share one workdir: use gs://BUCKET/PATH")
    job = [".venv/bin/python", "-m", f"bertjax.{args.job}", f"--config={args.config}",
           f"--workdir={args.workdir}", *job_args]
    if tpu.hosts > 1:
        job.append("--distributed")
    # nohup + redirected stdin: the job outlives the ssh session.
    start = (f"cd {REMOTE_DIR} && nohup {shlex.join(job)} > {REMOTE_LOG} 2>&1 < /dev/null &")
    commands = [_ssh(args, "all", start)]
    if args.follow:
        commands.append(_logs(args, follow=True))
    return commands


def status(args) -> list[list[str]]:
    return [["gcloud", "compute", "tpus", "queued-resources", "describe", args.name,
             *_where(args)],
            _ssh(args, "all", 'pgrep -af "[p]ython -m bertjax" || echo "no bertjax job"')]


def logs(args) -> list[list[str]]:
    return [_logs(args, follow=args.follow)]


def tensorboard(args) -> list[list[str]]:
    """TensorBoard on worker 0, reading the workdir's event files, forwarded to localhost."""
    port = int(args.port)
    logdir = shlex.quote(f"{args.workdir.rstrip('/')}/tensorboard")
    command = (f"cd {REMOTE_DIR} && .venv/bin/tensorboard --logdir={logdir} --port={port} "
               f"--host=localhost")
    return [_ssh(args, "0", command, ["--", "-L", f"{port}:localhost:{port}"])]


def delete(args) -> list[list[str]]:
    # --force deletes the TPU VMs with their queued resource.
    return [["gcloud", "compute", "tpus", "queued-resources", "delete", args.name, *_where(args),
             "--force", "--quiet"]]


def define_flags() -> None:
    flags.DEFINE_string("name", None, "Name of the TPU (and of its queued resource).")
    flags.DEFINE_string("zone", None, "Zone of the TPU, e.g. us-east5-a (docs/tpu.md lists "
                        "where each family is).")
    flags.DEFINE_string("project", None, "Google Cloud project (default: gcloud's).")
    flags.DEFINE_string("accelerator_type", None, "Cloud TPU type: v4-8, v5p-32, "
                        "v5litepod-16, v6e-64, ...")
    flags.DEFINE_string("version", None, "create: TPU software version (default: the "
                        "family's JAX image, e.g. v2-alpha-tpuv5 for v5p).")
    flags.DEFINE_bool("spot", False, "create: Spot capacity (cheaper, can be preempted).")
    flags.DEFINE_bool("reserved", False, "create: from the project's reservation.")
    flags.DEFINE_string("source", None, "setup: what to install: a local git checkout (its "
                        "committed HEAD; default: this one) or a git URL[#revision].")
    flags.DEFINE_string("python", "3.11", "setup: Python version for the workers' venv.")
    flags.DEFINE_enum("job", "pretrain", list(JOBS), "run: bertjax.pretrain or "
                      "bertjax.finetune.")
    flags.DEFINE_string("config", None, "run: --config of the job, e.g. "
                        "experiments/pretrain.py:base (a path inside the installed source).")
    flags.DEFINE_string("workdir", None, "run, tensorboard: the job's --workdir (gs:// for "
                        "multi-host slices).")
    flags.DEFINE_bool("follow", True, "run, logs: keep streaming worker 0's log.")
    flags.DEFINE_integer("port", 6006, "tensorboard: local (and remote) port.")
    flags.DEFINE_bool("print_only", False, "Print the commands without running them.")


_WHERE = ("name", "zone")
# command → (function, required flags, optional flags)
COMMANDS = {
    "create": (create, (*_WHERE, "accelerator_type"), ("project", "version", "spot", "reserved")),
    "setup": (setup, _WHERE, ("project", "source", "python")),
    "run": (run, (*_WHERE, "accelerator_type", "config", "workdir"), ("project", "job", "follow")),
    "status": (status, _WHERE, ("project",)),
    "logs": (logs, _WHERE, ("project", "follow")),
    "tensorboard": (tensorboard, (*_WHERE, "workdir"), ("project", "port")),
    "delete": (delete, _WHERE, ("project",)),
}
COMMON = ("print_only",)


def commands_for(argv: Sequence[str]) -> list[list[str]]:
    """The command lines for argv = [program, command, *job args after `--`]; flags parsed."""
    function, args = cli.command_args(argv[:2], {
        name: (fn, req, opt + COMMON) for name, (fn, req, opt) in COMMANDS.items()})
    extra = list(argv[2:])
    if extra and function is not run:
        sys.exit(f"error: {argv[1]}: unexpected argument {extra[0]!r}")
    if function is setup and args.source is None:
        import pathlib

        args.source = str(pathlib.Path(__file__).resolve().parent.parent)
    return function(args, extra) if function is run else function(args)


def execute(commands: Sequence[Sequence[str]], print_only: bool) -> None:
    """Prints each command (as a shell line) and, unless print_only, runs it; the first that
    fails stops the rest."""
    for command in commands:
        print(shlex.join(command), flush=True)
        if print_only:
            continue
        try:
            code = subprocess.run(command).returncode
        except FileNotFoundError:
            sys.exit(f"error: {command[0]} not found; install the Google Cloud CLI (gcloud)")
        except KeyboardInterrupt:
            if any(part.startswith("--command=tail ") for part in command):
                print("stopped following the log; the job keeps running", flush=True)
                return
            sys.exit(f"error: interrupted: {shlex.join(command)}")
        if code:
            sys.exit(f"error: exit status {code} from: {shlex.join(command)}")


def main(argv: Sequence[str]) -> None:
    commands = commands_for(argv)
    execute(commands, flags.FLAGS.print_only)


if __name__ == "__main__":
    cli.run(main, define_flags)
