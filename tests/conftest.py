"""Test setup: CPU only, quiet logs. Multi-device tests start their own subprocess."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA compiles dominate the end-to-end tests, and many subprocesses (a run, its resumed twin,
# every mesh) compile the same programs: share them through JAX's persistent cache. A cached
# executable is the one a fresh compile would give, so results are unchanged.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"bertjax-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# tests/ mirrors the tree, one folder per part. Helpers shared by several test modules live in
# plain modules beside them (names not starting with test_; those of several folders at the
# top: regression_job.py, squad_data.py, ...); no test module imports another. Test modules
# import the helpers by module name (the names are unique), in this process and in the Python
# subprocesses they start: every folder of tests/ is on the import path of both.
TEST_DIRS = [str(d) for d in sorted({ROOT / "tests",
                                     *(f.parent for f in (ROOT / "tests").rglob("test_*.py"))})]
sys.path[1:1] = [d for d in TEST_DIRS if d not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(
    TEST_DIRS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# The helper modules' asserts report their operands as the test modules' do.
pytest.register_assert_rewrite(*sorted(
    f.stem for d in TEST_DIRS for f in Path(d).glob("*.py")
    if not f.stem.startswith("test_") and f.stem != "conftest"))


# A sentiment-like task for fine-tuning tests: filler words and a keyword that decides the label.
FILLERS = [f"filler{i}" for i in range(30)]
KEYWORD_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLERS, "good", "bad"]


def filler_sentence(rng, keyword=None, count=1):
    """3-10 filler words with `keyword` inserted `count` times at random places."""
    words = [rng.choice(FILLERS) for _ in range(rng.randint(3, 10))]
    for _ in range(count if keyword else 0):
        words.insert(rng.randint(0, len(words)), keyword)
    return " ".join(words)


def topic_sentence(rng, fillers: list[str], topic: str | None, length: int) -> str:
    """`length` words drawn from `fillers`, with `topic` (where given) inserted at a random
    place: the planted retrieval and reranking sets' texts."""
    words = [rng.choice(fillers) for _ in range(length)]
    if topic:
        words.insert(rng.randrange(len(words) + 1), topic)
    return " ".join(words)


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_tiny_checkpoint(root: Path, vocab: list[str], max_positions: int = 64,
                          num_layers: int = 2) -> str:
    """A tiny random BERT (hidden 32, 4 heads) with `vocab`, saved as a bertjax checkpoint
    directory root/ckpt (its vocabulary root/vocab.txt); returns the directory."""
    import flax.linen as nn
    import jax
    import numpy as np

    from bertjax.checkpoint_dir import save_pretrained
    from bertjax.models import BertConfig, BertForPreTraining

    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_layers=num_layers, num_heads=4,
                     intermediate_size=64, max_position_embeddings=max_positions)
    ids = np.zeros((1, 4), np.int32)
    params = jax.jit(BertForPreTraining(cfg).init)(jax.random.key(0), ids, ids, ids,
                                                    np.zeros((1, 1), np.int32))
    save_pretrained(root / "ckpt", cfg, nn.unbox(params["params"]), str(root / "vocab.txt"))
    return str(root / "ckpt")


def records_by_step(workdir, split=None) -> dict:
    """step → the run's metrics.jsonl record (of `split` where given), the last of each step
    winning."""
    records = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if split is None or record["split"] == split:
                records[record["step"]] = record
    return records


def run_python(args, env=None, timeout=600):
    """Runs `python <args>` from the project root; returns the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def project_root():
    return ROOT


@pytest.fixture(scope="session")
def fault_fs(tmp_path_factory):
    """tests/fault_fs.c built as a shared library (skips without a C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the fault-injecting file system layer")
    library = tmp_path_factory.mktemp("fault_fs") / "fault_fs.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                    os.path.join(ROOT, "tests", "fault_fs.c"), "-ldl", "-lpthread"], check=True)
    return library


# The longest modules first (`make test`'s seconds on 2 idle cores, largest first): with
# `-n 2 --dist loadfile` each worker takes whole modules in collection order, and one of these
# collected last (tests/train/ sorts last) would run alone at the end of the suite.
LONG_FIRST = ("e2e/test_readme.py", "tasks/pretraining/test_modern_pretraining.py",
              "models/test_modern.py", "tasks/classification/test_packed.py",
              "train/test_faults.py", "train/test_trainer.py", "test_config.py",
              "train/test_train_step.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(
        item.path.relative_to(ROOT / "tests").as_posix(), len(LONG_FIRST)))
