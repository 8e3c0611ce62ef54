"""The tagging (token-classification) family: CoNLL-2003 NER, POS tagging, chunking, users'
tagged files, fine-tuned or feature-based. Its pieces, in the order data flows through them:

  schemes.py        tag schemes (iob1 / iob2 / bioes / none) and conlleval's chunk rules, used
                    by the readers and the metrics alike
  readers.py        CoNLL column files, JSONL, TFDS conll2003 → `Sentence`s in the model's scheme
  features.py       sentences → sub-token rows (first-sub-token labels, windows, document
                    context) → length-bucketed batches
  task.py           `TokenClassificationTask` (family token_classification): the loss,
                    predictions, metrics and the `predictions/<split>.conll` output files
  feature_based.py  `FeatureBasedTask` (family feature_based): frozen-encoder layers cached
                    once, a BiLSTM trained on them (the paper's Table 7 variants)
  metrics.py        entity precision / recall / F1, token accuracy, the per-type table

The flax heads (`BertForTokenClassification`, `FeatureBasedTagger`) are in
bertjax/models/tagging.py.
"""
