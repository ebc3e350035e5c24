"""README.zh-CN.md, the top README in Chinese for the readers of the source notes, cannot drift from README.md:
both list the same make targets, the same commands and outputs (code blocks), the same links, the same layout
(the same folders and files in the same order, described in each README's own language), and the same numbers in
their prose; the glossary, which only the Chinese README has, writes only numbers that CLAIMS.md backs."""

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
TARGET = re.compile(r"\bmake ([a-z][a-z0-9-]*)")
# a folder or a file of the repository, as the layout block names them: `0N_*/`, `bench/results/`, `common.py`
PATH = re.compile(r"(?<![A-Za-z0-9_*./-])[A-Za-z0-9_*.-]+(?:/[A-Za-z0-9_*.-]+)*(?:/|\.(?:py|ipynb))(?![A-Za-z0-9_/-])")


def read(name: str) -> str:
    return (REPO / name).read_text()


def code(text: str) -> list[str]:
    """The code blocks and the inline code: where a README tells the reader what to type. Prose such as
    'make target' (the English README says it twice) is not a target."""
    return [body for _, body in FENCE.findall(text)] + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))


def layout(body: str) -> list | None:
    """The block's entries, if it is a layout block (every unindented line starts with a folder or file, then two
    spaces and its description): for each entry, its name and, in order, the folders, files and make targets its
    description names. The descriptions' words are left out: each README says them in its own language."""
    entries = []
    for line in body.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            if not entries:
                return None
            entries[-1][1] += " " + line.strip()
            continue
        name, sep, description = line.partition("  ")
        if not sep or not PATH.fullmatch(name):
            return None
        entries.append([name, description.strip()])
    return [(name, re.findall(rf"make [a-z][a-z0-9-]*|{PATH.pattern}", description))
            for name, description in entries] or None


def facts(text: str) -> dict:
    blocks = FENCE.findall(text)
    commands = [[re.sub(r"\s+#.*$", "", line).rstrip() for line in body.splitlines()]
                for kind, body in blocks if kind == "bash"]
    others = [body for kind, body in blocks if kind != "bash"]
    layouts = [layout(body) for body in others]
    return {"targets": sorted({target for span in code(text) for target in TARGET.findall(span)}),
            "links": sorted(set(re.findall(r"\]\(([^)\s]+)\)", text)) - {"README.md", "README.zh-CN.md"}),
            "commands": commands,
            "layout": [entries for entries in layouts if entries],
            "outputs": [body for body, entries in zip(others, layouts, strict=True) if not entries]}


def test_both_readmes_list_the_same_targets_commands_and_links():
    """Also the same outputs, and the same layout as structure (CLAIMS.md names this test: keep its name)."""
    english, chinese = facts(read("README.md")), facts(read("README.zh-CN.md"))
    for key in english:
        assert chinese[key] == english[key], f"README.zh-CN.md differs from README.md in its {key}"


def test_the_readmes_point_to_each_other_and_the_chinese_one_has_the_glossary():
    assert "[中文](README.zh-CN.md)" in read("README.md")  # at the top, with a word on what it is
    chinese = read("README.zh-CN.md")
    assert "[English](README.md)" in chinese
    for term in ("节点", "进程", "rank", "local_rank", "world_size", "主节点", "后端", "进程组",
                 "rendezvous", "store", "模型并行", "device_ids", "output_device", "ENV 模式", "TCP 模式",
                 "torchelastic"):
        assert term in chinese, term


def test_the_layout_is_read_as_structure_and_names_every_folder():
    """The layout block lives in docs/tests.md (the front door links to it): read as structure, it names the
    course's folders in order, and every folder of the repository that a reader meets."""
    (entries,) = facts(read("docs/tests.md"))["layout"]  # one layout block, no longer an output
    names = [name for name, _ in entries]
    assert names[0] == "common.py" and "0N_*/" in names
    assert ("bench/", ["make bench", "gpu_check.py", "make gpu-check", "stress.py", "benchlib.py",
                       "bench/results/"]) in entries
    folders = {p.name + "/" for p in REPO.iterdir() if p.is_dir() and not p.name.startswith((".", "0"))
               and p.name not in ("data", "runs", "checkpoints", "__pycache__") and not p.name.endswith(".egg-info")}
    assert folders <= set(names), folders - set(names)


