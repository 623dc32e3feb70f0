"""The README and docs/: every relative link and #anchor resolves, and the README's test
command is the one `.ci/run` runs (CI copies it verbatim; a drift would test something else)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code blanked out (a `[x](y)` there
    is not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats -1, -2."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(md: Path) -> list[str]:
    """Each relative link of md whose file or #anchor does not exist, as 'target: why'."""
    bad = []
    for line in _prose(md.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{target}: no heading #{frag} in {dest.name}")
    return bad


def test_every_doc_link_and_anchor_resolves():
    files = doc_files()
    assert len(files) >= 5, "README.md and docs/*.md"
    bad = {str(f.relative_to(ROOT)): broken_links(f) for f in files}
    assert not {k: v for k, v in bad.items() if v}


def test_the_checker_finds_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Long documents: KV cache types\n\n## Step\n## Step\n")
    (tmp_path / "a.md").write_text(
        "[ok](b.md#long-documents-kv-cache-types) [ok](b.md#step-1) [ok](#top) [web](https://x.y/z)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](c.md) [anchor](b.md#long-documents) [here](#nothing)\n# Top\n")
    assert broken_links(tmp_path / "a.md") == [
        "c.md: no such file", "b.md#long-documents: no heading #long-documents in b.md",
        "#nothing: no heading #nothing in a.md"]


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# --- the README's test command, verbatim ---") + 1]
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert any(line.startswith(command + " ") or line == command for line in readme), command
    assert any(line.startswith("pip install . && edgellama chat ") for line in readme)
