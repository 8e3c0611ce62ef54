"""The BPE helpers of tests/modern_checkpoint.py under their former names, for the test
modules that still import them from here (tests/tasks/tagging/test_tagging_bpe_features.py);
new code imports modern_checkpoint."""

from modern_checkpoint import NATURAL, bpe_tokenizer, write_modern_bpe_checkpoint
from modern_checkpoint import bpe_corpus as corpus
from modern_checkpoint import bpe_tokenizer_json as tokenizer_json
from modern_checkpoint import write_bpe_tokenizer_json as write_tokenizer_json

__all__ = ["NATURAL", "bpe_tokenizer", "corpus", "tokenizer_json", "write_modern_bpe_checkpoint",
           "write_tokenizer_json"]