def test_the_check_sees_a_drift():
    """Every way the Chinese README can lose something the English one has makes the facts differ."""
    english = facts(read("README.md"))
    chinese = read("README.zh-CN.md")
    assert facts(chinese) == english

    def drifts(key: str, changed: str) -> None:
        assert changed != chinese, key
        assert facts(changed)[key] != english[key], key

    for target in english["targets"]:  # a target no longer mentioned anywhere
        drifts("targets", re.sub(rf"\bmake {target}(?![a-z0-9-])", "", chinese))
    for link in english["links"]:  # a link turned into plain text
        drifts("links", re.sub(rf"\[([^\]]*)\]\({re.escape(link)}\)", r"\1", chinese))
    for kind, body in FENCE.findall(chinese):  # a command dropped from a bash block
        if kind == "bash":
            for line in body.splitlines():
                drifts("commands", chinese.replace(body, body.replace(line + "\n", "", 1), 1))
    drifts("outputs", chinese.replace("loss.backward()", "loss.backward(retain_graph=True)", 1))  # code edited


# A number as prose writes it: 2, 03, 5.8, 2.14.1, the 10 of CIFAR-10, the 1 of world_size-1 (not the 2 of FSDP2).
# Chinese characters are letters to \w, so the look-behind names ASCII only.
NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d+(?:\.\d+)*")
GLOSSARY = "\n## 术语表\n"  # the Chinese README's own last section: README.md has no counterpart
# Numbers only the glossary writes that no CLAIMS.md row stated in README.zh-CN.md holds, each with what it counts.
GLOSSARY_ONLY = {
    "6": "step 6 of the MNIST chain (mnist_amp_syncbn.py), as docs/setup.md and 06's README number the steps",
}


def numbers(text: str) -> Counter:
    """The numbers of a README's prose, tables and inline code: not its code blocks, link targets or list markers."""
    text = re.sub(r"\]\([^)\s]*\)", "]", FENCE.sub("", text))
    text = re.sub(r"^\s*(?:[-*+]|\d+[.)])\s", " ", text, flags=re.M)
    return Counter(NUMBER.findall(text))


def claim_rows(stated: str) -> list[list[str]]:
    """The CLAIMS.md rows (their cells) whose stated in names this file."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")]
             for line in read("CLAIMS.md").splitlines() if line.startswith("| ")]
    return [c for c in cells if len(c) == 6 and stated in [s.strip() for s in c[2].split(",")]]


def number_problems(english: str, chinese: str) -> list[str]:
    """Where the Chinese README's numbers differ from the English one's: [] when they agree."""
    mirrored, _, glossary = chinese.partition(GLOSSARY)
    bad = [f"only README.md writes {n} ({k}x more)" for n, k in (numbers(english) - numbers(mirrored)).items()]
    bad += [f"only README.zh-CN.md writes {n} ({k}x more)" for n, k in (numbers(mirrored) - numbers(english)).items()]
    backed = set(numbers(english)) | set(GLOSSARY_ONLY)
    backed |= {n for row in claim_rows("README.zh-CN.md") for n in NUMBER.findall(row[1])}
    bad += [f"the glossary writes {n}, which no claim stated in README.zh-CN.md holds"
            for n in numbers(glossary) if n not in backed]
    return bad


def test_both_readmes_write_the_same_numbers_and_the_glossary_only_backed_ones():
    assert GLOSSARY in read("README.zh-CN.md")
    assert number_problems(read("README.md"), read("README.zh-CN.md")) == []


def test_every_recorded_number_of_readme_md_is_checked_in_the_chinese_readme_too():
    """A row whose record proof puts a number in README.md names README.zh-CN.md as well, so that test_claims finds
    that number in a Chinese sentence about the claim (the sentence's English words: tqdm, pytest, CUDA)."""
    recorded = [c for c in claim_rows("README.md") if re.search(r"`bench/results/[^`]+ = [^`]+`", c[5])]
    assert recorded, "README.md states a recorded number"
    assert [c[0] for c in recorded if "README.zh-CN.md" not in c[2]] == []


def test_a_number_changed_in_one_language_only_is_caught():
    english, chinese = read("README.md"), read("README.zh-CN.md")
    mirrored, _, glossary = chinese.partition(GLOSSARY)
    prose = re.sub(r"\]\([^)\s]*\)", "]", FENCE.sub("", mirrored))  # what numbers() reads
    for n in numbers(prose):  # every number of the mirrored part, changed once in the Chinese README only
        changed = re.sub(rf"(?<![A-Za-z0-9_.]){re.escape(n)}(?![0-9]|\.[0-9])", "999", prose, count=1)
        assert changed != prose and number_problems(english, changed + GLOSSARY + glossary), n
    assert number_problems(english.replace("5.8 GB", "5.9 GB"), chinese)  # and in the English one only
    assert number_problems(english, chinese.replace("约 25 MB", "约 52 MB"))  # a glossary number nothing backs
