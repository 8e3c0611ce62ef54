"""Tag schemes and chunk rules of the tagging family, used by the readers (checking and
converting files) and the metrics (counting entities) alike.

Schemes (`scheme` arguments): "iob1" (CoNLL-2003 as distributed: a chunk starts with I-, B- only
separates two adjacent chunks of one type), "iob2" (= BIO: every chunk starts with B-), "bioes"
(B- I-* E- or a single S-), and "none" (plain tags such as POS tags: no chunks, no conversion).

A chunk is (type, start, end) with `end` exclusive. `chunks` follows conlleval's rules, so a
well-formed sequence converts losslessly between the chunk schemes (`convert`);
`strict_chunks` keeps only well-formed chunks (seqeval's strict mode). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

SCHEMES = ("iob1", "iob2", "bioes", "none")

Chunk = tuple[str, int, int]  # (type, start, end), end exclusive


def split_tag(tag: str) -> tuple[str, str]:
    """"B-PER" → ("B", "PER"); "O" → ("O", ""). The prefix is the first character and the type
    what follows the first "-", as conlleval and seqeval read tags."""
    if tag == "O":
        return "O", ""
    return tag[0], tag[1:].split("-", 1)[-1] or "_"


def chunks(tags: Sequence[str]) -> list[Chunk]:
    """Chunks by conlleval's rules (extended to E- / S- as seqeval's default mode).

    A chunk ends before a tag when the previous one was E- or S-, when B- or S- or O follows
    B- or I-, or when the type changes; one starts at B- or S-, at I- or E- after O, E- or S-,
    or at a change of type. So an I- tag after O starts a chunk (conlleval's IOB1 reading).
    """
    out: list[Chunk] = []
    prev_prefix, prev_type, start = "O", "", -1
    for i, tag in enumerate([*tags, "O"]):
        prefix, type_ = split_tag(tag)
        if start >= 0 and _ends(prev_prefix, prefix, prev_type, type_):
            out.append((prev_type, start, i))
            start = -1
        if _starts(prev_prefix, prefix, prev_type, type_):
            start = i
        prev_prefix, prev_type = prefix, type_
    return out


def _ends(prev: str, cur: str, prev_type: str, type_: str) -> bool:
    if prev in "ES":
        return True
    if prev in "BI" and cur in "BSO":
        return True
    return prev not in "O." and prev_type != type_


def _starts(prev: str, cur: str, prev_type: str, type_: str) -> bool:
    if cur in "BS":
        return True
    if prev in "OES" and cur in "IE":
        return True
    return cur not in "O." and prev_type != type_


def strict_chunks(tags: Sequence[str], scheme: str) -> list[Chunk]:
    """Only well-formed chunks (seqeval's strict mode): iob2 B-X I-X*; bioes S-X or B-X I-X* E-X.
    Tags that belong to no well-formed chunk count for nothing."""
    if scheme not in ("iob2", "bioes"):
        raise ValueError(f"strict chunks are defined for iob2 and bioes, not {scheme!r}")
    parsed = [split_tag(t) for t in tags]
    out: list[Chunk] = []
    i = 0
    while i < len(parsed):
        prefix, type_ = parsed[i]
        if prefix == "S" and scheme == "bioes":
            out.append((type_, i, i + 1))
        if prefix != "B":
            i += 1
            continue
        j = i + 1
        while j < len(parsed) and parsed[j] == ("I", type_):
            j += 1
        if scheme == "iob2":
            out.append((type_, i, j))
            i = j
        elif j < len(parsed) and parsed[j] == ("E", type_):
            out.append((type_, i, j + 1))
            i = j + 1
        else:  # B- I-* without its E-: not an entity
            i = j
    return out


def encode_chunks(length: int, spans: Sequence[Chunk], scheme: str) -> list[str]:
    """Tags of `length` words holding the non-overlapping `spans` in `scheme`."""
    tags = ["O"] * length
    previous: Chunk | None = None
    for type_, start, end in sorted(spans, key=lambda c: c[1]):
        for i in range(start, end):
            tags[i] = f"I-{type_}"
        if scheme == "iob2":
            tags[start] = f"B-{type_}"
        elif scheme == "iob1":
            # B- only where the chunk touches a previous chunk of the same type.
            if previous is not None and previous[2] == start and previous[0] == type_:
                tags[start] = f"B-{type_}"
        elif scheme == "bioes":
            if end - start == 1:
                tags[start] = f"S-{type_}"
            else:
                tags[start], tags[end - 1] = f"B-{type_}", f"E-{type_}"
        else:
            raise ValueError(f"unknown chunk scheme {scheme!r}")
        previous = (type_, start, end)
    return tags


def convert(tags: Sequence[str], source: str, target: str) -> list[str]:
    """Tags of one sentence from scheme `source` to `target` (through their chunks)."""
    if source == target or "none" in (source, target):
        if source != target:
            raise ValueError(f"cannot convert between {source!r} and {target!r}")
        return list(tags)
    return encode_chunks(len(tags), chunks(tags), target)


def scheme_error(tags: Sequence[str], scheme: str) -> tuple[int, str] | None:
    """(index, why) of the first tag that breaks `scheme`, or None if the sequence is
    well-formed: its chunks written back in `scheme` reproduce it exactly."""
    if scheme == "none":
        return None
    allowed = {"iob1": "BIO", "iob2": "BIO", "bioes": "BIOES"}[scheme]
    for i, tag in enumerate(tags):
        prefix = split_tag(tag)[0]
        if prefix not in allowed or (tag != "O" and tag[1:2] != "-"):
            return i, f"tag {tag!r} is not a {scheme} tag ({'/'.join(allowed)}- prefixes or O)"
    rewritten = encode_chunks(len(tags), chunks(tags), scheme)
    for i, (tag, want) in enumerate(zip(tags, rewritten)):
        if tag != want:
            before = tags[i - 1] if i else "the sentence start"
            return i, (f"tag {tag!r} after {before} breaks the {scheme} scheme "
                       f"(expected {want!r}); set the scheme the file uses")
    return None
