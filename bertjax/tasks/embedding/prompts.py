"""Prompts and lower-casing in embedding fine-tuning, as sentence-transformers applies them: its
trainer's `prompts=` (a prompt per column) and its Transformer module's do_lower_case.

config.task.query_prompt (the anchor column; a BEIR directory's queries), document_prompt (the
positive and hard-negative columns; the BEIR corpus) and prompt (both texts of a scored pair,
training or STS dev) are "auto", the init checkpoint's own prompt as encode_query /
encode_document / encode choose it (a converted sentence-transformers model's; none for
another checkpoint), or the text itself ("" for none). The run trains with them, and its
export keeps them as the model's prompts, so that encode_query, encode_document and encode
apply them again. Texts are lower-cased before the tokenizer where the init checkpoint's
sentence_bert_config.json said do_lower_case=true.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bertjax import checkpoint_dir
from bertjax.models.embedding import Prompts
from bertjax.tasks.embedding.readers import TextsExample

AUTO = "auto"
FIELDS = ("prompt", "query_prompt", "document_prompt")  # config.task's
DEFAULT_NAME = "default"  # the name given to a config.task.prompt the model has no name for


def configured(own: Prompts, prompt: str = AUTO, query: str = AUTO, document: str = AUTO
               ) -> Prompts:
    """`own` (the init checkpoint's prompts) with the config's texts in place of "auto": the
    query and document ones as the "query" and "document" prompts, the plain one as the
    default prompt (a prompt of that text, else DEFAULT_NAME; "" is no default)."""
    texts = dict(own.texts)
    for name, value in (("query", query), ("document", document)):
        if value != AUTO:
            texts[name] = value
    if prompt == AUTO:
        return Prompts(texts, own.default_name)
    if not prompt:
        return Prompts(texts, None)
    loaded = Prompts(texts).loaded
    if own.default_name is not None and loaded.get(own.default_name) == prompt:
        return Prompts(texts, own.default_name)
    name = next((n for n, text in loaded.items() if text == prompt), None)
    if name is None:
        name = DEFAULT_NAME
        texts[name] = prompt
    return Prompts(texts, name)


def prompts_of(config) -> Prompts:
    """The prompts a run of `config` trains with and exports (module docstring)."""
    own = (checkpoint_dir.own_prompts(config.init_checkpoint) if config.init_checkpoint
           else Prompts())
    return configured(own, *(str(config.task.get(field, AUTO)) for field in FIELDS))


def lower_case_of(config) -> bool:
    """Whether the run lower-cases its texts before the tokenizer (module docstring)."""
    return bool(config.init_checkpoint) and checkpoint_dir.own_lower_case(
        config.init_checkpoint)


def column_prompts(prompts: Prompts, kind: str, columns: int) -> tuple[str, ...]:
    """The text prepended to each column of a training row: pairs the query prompt to the
    anchor and the document prompt to the positive and negatives (sentence-transformers'
    encode_query / encode_document), scored pairs the default prompt to both (encode)."""
    if kind == "scored":
        return (prompts.text(),) * columns
    return (prompts.text(role="query"),) + (prompts.text(role="document"),) * (columns - 1)


def with_prompts(examples: Sequence[TextsExample], prompts: Sequence[str]
                 ) -> list[TextsExample]:
    """The examples with each text's column prompt prepended (prompts: one a column), and
    kept on them (TextsExample.prompts)."""
    if not any(prompts):
        return list(examples)
    return [dataclasses.replace(e, texts=tuple(p + t for p, t in zip(prompts, e.texts)),
                                prompts=tuple(prompts[:len(e.texts)])) for e in examples]


def lower(texts: list[str], lower_case: bool) -> list[str]:
    """As sentence-transformers' do_lower_case: the whole text, prompt included, before the
    tokenizer (whose own casing, accents included, then still applies)."""
    return [t.lower() for t in texts] if lower_case else texts
