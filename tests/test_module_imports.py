"""Import direction.

Statically, over every import of the source (those inside functions too), the rules of the
house (docs/architecture.md, "Design rules"): imports run downhill, `bertjax.models` ←
`bertjax.train` ← `bertjax.tasks` ← `bertjax.serving` ← `bertjax.aot` (the cost instrument) ←
command modules (the tasks import neither serving nor the converters; the converters neither
the tasks nor the instrument); `data_pipeline` never imports `bertjax.tasks`,
`bertjax.train`, `bertjax.models` or a command; no module imports a `python -m bertjax...`
command (a data_pipeline writer may use another's functions), and nothing in the library
imports `bertjax/demos`, `bertjax/benchmarks` or `experiments`; no two modules import each
other; an architecture's folder (`bertjax/models/<name>/`) is imported only by itself, the
registry (`bertjax.models.architectures`, re-exported by `bertjax.models`) and its interop
modules (ARCHITECTURE_SEAM): shared code asks the record. A planted back-edge of each kind is
caught.

In fresh interpreters: the checkpoint-directory format (`bertjax.checkpoint_dir`) never imports
the converters (`bertjax.convert`), which import it; no library module imports TensorFlow or
torch when imported. Their errors are `bertjax.errors` classes."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_python

PACKAGES = ("bertjax", "data_pipeline", "experiments")
OUTSIDE_LIBRARY = ("bertjax.demos", "bertjax.benchmarks", "experiments")
# What each layer must never import (module-name prefixes).
NEVER = {
    "bertjax.models": ("bertjax.train", "bertjax.tasks", "bertjax.checkpoint_dir",
                       "bertjax.convert", "bertjax.aot", "data_pipeline"),
    "bertjax.train": ("bertjax.tasks", "bertjax.serving", "bertjax.aot", "data_pipeline"),
    "bertjax.tasks": ("bertjax.serving", "bertjax.convert", "bertjax.aot"),
    "bertjax.serving": ("bertjax.convert.__main__", "bertjax.aot"),
    "bertjax.aot": ("bertjax.convert",),
    "bertjax.convert": ("bertjax.tasks", "bertjax.aot"),
    "data_pipeline": ("bertjax.tasks", "bertjax.train", "bertjax.models", "bertjax.aot"),
}

# Each architecture's folder → the modules besides it that may import it: the registry, the
# models package's public names (BertConfig, BertModel, ...), its conversion and parity modules.
REGISTRY = ("bertjax.models", "bertjax.models.architectures")
ARCHITECTURE_SEAM = {
    "bertjax.models.bert": REGISTRY + ("bertjax.convert.huggingface", "bertjax.convert.mapping",
                                       "bertjax.convert.tf_checkpoint"),
    "bertjax.models.modernbert": REGISTRY + ("bertjax.convert.modernbert",
                                             "bertjax.parity.modern"),
    "bertjax.models.neobert": REGISTRY,
}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def module_imports(root: Path) -> tuple[dict[str, set[str]], set[str]]:
    """({module: the project modules it imports, anywhere in its source}, command modules: a
    `__main__.py` or a module with an `if __name__ == "__main__":` block)."""
    files = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in files}
    commands = set()
    for name, path in files.items():
        source = path.read_text()
        if path.name == "__main__.py" or 'if __name__ == "__main__":' in source:
            commands.add(name)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1]
                                    + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t for t in names if t in files]
                if len(targets) < len(names):
                    targets.append(base)  # names defined in the module `base` itself
            else:
                continue
            for target in targets:
                while target and target not in files:  # a.b.c imported as a name of a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges, commands


def violations(root: Path) -> list[str]:
    """Every import of the tree at `root` that breaks a rule of the module docstring."""
    edges, commands = module_imports(root)
    found = []
    for module, imported in sorted(edges.items()):
        for target in sorted(imported):
            for layer, banned in NEVER.items():
                if _within(module, layer) and any(_within(target, b) for b in banned):
                    found.append(f"{module} imports {target} (against the flow)")
            outside = any(_within(module, p) for p in OUTSIDE_LIBRARY)
            if not outside and any(_within(target, p) for p in OUTSIDE_LIBRARY):
                found.append(f"{module} imports {target} (not library code)")
            command = target in commands and (target.startswith("bertjax.")
                                                 or module not in commands)
            if command and not outside:
                found.append(f"{module} imports the command {target}")
            if module < target and module in edges.get(target, ()):
                found.append(f"{module} and {target} import each other")
            for folder, allowed in ARCHITECTURE_SEAM.items():
                inside = _within(module, folder) or module in allowed
                if (_within(target, folder) and not inside
                        and module.startswith(("bertjax.", "data_pipeline."))):
                    found.append(f"{module} imports {target} (an architecture's folder: ask "
                                 "its record)")
    return found


def test_imports_run_downhill():
    assert violations(ROOT) == []


PLANTED = {
    "bertjax/models/planted.py": "from bertjax.train import loop\n",
    "data_pipeline/planted.py": "def f():\n    from bertjax.tasks import base\n",
    "bertjax/train/planted.py": "import experiments.common\n",
    "bertjax/tasks/planted.py": "from bertjax import finetune\n",
    "bertjax/tasks/planted_a.py": "from bertjax.tasks import planted_b\n",
    "bertjax/tasks/planted_b.py": "from . import planted_a\n",
    "bertjax/tasks/planted_serving.py": "from bertjax.serving.engine import Engine\n",
    "bertjax/train/planted_aot.py": "def f():\n    from bertjax.aot import measure\n",
    "bertjax/convert/planted.py": "from bertjax.tasks import base\n",
    "bertjax/serving/planted_arch.py": "from bertjax.models.modernbert import ModernConfig\n",
}


def test_planted_back_edges_are_caught(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for path, source in PLANTED.items():
        (tmp_path / path).write_text(source)
    found = set(violations(tmp_path)) - set(violations(ROOT))
    assert found == {
        "bertjax.models.planted imports bertjax.train.loop (against the flow)",
        "data_pipeline.planted imports bertjax.tasks.base (against the flow)",
        "bertjax.train.planted imports experiments.common (not library code)",
        "bertjax.tasks.planted imports the command bertjax.finetune",
        "bertjax.tasks.planted_a and bertjax.tasks.planted_b import each other",
        "bertjax.tasks.planted_serving imports bertjax.serving.engine (against the flow)",
        "bertjax.train.planted_aot imports bertjax.aot.measure (against the flow)",
        "bertjax.convert.planted imports bertjax.tasks.base (against the flow)",
        "bertjax.serving.planted_arch imports bertjax.models.modernbert (an architecture's "
        "folder: ask its record)",
    }, found

WATCHED = ("bertjax.convert", "bertjax.checkpoint_dir", "bertjax.tokenization", "orbax",
           "tensorflow", "torch")


def imported_after(module):
    """The WATCHED packages that `import module` loads, in a fresh interpreter."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = run_python(["-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    return {name for name in WATCHED
            if any(m == name or m.startswith(name + ".") for m in loaded)}


