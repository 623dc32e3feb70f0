"""Deterministic tokenizer test corpus: `python tests/data/make_corpus.py` writes corpus.txt.

Mixed English prose, code in several languages, numbers, whitespace runs, accents, CJK,
emoji, RTL scripts and oddly cased contractions, shuffled into paragraphs by a seeded
generator so the same text comes out on every Python 3 (tests compare the file with
`build_corpus()`). It holds no special-token strings: tests for those are separate.
"""
from __future__ import annotations

import random
from pathlib import Path

TARGET_CHARS = 300_000
SEED = 20240607

SUBJECTS = ["The engineer", "A small model", "Our tokenizer", "the committee", "Maria",
            "the old lighthouse keeper", "Every compiler", "THE SYSTEM", "a curious cat",
            "The quantized weights", "Nobody", "the river", "Professor O'Neill", "they"]
VERBS = ["reads", "rewrote", "cannot parse", "quietly ignores", "measured", "compresses",
         "will never forget", "DOESN'T trust", "painted", "has been streaming", "split",
         "decoded", "is rebuilding", "hasn't checked"]
OBJECTS = ["the merge table", "every byte of the file", "a 4-bit block", "the harbour at dawn",
           "three hundred tokens", "the cache", "a letter from 1887", "the user's prompt",
           "its own reflection", "the last train to Zürich", "twelve unopened e-mails",
           "the GGUF header", "a bowl of phở", "an unfinished symphony"]
TAILS = [".", "!", "?", "...", " — or so it seemed.", ", and then it rained.", " (mostly).",
         "; nobody noticed.", ":", "?!", ".\u201d", " \u2014 twice."]
CONTRACTIONS = ["DON'T", "don't", "Don'T", "I'M", "i'm", "We'Ll", "it'S", "YOU'RE", "they've",
                "THEY'VE", "she'd", "SHE'D", "can't", "CAN'T", "won\u2019t", "it\u2019s",
                "'tis", "rock 'n' roll", "O'Reilly's", "y'all'd've", "'S", "'ll"]
HANDWRITTEN = [
    "It was the best of times, it was the worst of times; the tokenizer, however, was indifferent.",
    "She said, \"Don't split my digits,\" but the pre-tokenizer DIDN'T listen.",
    "In 1969, 600,000,000 people watched; in 2024 the number was 3.14159e9 (estimated).",
    "Call +1 (555) 010-9999 or write to info@example.org before 23:59:59 UTC.",
    "Price: $1,299.99 \u2192 \u20ac1.199,00 \u2192 \u00a3999 \u2192 \u00a5150000 (~40% off!!!)",
    "A naïve café owner in Besançon served crème brûlée to a façade of Übermensch critics.",
    "Ångström, Øresund, Łódź, Ærø, São Paulo, Đà Nẵng, Reykjavík and İstanbul walk into a bar.",
    "Straße, Maß, Fußgängerübergänge: German compounds go on and on and on.",
    "Vietnamese tones: Tiếng Việt có sáu thanh điệu — ngang, huyền, sắc, hỏi, ngã, nặng.",
    "Polish: Zażółć gęślą jaźń. Czech: Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "日本語のテキスト：吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。",
    "中文：我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧！",
    "한국어: 다람쥐 헌 쳇바퀴에 타고파. 키스의 고유조건은 입술끼리 만나야 하고.",
    "العربية: نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر ومغلف بجلد أزرق.",
    "עברית: דג סקרן שט בים מאוכזב ולפתע מצא חברה.",
    "Mixed direction: the word \u05e9\u05dc\u05d5\u05dd means peace, and \u0633\u0644\u0627\u0645 does too.",
    "हिन्दी: ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम।",
    "ไทย: เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน",
    "Emoji: 🤖🦙💬 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ❤️‍🔥 😀😃😄 — and a lone 🫠.",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2; ∫₀^∞ e^{-x} dx = 1; √2 ≈ 1.41421356.",
    "Fancy digits: ٠١٢٣٤٥٦٧٨٩, ０１２３４５, ①②③, Ⅻ, ½ ¾, ²³, ꧑꧒꧓.",
    "Unicode spaces:\u00a0non-breaking,\u2003em-space,\u3000ideographic,\u2009thin.",
    "Combining marks: e\u0301 a\u0308 n\u0303 and zero\u200bwidth\u200dstuff\u2060here.",
    "URL: https://example.com/path/to/file.gguf?download=true&rev=main#section-3.2",
    "Path: C:\\Users\\llama\\Models\\smol-135m.Q4_1.gguf and /usr/local/lib/python3.11/",
    "Markdown: **bold**, _italic_, `code`, [link](http://x.y), > quoted, - item, 1. first",
    "Shouting: WHY WOULD ANYONE WRITE IN ALL CAPS?!?! BECAUSE THEY CAN'T FIND THE KEY.",
    "l33t sp34k: h4x0r 1337 n00b pwn3d w00t 0xDEADBEEF 0b1010_1010 0o777 1_000_000",
]

