"""BERT's text normalisation (Google's BasicTokenizer), character by character, with alignment.

Reference semantics (Google `tokenization.py`, as run under Python 3):
1. clean: drop U+0000, U+FFFD and control characters (categories Cc and Cf, except \\t \\n \\r);
   whitespace (space, \\t, \\n, \\r and category Zs) becomes a space;
2. put spaces around every CJK ideograph (the CJK Unified Ideographs blocks, not Hangul/kana);
3. split on whitespace (and U+2028/U+2029, which Python's `str.split` adds); for each
   whitespace token, when uncased: `token.lower()` (Python's full lowercasing, whole token at
   a time, so a word-final capital sigma becomes "ς"), then NFD and drop the combining marks
   (category Mn);
4. split each token on punctuation (ASCII 33-47, 58-64, 91-96, 123-126 and every Unicode P*).

Every function here keeps, for each output character, the `(start, end)` span of original
characters it came from, so that WordPiece offsets point into the caller's text.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata

# CJK ideograph blocks exactly as in the reference (`_is_chinese_char`).
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)

Span = tuple[int, int]


def is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def is_control(ch: str) -> bool:
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf")


def is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # ASCII non-letters/digits count as punctuation even where Unicode says Sm/Sc/Sk ("$", "^").
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def is_split_point(ch: str) -> bool:
    """Where the reference splits words after cleaning: its `text.split()` is Python's, which
    also splits at U+2028/U+2029 (not whitespace for `is_whitespace`, so kept by cleaning)."""
    return is_whitespace(ch) or ch.isspace()


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def clean_and_split(text: str) -> list[tuple[str, list[Span]]]:
    """Steps 1-3 up to the whitespace split: `[(token, spans)]`, one span per token character.

    Spans are `(start, end)` character positions in `text`.
    """
    tokens: list[tuple[str, list[Span]]] = []
    chars: list[str] = []
    spans: list[Span] = []

    def flush():
        if chars:
            tokens.append(("".join(chars), list(spans)))
            chars.clear()
            spans.clear()

    for i, ch in enumerate(text):
        if ch == "\x00" or ch == "\ufffd" or is_control(ch):
            continue
        if is_split_point(ch):
            flush()
        elif is_cjk(ch):
            flush()
            tokens.append((ch, [(i, i + 1)]))
        else:
            chars.append(ch)
            spans.append((i, i + 1))
    flush()
    return tokens


def _expand(token: str, spans: list[Span], per_char: list[str], whole: str):
    """Aligns `whole` (a normalisation of `token`) with `token` through per-character results.

    When the per-character results concatenate to the same length as `whole`, character k of
    `whole` comes from the original character whose per-character result covers position k.
    Otherwise (canonical reordering across characters, vanishingly rare) every output
    character is given the span of the whole token.
    """
    if sum(map(len, per_char)) != len(whole):
        span = (spans[0][0], spans[-1][1])
        return whole, [span] * len(whole)
    out_spans: list[Span] = []
    for piece, span in zip(per_char, spans):
        out_spans.extend([span] * len(piece))
    return whole, out_spans


def lower_and_strip_accents(token: str, spans: list[Span]) -> tuple[str, list[Span]]:
    """Uncased normalisation of one whitespace token: lower(), NFD, drop Mn; keeps alignment."""
    # Python's context-sensitive lowercasing (final sigma) never changes a length, so the
    # per-character lengths align the whole-token result.
    lowered, lowered_spans = _expand(token, spans, [c.lower() for c in token], token.lower())
    decomposed, nfd_spans = _expand(
        lowered,
        lowered_spans,
        [unicodedata.normalize("NFD", c) for c in lowered],
        unicodedata.normalize("NFD", lowered),
    )
    keep = [unicodedata.category(c) != "Mn" for c in decomposed]
    return (
        "".join(c for c, k in zip(decomposed, keep) if k),
        [s for s, k in zip(nfd_spans, keep) if k],
    )


def split_on_punctuation(token: str, spans: list[Span]) -> list[tuple[str, list[Span]]]:
    """Each punctuation character becomes its own piece; runs of other characters stay whole."""
    pieces: list[tuple[str, list[Span]]] = []
    start = 0
    for i, ch in enumerate(token):
        if is_punctuation(ch):
            if i > start:
                pieces.append((token[start:i], spans[start:i]))
            pieces.append((ch, spans[i:i + 1]))
            start = i + 1
    if start < len(token):
        pieces.append((token[start:], spans[start:]))
    return pieces


def normalize_whitespace_token(token: str, spans: list[Span], do_lower_case: bool):
    """Steps 3-4 for one cleaned whitespace token: `[(basic_token, spans)]`."""
    if do_lower_case:
        token, spans = lower_and_strip_accents(token, spans)
    return split_on_punctuation(token, spans)


def basic_tokenize(text: str, do_lower_case: bool) -> list[tuple[str, list[Span]]]:
    """The whole BasicTokenizer: `[(basic_token, spans)]` for `text`."""
    out = []
    for token, spans in clean_and_split(text):
        out.extend(normalize_whitespace_token(token, spans, do_lower_case))
    return out


# ---- Bulk (regex) forms of step 1-2 for the fast path; built once from unicodedata so that
# they agree with the per-character predicates above on this Python's Unicode version.


@functools.lru_cache(maxsize=1)
def bulk_patterns() -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """`(drop, space, cjk)` character-class regexes equivalent to the predicates above."""
    drop, space = [], []
    for cp in range(sys.maxunicode + 1):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cf", "Zs", "Zl", "Zp") or cp == 0xFFFD:
            if cp == 0 or cp == 0xFFFD or is_control(ch):
                drop.append(cp)
            elif is_split_point(ch):
                space.append(cp)
    cjk = "".join(f"{_esc(lo)}-{_esc(hi)}" for lo, hi in _CJK_RANGES)
    return (
        re.compile(f"[{_char_class(drop)}]+"),
        re.compile(f"[{_char_class(space)}]"),
        re.compile(f"[{cjk}]"),
    )


def _esc(cp: int) -> str:
    return f"\\U{cp:08x}"


def _char_class(codepoints: list[int]) -> str:
    """Compact regex character class body for sorted code points (consecutive runs merged)."""
    parts, start, prev = [], codepoints[0], codepoints[0]
    for cp in codepoints[1:] + [-1]:
        if cp == prev + 1:
            prev = cp
            continue
        parts.append(_esc(start) if start == prev else f"{_esc(start)}-{_esc(prev)}")
        start = prev = cp
    return "".join(parts)
