#!/usr/bin/env python3
"""Check that every relative link in README.md and docs/*.md resolves: the file or folder exists, and an
#anchor names a heading of the target file as GitHub makes its anchors (lowercase; letters, digits, spaces,
hyphens and underscores kept, everything else dropped; spaces become hyphens; a repeated heading gets -1, -2...).
Links to other sites are not checked. Exits 1 naming each broken link; run from anywhere."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text):
    """The text with fenced code blocks and inline code spans blanked (line numbers kept)."""
    fenced = False
    out = []
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line))
    return "\n".join(out)


def anchors(path):
    """GitHub's anchors for the headings of a markdown file."""
    seen = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text only
        text = re.sub(r"[`*]|<[^>]+>", "", text)
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def main():
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    cache = {}
    broken = []
    for md in files:
        text = prose(md.read_text(encoding="utf-8"))
        for m in LINK.finditer(text):
            target = m.group(1)
            number = text.count("\n", 0, m.start(1)) + 1
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (md.parent / file_part).resolve() if file_part else md
            where = f"{md.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    broken.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    for b in broken:
        print(b)
    print(f"check_doc_links: {len(files)} files, {len(broken)} broken link(s)")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