CODE = [
    '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    a, b = 0, 1
    out = []
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out


if __name__ == "__main__":
    print(fibonacci(20))  # [0, 1, 1, 2, 3, 5, ...]
''',
    '''#include <stdio.h>
#include <stdint.h>

static uint32_t hash(const char *s) {
\tuint32_t h = 2166136261u;
\twhile (*s) {
\t\th ^= (uint8_t)*s++;
\t\th *= 16777619u;
\t}
\treturn h;
}

int main(void) {
\tprintf("%08x\\n", hash("hello, world"));
\treturn 0;
}
''',
    '''fn main() {
    let v: Vec<u64> = (1..=10).map(|x| x * x).collect();
    let total: u64 = v.iter().sum();
    println!("sum of squares = {total}");
    match total {
        0..=100 => println!("small"),
        _ => println!("large: {:>8}", total),
    }
}
''',
    '''const fetchJson = async (url) => {
  const res = await fetch(url, { headers: { 'Accept': 'application/json' } });
  if (!res.ok) throw new Error(`HTTP ${res.status}: ${res.statusText}`);
  return res.json();
};

export default function App() {
  return <div className="app">{items.map((x, i) => <Item key={i} {...x} />)}</div>;
}
''',
    '''SELECT u.id, u.name, COUNT(o.id) AS orders
FROM users u
LEFT JOIN orders o ON o.user_id = u.id
WHERE u.created_at >= '2023-01-01' AND u.email LIKE '%@example.com'
GROUP BY u.id, u.name
HAVING COUNT(o.id) > 5
ORDER BY orders DESC
LIMIT 10;
''',
    '''<!DOCTYPE html>
<html lang="en">
  <head><meta charset="utf-8"><title>Test &amp; more</title></head>
  <body>
    <p class="note">Hello&nbsp;world &lt;3</p>
    <!-- a comment -->
  </body>
</html>
''',
    '''#!/usr/bin/env bash
set -euo pipefail
for f in *.gguf; do
    size=$(stat -c %s "$f")
    echo "${f}: $((size / 1024 / 1024)) MiB"
done 2>&1 | tee -a log.txt
[[ -z "${HOME:-}" ]] && exit 1
''',
    '''{
  "name": "edgellama",
  "version": "0.1.0",
  "layers": [1, 2, 3, 4.5, -6e-7, null, true, false],
  "nested": {"key": "value with \\"quotes\\" and \\\\ backslash", "emoji": "\\ud83e\\udd99"}
}
''',
    '''package main

import (
\t"fmt"
\t"strings"
)

func main() {
\twords := strings.Fields("  the quick  brown\\tfox  ")
\tfor i, w := range words {
\t\tfmt.Printf("%d:%q\\n", i, w)
\t}
}
''',
    '''class Matrix
  attr_reader :rows
  def initialize(rows) = @rows = rows
  def *(other)
    Matrix.new(rows.map { |r| other.rows.transpose.map { |c| r.zip(c).sum { |a, b| a * b } } })
  end
end
puts Matrix.new([[1, 2], [3, 4]]) * Matrix.new([[5, 6], [7, 8]])
''',
    '''\\begin{equation}
  \\mathcal{L}(\\theta) = -\\sum_{t=1}^{T} \\log p_\\theta(x_t \\mid x_{<t})
\\end{equation}
''',
    '''    # indented with spaces
\t# indented with a tab
  \t  # mixed indentation
        deeply_nested_call(arg1,   arg2,\t\targ3)    
''',
]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words) + 1), rng.choice(CONTRACTIONS))
    if rng.random() < 0.25:
        words.append(_number(rng))
    text = " ".join(words) + rng.choice(TAILS)
    return text[0].upper() + text[1:] if rng.random() < 0.8 else text


def _number(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randrange(1, 25)))
    if kind == 1:
        return f"{rng.uniform(-1e6, 1e6):.{rng.randrange(0, 8)}f}"
    if kind == 2:
        return f"{rng.randrange(1, 10**9):,}"
    if kind == 3:
        return f"{rng.uniform(1e-9, 1e9):e}"
    if kind == 4:
        return f"{rng.randrange(1900, 2100)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
    if kind == 5:
        return f"v{rng.randrange(10)}.{rng.randrange(100)}.{rng.randrange(1000)}"
    if kind == 6:
        return f"0x{rng.getrandbits(rng.choice((8, 16, 32, 64))):X}"
    return f"{rng.randrange(100)}%"


def _whitespace(rng: random.Random) -> str:
    return "".join(rng.choice([" ", "  ", "\t", "\n", "\r\n", "\n\n", "    ", "\t\t", " \n"])
                   for _ in range(rng.randrange(1, 6)))


def _paragraph(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind < 4:
        return " ".join(_sentence(rng) for _ in range(rng.randrange(2, 9)))
    if kind < 6:
        return rng.choice(HANDWRITTEN) + " " + _sentence(rng)
    if kind < 8:
        return rng.choice(CODE)
    if kind == 8:
        return _whitespace(rng).join(_number(rng) for _ in range(rng.randrange(3, 12)))
    return _whitespace(rng).join(rng.choice(CONTRACTIONS + HANDWRITTEN[6:20])
                                 for _ in range(rng.randrange(2, 6)))


def build_corpus() -> str:
    rng = random.Random(SEED)
    parts = list(HANDWRITTEN) + list(CODE)
    size = sum(map(len, parts))
    while size < TARGET_CHARS:
        parts.append(_paragraph(rng))
        size += len(parts[-1])
    rng.shuffle(parts)
    return "\n\n".join(parts) + "\n"


CORPUS_PATH = Path(__file__).with_name("corpus.txt")

if __name__ == "__main__":
    CORPUS_PATH.write_bytes(build_corpus().encode("utf-8"))
