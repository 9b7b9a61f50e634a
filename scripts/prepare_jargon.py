#!/usr/bin/env python3
"""A real English corpus for fine-tuning: the Jargon File 4.4.7 (public domain; Debian package `jargon-text`).

Splits it into a training text (the introduction and the lexicon) and a held-out text (the appendices: hacker
folklore, the portrait of J. Random Hacker, the bibliography), so that the held-out loss measures text the
model did not train on. The typeset text is unwrapped: each paragraph becomes one line (its 3-space indent
and hard line breaks removed, no-break spaces made plain); tables and code, which hold box-drawing or deeper-indented lines, are kept as
they are. Writes DIR/train.txt and DIR/heldout.txt (plain text, for llama_longctx's --data and --eval-data)
and prints one JSON line with their sizes.

It also writes the lexicon as conversations, for chat fine-tuning (--data with "messages"): each entry
(`:term: pronunciation, part of speech` and its definitions) becomes a user question ("What does “term” mean in
hacker jargon?") and the assistant's answer (the entry's text). Every 20th entry is held out: DIR/chat_train.jsonl
and DIR/chat_heldout.jsonl.

    apt-get install jargon-text            # /usr/share/doc/jargon-text/jargon.txt.gz
    python3 scripts/prepare_jargon.py --out runs/jargon
"""

import argparse
import gzip
import hashlib
import json
import os
import sys

SOURCE = "/usr/share/doc/jargon-text/jargon.txt.gz"
# The line (at column 0) where the appendices begin: everything from it on is held out.
SPLIT = "Appendix A. Hacker Folklore"
BOX = set("─│┌┐└┘├┤┬┴┼═║")


def paragraphs(lines):
    """Groups lines into paragraphs separated by blank lines."""
    para = []
    for line in lines:
        if line.strip():
            para.append(line.rstrip())
        elif para:
            yield para
            para = []
    if para:
        yield para


def unwrap(para):
    """One paragraph as text: prose joined into one line; tables, code and headings kept line by line."""
    prose = all(l.startswith("   ") and not l.startswith("    ") and not (BOX & set(l)) for l in para)
    if prose:
        return " ".join(l.strip() for l in para)
    return "\n".join(l[3:] if l.startswith("   ") else l for l in para)


def entries(lines):
    """The lexicon's entries: (term, text), an entry running from its `   :term: ...` line to the next one."""
    term, body = None, []
    for line in lines:
        if line.startswith("   :") and line.count(":") >= 2 and not line.startswith("    "):
            if term:
                yield term, body
            rest = line[4:]
            term, head = rest.split(":", 1)
            body = [head.strip(" ,")] if head.strip(" ,") else []
            body.append("")
        elif term:
            body.append(line)
    if term:
        yield term, body


def conversation(term, body):
    """One entry as a chat: the question and the entry's unwrapped text as the answer."""
    answer = "\n\n".join(unwrap(p) for p in paragraphs(["   " + body[0]] + body[1:] if body and body[0] else body))
    return {"messages": [
        {"role": "user", "content": f"What does “{term}” mean in hacker jargon?"},
        {"role": "assistant", "content": answer.strip()},
    ]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=SOURCE, help="jargon.txt or jargon.txt.gz (default: %(default)s)")
    ap.add_argument("--out", required=True, help="output folder (created if missing)")
    a = ap.parse_args()
    if not os.path.isfile(a.src):
        sys.exit(f"{a.src} not found: install it with `apt-get install jargon-text` or pass --src")
    raw = open(a.src, "rb").read()
    digest = hashlib.sha256(raw).hexdigest()
    # The typeset text puts no-break spaces in headings ("Appendix\u00a0A."); plain spaces read the same.
    text = (gzip.decompress(raw) if a.src.endswith(".gz") else raw).decode("utf-8").replace("\u00a0", " ")
    lines = text.splitlines()
    cut = [i for i, l in enumerate(lines) if l == SPLIT]
    if len(cut) != 1:
        sys.exit(f"{a.src}: expected one line `{SPLIT}` where the appendices start, found {len(cut)}")
    parts = {"train": lines[: cut[0]], "heldout": lines[cut[0]:]}
    os.makedirs(a.out, exist_ok=True)
    report = {"source": a.src, "source_sha256": digest}
    for name, part in parts.items():
        body = "\n\n".join(unwrap(p) for p in paragraphs(part)) + "\n"
        path = os.path.join(a.out, f"{name}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(body)
        report[name] = {"path": path, "chars": len(body), "words": len(body.split())}
    chats = [conversation(t, b) for t, b in entries(parts["train"])]
    chats = [c for c in chats if c["messages"][1]["content"]]
    for name, keep in (("chat_train", lambda i: i % 20 != 19), ("chat_heldout", lambda i: i % 20 == 19)):
        path = os.path.join(a.out, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            rows = [c for i, c in enumerate(chats) if keep(i)]
            for c in rows:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
        report[name] = {"path": path, "conversations": len(rows)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
