"""The fine-tuning jobs of the multi-host tests (tests/train/test_multihost.py,
test_multihost_faults.py): a tiny random checkpoint (tiny_checkpoint), short keyword-labelled
texts (sentiment_rows) to write as JSONL (conftest.write_jsonl), and the arguments of a
`python -m bertjax.finetune` run (finetune, an args_for of multihost.run_pair_and_reference)."""

from conftest import FILLERS, KEYWORD_VOCAB, write_tiny_checkpoint


def tiny_checkpoint(tmp_path, vocab=KEYWORD_VOCAB) -> str:
    (tmp_path / "tiny").mkdir()
    return write_tiny_checkpoint(tmp_path / "tiny", vocab)


def sentiment_rows(rng, n, labelled=True):
    """Short texts whose keyword (good / bad) decides the label: learnt within 16 steps, so
    that the test predictions differ from row to row."""
    rows = []
    for _ in range(n):
        good = rng.random() < 0.5
        words = [rng.choice(FILLERS) for _ in range(rng.randint(1, 4))]
        words.insert(rng.randint(0, len(words)), "good" if good else "bad")
        rows.append({"text": " ".join(words), **({"label": "pos" if good else "neg"}
                                                 if labelled else {})})
    return rows


def finetune(config: str, checkpoint: str, *flags: str, learning_rate: float = 1e-3):
    """args_for of `python -m bertjax.finetune`: global batch 8, every step logged; the
    reference's uncorrected Adam, whose larger early steps these few-step runs were set for."""
    return lambda out: ["-m", "bertjax.finetune", f"--config={config}",
                        f"--config.init_checkpoint={checkpoint}", f"--workdir={out}",
                        "--config.train.batch_size=8", "--config.log_every_steps=1",
                        "--config.optimizer.name=bert_adamw",
                        "--config.optimizer.schedule=reference",
                        f"--config.optimizer.learning_rate={learning_rate}", *flags]
