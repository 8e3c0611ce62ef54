"""bertjax: pre-train and fine-tune BERT in JAX/Flax."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import bertjax` stays light (no orbax, no tokenizer) until this is used.
    if name == "load_pretrained":
        from bertjax.pretrained import load_pretrained

        return load_pretrained
    raise AttributeError(f"module 'bertjax' has no attribute {name!r}")
