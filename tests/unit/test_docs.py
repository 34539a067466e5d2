"""Docs that run: every Python block in README.md and under docs/ is run here, or marked with the reason it is not.

Markers, on the line right before a block's opening fence:

- ``<!-- not run: REASON -->``: the block is not executed (a GPU cluster, a network swarm, a fragment of a class).
- ``<!-- run: continues the previous block -->``: the block runs in the namespace of the block before it.
- ``<!-- run: in its own process -->``: the block runs as a script of its own (it starts processes by re-running its
  script, as ``strategy="ddp"`` does).

The other blocks of a file run one after another in one subprocess (each with a fresh namespace, as a script whose
``__name__`` is ``"__main__"``), in a temporary working directory, so the cost is one interpreter start per file.
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from phalanx_distributed import clean_environment, run

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>.+\S) -->$")
CONTINUES = "<!-- run: continues the previous block -->"
OWN_PROCESS = "<!-- run: in its own process -->"
MARKER = re.compile(r"^<!--\s*(not run|run)\b")

# TEMPORARY: blocks that fail on this branch only because of bugs other helpers are fixing; the lead removes each entry
# when the fix is merged. (file name, the block's first line) -> why. Such a block is skipped, not run.
BLOCKS_AWAITING_OTHER_FIXES: dict[tuple[str, str], str] = {}


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    code: str
    marker: str | None

    @property
    def name(self) -> str:
        return f"{self.doc.name}:{self.line}"

    @property
    def first_line(self) -> str:
        return next(line for line in self.code.splitlines() if line.strip())


def python_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        fence = lines[index].strip()
        if fence.startswith("```"):
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            if fence == "```python":
                before = lines[index - 1].strip() if index > 0 else ""
                code = textwrap.dedent("\n".join(lines[index + 1 : end])) + "\n"
                blocks.append(Block(doc, index + 1, code, before if MARKER.match(before) else None))
            index = end
        index += 1
    return blocks


def groups(doc: Path) -> list[list[Block]]:
    """The runnable blocks of ``doc``, a block and the blocks that continue it together."""
    result: list[list[Block]] = []
    for block in python_blocks(doc):
        if block.marker and NOT_RUN.match(block.marker):
            continue
        if block.marker == CONTINUES:
            result[-1].append(block)
        else:
            result.append([block])
    return result


def awaiting(group: list[Block]) -> str | None:
    return BLOCKS_AWAITING_OTHER_FIXES.get((group[0].doc.name, group[0].first_line))


def _in_own_process(group: list[Block]) -> bool:
    return group[0].marker == OWN_PROCESS


# ---------------------------------------------------------------------------- every block is run or says why not
@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(ROOT).as_posix())
def test_every_python_block_is_run_or_marked_with_a_reason(doc):
    blocks = python_blocks(doc)
    for position, block in enumerate(blocks):
        if block.marker is None or block.marker in (CONTINUES, OWN_PROCESS):
            assert block.marker != CONTINUES or position > 0, f"{block.name} continues no block"
            compile(block.code, block.name, "exec")  # a typo in a shown block fails here even before it runs
            continue
        match = NOT_RUN.match(block.marker)
        assert match, f"{block.name}: unknown marker {block.marker!r}; use {CONTINUES!r}, {OWN_PROCESS!r} or not run"
        assert len(match.group("reason").split()) >= 3, f"{block.name}: say why the block is not run"
    # Nothing is silently dropped: every block is in exactly one runnable group or marked as not run.
    grouped = [block.line for group in groups(doc) for block in group]
    not_run = [block.line for block in blocks if block.marker and NOT_RUN.match(block.marker)]
    assert sorted(grouped + not_run) == [block.line for block in blocks]


def test_the_docs_have_python_blocks_that_run():
    runnable = [group for doc in DOCS for group in groups(doc)]
    assert len(runnable) >= 5, "the README and docs lost their runnable examples"


# ---------------------------------------------------------------------------- running them
RUNNER = """
import sys, traceback
for line, name, code in BLOCKS:
    print(f"@@start {line}", flush=True)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__", "__file__": name})
    except BaseException:
        traceback.print_exc()
        print(f"@@failed {line}", flush=True)
    else:
        print(f"@@ok {line}", flush=True)
"""


def _script(group: list[Block]) -> str:
    return "\n".join(block.code for block in group)


@pytest.mark.parametrize(
    "doc", [doc for doc in DOCS if any(not _in_own_process(g) for g in groups(doc))], ids=lambda doc: doc.name
)
def test_the_blocks_of_a_doc_run(doc, tmp_path):
    todo = [group for group in groups(doc) if not _in_own_process(group) and not awaiting(group)]
    blocks = [(group[0].line, group[0].name, _script(group)) for group in todo]
    runner = tmp_path / "run_doc_blocks.py"
    runner.write_text(f"BLOCKS = {blocks!r}\n{RUNNER}")
    job = run([sys.executable, str(runner)], env=clean_environment(), timeout=300, cwd=tmp_path)
    failed = [group[0].name for group in todo if f"@@ok {group[0].line}" not in job.stdout]
    assert not failed, (
        f"blocks that failed: {failed}\n--- stdout\n{job.stdout[-3000:]}\n--- stderr\n{job.stderr[-6000:]}"
    )
    assert job.returncode == 0, job.stderr[-3000:]


OWN = [group for doc in DOCS for group in groups(doc) if _in_own_process(group)]


@pytest.mark.parametrize("group", OWN, ids=[group[0].name for group in OWN])
def test_a_block_that_starts_processes_runs_as_its_own_script(group, tmp_path):
    reason = awaiting(group)
    if reason:
        pytest.skip(f"awaiting another fix: {reason}")
    script = tmp_path / "block.py"
    script.write_text(_script(group))
    job = run([sys.executable, str(script)], env=clean_environment(), timeout=300, cwd=tmp_path)
    assert job.returncode == 0, (
        f"{group[0].name} failed\n--- stdout\n{job.stdout[-3000:]}\n--- stderr\n{job.stderr[-6000:]}"
    )
