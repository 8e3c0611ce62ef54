"""The tokenization tests' corpus of hard text: prose_lines (English lines of a few standard
library sources, deterministic for one Python version), random_char, the pools of hard cases
(accents, Greek sigma, CJK, Arabic and other scripts, emoji, odd punctuation, whitespace and
control characters, special tokens in text, combining marks), and make_corpus, which mixes
prose with every hard case the reference semantics cover; used by every test module of
tests/tokenization/."""

from __future__ import annotations

import random
import sysconfig
import unicodedata
from pathlib import Path

N_LINES = 5200

ACCENTED = ("café naïve résumé Ångström Zoë façade São Paulo Dvořák Ærøskøbing Łódź "
            "ﬁnancial Ǆemal ǅemal İstanbul straße STRASSE ẞ Ωmega Ⅻ ½ ¾ ⅓ ǰ ŉ").split()
GREEK = "ΟΔΟΣ ΣΑΣ σοφός ΣΟΦΟΣ Σ ΑΣ'Β ΑΣ. ὈΔΥΣΣΕΎΣ λόγος ΛΌΓΟΣ".split()
CJK = ["北京欢迎你", "日本語のテキスト", "한국어 문장", "中文，标点。", "漢字かなカナ", "𠀋𠂉",
       "豈更車"]
ARABIC = ["مَرْحَبًا بالعالم", "السَّلَامُ عَلَيْكُمْ", "١٢٣ ٤٥٦", "كِتَابٌ؟"]
OTHER_SCRIPTS = ["Привет, мир!", "שָׁלוֹם", "नमस्ते दुनिया", "สวัสดีครับ", "Բարեւ և", "ᏣᎳᎩ"]
EMOJI = ["😀", "👍🏽", "👨\u200d👩\u200d👧", "❤️", "🇫🇷", "🤖✨", "☃"]
ODD_PUNCT = list("¿¡«»—–…“”‘’§¶†‡•$^`|~+<=>@#%&*_\\/{}[]()'\"!?.,;:") + ["...", "--", "?!"]
ODD_SPACE = ["\t", "\n", "\r", "\u00a0", "\u3000", "\u2009", "\u2028", "\u2029", "  ", "\x0b",
             "\x0c", "\x85", "\x1f"]
CONTROL = ["\x00", "\x01", "\x07", "\x1b", "\x7f", "\u200b", "\u200d", "\ufeff", "\ufffd",
           "\u00ad", "\u202e", "\U000e0001"]
SPECIAL_IN_TEXT = ["[MASK]", "[CLS]", "a[SEP]b", "[mask]", "[UNK]", "[PAD]x", "[ MASK ]"]
MARKS = ["\u0301", "\u0308", "\u0327", "\u20dd", "\u0903"]  # Mn, Mn, Mn, Me, Mc


def prose_lines() -> list[str]:
    """Real English text that ships with Python: the standard library's sources (comments,
    docstrings and code), a few files, deterministic for one Python version."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in ("argparse.py", "textwrap.py", "difflib.py", "fractions.py", "heapq.py",
                 "calendar.py", "statistics.py", "pprint.py", "random.py", "shlex.py"):
        path = stdlib / name
        if path.exists():
            lines += [s.strip() for s in path.read_text(encoding="utf-8").split("\n")]
    return [s for s in lines if len(s) > 3]


def random_char(r: random.Random) -> str:
    while True:
        cp = r.choice([r.randrange(0x80, 0x3000), r.randrange(0x80, 0x3000),
                       r.randrange(0x3000, 0xFFFF), r.randrange(0x10000, 0x2FFFF)])
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def make_corpus(n_lines: int = N_LINES, seed: int = 0) -> list[str]:
    """Lines mixing English prose with every hard case the reference semantics cover."""
    r = random.Random(seed)
    prose = prose_lines()
    pools = [ACCENTED, GREEK, CJK, ARABIC, OTHER_SCRIPTS, EMOJI, ODD_PUNCT, SPECIAL_IN_TEXT]
    lines = []
    for i in range(n_lines):
        words = r.choice(prose).split(" ")
        for _ in range(r.randrange(0, 4)):
            kind = r.random()
            pos = r.randrange(len(words) + 1)
            if kind < 0.55:
                insert = r.choice(r.choice(pools))
            elif kind < 0.65:
                insert = r.choice(words) + r.choice(CONTROL) + r.choice(words)
            elif kind < 0.72:
                insert = r.choice(ODD_SPACE).join([r.choice(words), r.choice(words)])
            elif kind < 0.78:
                insert = "".join(r.choice("abcdefghij") for _ in range(r.choice([99, 100, 101,
                                                                                 150])))
            elif kind < 0.85:
                insert = "".join(random_char(r) for _ in range(r.randrange(1, 4)))
            elif kind < 0.92:
                insert = r.choice(words).upper() + r.choice(MARKS)
            else:
                insert = r.choice(ACCENTED).upper()
            words.insert(pos, insert)
        line = " ".join(words)
        if i % 7 == 0:
            line = unicodedata.normalize(r.choice(["NFD", "NFC"]), line)
        lines.append(line)
    return lines
