"""Import direction, checked in fresh interpreters: the checkpoint-directory format
(`bertjax.pretrained`) never imports the converters (`bertjax.convert`), which import it; no
library module imports TensorFlow or torch when imported. Their errors are
`bertjax.errors` classes."""

import json

import pytest
from conftest import run_python

WATCHED = ("bertjax.convert", "bertjax.pretrained", "bertjax.tokenization", "orbax",
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
    ("bertjax.pretrained", {"bertjax.pretrained"}),
    ("bertjax.convert.mapping", {"bertjax.convert", "bertjax.pretrained"}),
    ("bertjax.convert.__main__", {"bertjax.convert", "bertjax.pretrained"}),
    ("bertjax.convert.tf_checkpoint", {"bertjax.convert", "bertjax.pretrained"}),
    ("bertjax.convert.huggingface", {"bertjax.convert", "bertjax.pretrained"}),
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
