"""`python -m bertjax.tpu ... --print_only`: the exact gcloud command lines, shell quoting that
survives two shells (the local one and the worker's), and one-line refusals."""

from __future__ import annotations

import shlex

import pytest
from conftest import run_python

from bertjax.errors import ConfigError
from bertjax.tpu import parse_accelerator_type, runtime_version

WHERE = ["--name=bert", "--zone=us-east5-a"]


def launch(command, *args):
    # --print_only before any `--`: after it, it would go to the job instead.
    result = run_python(["-m", "bertjax.tpu", command, "--print_only", *args])
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def refused(command, *args):
    result = run_python(["-m", "bertjax.tpu", command, "--print_only", *args])
    err = result.stderr.strip()
    assert result.returncode != 0 and result.stdout == "", result.stdout
    assert err.startswith("error:") and "\n" not in err, err
    return err


def remote_command(line: str) -> str:
    """The --command= of a printed gcloud ssh line, as the worker's shell receives it."""
    (command,) = [a for a in shlex.split(line) if a.startswith("--command=")]
    return command[len("--command="):]


def test_create_golden():
    assert launch("create", *WHERE, "--project=my-proj", "--accelerator_type=v5p-32",
                  "--spot") == [
        "gcloud compute tpus queued-resources create bert --node-id=bert --zone=us-east5-a "
        "--project=my-proj --accelerator-type=v5p-32 --runtime-version=v2-alpha-tpuv5 --spot"]
    assert launch("create", "--name=b2", "--zone=us-central2-b", "--accelerator_type=v4-8",
                  "--version=tpu-ubuntu2204-base", "--reserved") == [
        "gcloud compute tpus queued-resources create b2 --node-id=b2 --zone=us-central2-b "
        "--accelerator-type=v4-8 --runtime-version=tpu-ubuntu2204-base --reserved"]


def test_setup_golden():
    install = ('command -v python3.11 >/dev/null || { sudo add-apt-repository -y '
               'ppa:deadsnakes/ppa && sudo apt-get update -q && sudo apt-get install -y -q '
               'python3.11 python3.11-venv; }')
    venv = ('cd ~/bertjax && python3.11 -m venv .venv && .venv/bin/pip install --quiet '
            '--upgrade pip && .venv/bin/pip install --quiet -e ".[tpu]"')
    assert launch("setup", *WHERE, "--source=/src/bertjax") == [
        "git -C /src/bertjax archive --format=tar.gz --output=/tmp/bertjax-bert.tar.gz HEAD",
        "gcloud compute tpus tpu-vm scp /tmp/bertjax-bert.tar.gz bert:bertjax.tar.gz "
        "--zone=us-east5-a --worker=all",
        "gcloud compute tpus tpu-vm ssh bert --zone=us-east5-a --worker=all "
        + shlex.quote(f"--command={install} && rm -rf ~/bertjax && mkdir -p ~/bertjax && "
                      f"tar -xzf ~/bertjax.tar.gz -C ~/bertjax && {venv}")]
    (line,) = launch("setup", *WHERE, "--source=https://example.org/bertjax.git#v0.1")
    assert remote_command(line) == (
        f"{install} && rm -rf ~/bertjax && git clone --quiet https://example.org/bertjax.git "
        f"~/bertjax && git -C ~/bertjax checkout --quiet v0.1 && {venv}")


def test_run_golden_multi_host():
    start, follow = launch("run", *WHERE, "--accelerator_type=v5p-32",
                           "--config=experiments/pretrain.py:base", "--workdir=gs://b/run")
    assert start == (
        "gcloud compute tpus tpu-vm ssh bert --zone=us-east5-a --worker=all '--command=cd "
        "~/bertjax && nohup .venv/bin/python -m bertjax.pretrain "
        "--config=experiments/pretrain.py:base --workdir=gs://b/run --distributed > "
        "~/bertjax-run.log 2>&1 < /dev/null &'")
    assert follow == ("gcloud compute tpus tpu-vm ssh bert --zone=us-east5-a --worker=0 "
                      "'--command=tail -n +1 -F ~/bertjax-run.log'")


def test_run_single_host_finetune_local_workdir():
    # One host: a local workdir is fine and jax.distributed is not needed.
    (start,) = launch("run", *WHERE, "--accelerator_type=v6e-8", "--job=finetune",
                      "--config=experiments/glue.py:mrpc", "--workdir=runs/mrpc", "--nofollow")
    assert remote_command(start) == (
        "cd ~/bertjax && nohup .venv/bin/python -m bertjax.finetune "
        "--config=experiments/glue.py:mrpc --workdir=runs/mrpc > ~/bertjax-run.log 2>&1 "
        "< /dev/null &")