@pytest.mark.parametrize("module,expected", [
    ("bertjax", set()),  # load_pretrained is resolved lazily
    ("bertjax.models.layout", set()),
    ("bertjax.checkpoint_dir", {"bertjax.checkpoint_dir"}),
    ("bertjax.convert.mapping", {"bertjax.convert", "bertjax.checkpoint_dir"}),
    ("bertjax.convert.__main__", {"bertjax.convert", "bertjax.checkpoint_dir"}),
    ("bertjax.convert.tf_checkpoint", {"bertjax.convert", "bertjax.checkpoint_dir"}),
    ("bertjax.convert.huggingface", {"bertjax.convert", "bertjax.checkpoint_dir"}),
    ("bertjax.extract_features", set()),
])
def test_import_direction(module, expected):
    assert imported_after(module) == expected


def test_error_classes_are_the_errors_module_ones():
    from bertjax import errors
    from bertjax.convert import ConversionError
    from bertjax.convert.mapping import ConversionError as mapping_error
    from bertjax.tokenization import VocabError
    from bertjax.tokenization.train import TrainError

    assert ConversionError is mapping_error is errors.CheckpointError
    assert VocabError is TrainError is errors.DataError


@pytest.mark.parametrize("first", ["bertjax", "jax"])
def test_the_library_on_a_cpu_writes_nothing_to_stderr(first):
    """With libtpu installed (the test extra) and no accelerator: `import bertjax` (before or
    after `import jax`), a computation and a model's forward pass print no TPU start-up noise
    (JAX_PLATFORMS unset, as in a user's Python)."""
    from bertjax import accelerators

    if accelerators.attached():
        pytest.skip("an accelerator is attached: JAX may start its backend")
    second = "jax" if first == "bertjax" else "bertjax"
    code = (f"import {first}, {second}\n"
            "import jax.numpy as jnp\n"
            "from bertjax.models.bert.modules import BertModel\n"
            "from bertjax.models.bert.config import BertConfig\n"
            "cfg = BertConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, "
            "intermediate_size=32, max_position_embeddings=16)\n"
            "ids = jnp.ones((1, 8), jnp.int32)\n"
            "params = BertModel(cfg).init(jax.random.PRNGKey(0), ids)\n"
            "print(jax.devices()[0].platform)\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"
    assert done.stderr == ""


def test_no_library_file_is_over_600_lines():
    """A module that long holds several things to find apart (the house's rule)."""
    long = {str(path.relative_to(ROOT)): n for package in ("bertjax", "data_pipeline")
            for path in (ROOT / package).rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}


def test_test_module_names_are_unique():
    """Every folder of tests/ is on the import path (conftest.py): two test or helper modules
    of one name would shadow each other, and pytest would stop collecting."""
    names = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name not in ("conftest.py", "__init__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: p for n, p in names.items() if len(p) > 1}
