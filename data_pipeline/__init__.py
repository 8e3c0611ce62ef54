"""Text and task files in, batches out (tf.data). Never imported by bertjax.models/train.

Pre-training data (issue 4):
  corpus.py                  readers: reference format, plain, JSONL, TFDS; sharded streaming
  instances.py               NSP sentence pairs exactly as the reference generator
  masking.py                 the masked-LM rules: static (NumPy) and dynamic (tf.data)
  tfrecords.py               reference-schema TFRecord shards + metadata.json
  create_pretraining_data.py python -m data_pipeline.create_pretraining_data
  pretraining_input.py       make_dataset / InputIterator for the trainer
  packing.py                 several short examples per row (packing_ids, position_ids)
  segments.py                packed no-NSP input: the examples writer (TensorFlow-free)
  packed_input.py            packed no-NSP input: its CLI and the tf.data packer
  demo_corpus.py, benchmark.py  the BBC demo corpus and throughput figures
"""
