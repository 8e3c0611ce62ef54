"""bertjax: pre-train and fine-tune BERT in JAX/Flax."""

import os

# Before JAX (which sets 1) or TensorFlow is imported: TensorFlow's C++ start-up warnings and
# CUDA probe errors stay out of every bertjax command's output (bertjax.tf_setup filters
# the lines this level does not reach). TF_CPP_MIN_LOG_LEVEL=0 shows them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bertjax import accelerators  # noqa: E402

accelerators.skip_absent_tpu()  # before JAX starts a backend: no libtpu noise without a TPU

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import bertjax` stays light (no orbax, no tokenizer) until this is used.
    if name == "load_pretrained":
        from bertjax.checkpoint_dir import load_pretrained

        return load_pretrained
    if name == "Predictor":
        from bertjax.serving.predictor import Predictor

        return Predictor
    if name == "Embedder":
        from bertjax.serving.embedder import Embedder

        return Embedder
    if name == "Reranker":
        from bertjax.serving.reranker import Reranker

        return Reranker
    if name == "FillMask":
        from bertjax.serving.fill_mask import FillMask

        return FillMask
    raise AttributeError(f"module 'bertjax' has no attribute {name!r}")
