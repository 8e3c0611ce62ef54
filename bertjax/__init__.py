"""bertjax: pre-train and fine-tune BERT in JAX/Flax."""

__version__ = "0.1.0"