def test_run_quotes_overrides_through_both_shells():
    overrides = ["--config.phases.phase1.data=gs://b/seq 128/*.tfrecord,gs://b/more/*.tfrecord",
                 "--config.note=it's \"quoted\", $HOME; `x` & y"]
    start, _ = launch("run", *WHERE, "--accelerator_type=v4-32",
                      "--config=experiments/pretrain.py:base", "--workdir=gs://b/a run",
                      "--", *overrides)
    inner = remote_command(start)  # local shell: one --command= argument
    prefix, job = inner.split(" && nohup ", 1)
    assert prefix == "cd ~/bertjax"
    job = job.removesuffix(" > ~/bertjax-run.log 2>&1 < /dev/null &")
    # Worker's shell: each override arrives as one argument, byte for byte.
    assert shlex.split(job) == [".venv/bin/python", "-m", "bertjax.pretrain",
                                "--config=experiments/pretrain.py:base",
                                "--workdir=gs://b/a run", *overrides, "--distributed"]


def test_status_logs_tensorboard_delete_golden():
    assert launch("status", *WHERE) == [
        "gcloud compute tpus queued-resources describe bert --zone=us-east5-a",
        "gcloud compute tpus tpu-vm ssh bert --zone=us-east5-a --worker=all "
        "'--command=pgrep -af \"[p]ython -m bertjax\" || echo \"no bertjax job\"'"]
    assert launch("logs", *WHERE, "--nofollow") == [
        "gcloud compute tpus tpu-vm ssh bert --zone=us-east5-a --worker=0 "
        "'--command=tail -n 100 ~/bertjax-run.log'"]
    assert launch("tensorboard", *WHERE, "--workdir=gs://b/run") == [
        "gcloud compute tpus tpu-vm ssh bert --zone=us-east5-a --worker=0 '--command=cd "
        "~/bertjax && .venv/bin/tensorboard --logdir=gs://b/run/tensorboard --port=6006 "
        "--host=localhost' -- -L 6006:localhost:6006"]
    assert launch("delete", *WHERE, "--project=p") == [
        "gcloud compute tpus queued-resources delete bert --zone=us-east5-a --project=p "
        "--force --quiet"]


def test_refusals_are_one_line():
    assert "--zone is required" in refused(
        "run", "--name=bert", "--accelerator_type=v5p-32", "--config=c.py", "--workdir=gs://b")
    assert "gs://" in refused("run", *WHERE, "--accelerator_type=v5litepod-16",
                              "--config=c.py", "--workdir=runs/local")
    assert "v5p-12" in refused("create", *WHERE, "--accelerator_type=v5p-12")
    assert "v2-alpha-tpuv5" in refused("create", *WHERE, "--accelerator_type=v5p-8",
                                       "--version=v2-alpha-tpuv6e")
    assert "exclude" in refused("create", *WHERE, "--accelerator_type=v6e-8", "--spot",
                                "--reserved")
    assert "does not take --spot" in refused("delete", *WHERE, "--spot")
    assert "unexpected argument" in refused("delete", *WHERE, "--", "--config.x=1")


@pytest.mark.parametrize("name,family,chips,hosts", [
    ("v4-8", "v4", 4, 1), ("v4-32", "v4", 16, 4), ("v5p-8", "v5p", 4, 1),
    ("v5p-128", "v5p", 64, 16), ("v5litepod-8", "v5litepod", 8, 1),
    ("v5litepod-16", "v5litepod", 16, 4), ("v6e-4", "v6e", 4, 1), ("v6e-64", "v6e", 64, 16),
])
def test_accelerator_types(name, family, chips, hosts):
    tpu = parse_accelerator_type(name)
    assert (tpu.family, tpu.chips, tpu.hosts) == (family, chips, hosts)
    assert runtime_version(tpu, None).startswith(("v2-alpha-tpuv", "tpu-ubuntu"))


@pytest.mark.parametrize("name", ["v5e-8", "v5p-12", "v5litepod-2", "v6e-12", "v3-8", "tpu"])
def test_unknown_accelerator_types(name):
    with pytest.raises(ConfigError, match="--accelerator_type"):
        parse_accelerator_type(name)


def test_execute_prints_then_runs_and_stops_at_a_failure(capsys, tmp_path):
    from bertjax.tpu import execute

    marker = tmp_path / "ran"
    execute([["touch", str(marker)]], print_only=True)
    assert not marker.exists() and capsys.readouterr().out == f"touch {marker}\n"
    with pytest.raises(SystemExit, match=r"^error: exit status 1 from: false$"):
        execute([["touch", str(marker)], ["false"], ["rm", str(marker)]], print_only=False)
    assert marker.exists()  # ran; the command after the failure did not
    assert capsys.readouterr().out == f"touch {marker}\nfalse\n"
