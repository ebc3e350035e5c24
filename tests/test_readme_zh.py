"""README.zh-CN.md, the top README in Chinese for the readers of the source notes, cannot drift from README.md:
both list the same make targets, the same commands and outputs (code blocks), and the same links."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def facts(text: str) -> dict:
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    commands = [[re.sub(r"\s+#.*$", "", line).rstrip() for line in body.splitlines()]
                for kind, body in blocks if kind == "bash"]
    return {"targets": sorted(set(re.findall(r"\bmake ([a-z][a-z0-9-]*)", text))),
            "links": sorted(set(re.findall(r"\]\(([^)\s]+)\)", text)) - {"README.md", "README.zh-CN.md"}),
            "commands": commands,
            "outputs": [body for kind, body in blocks if kind != "bash"]}


def test_both_readmes_list_the_same_targets_commands_and_links():
    english, chinese = (facts((REPO / name).read_text()) for name in ("README.md", "README.zh-CN.md"))
    for key in english:
        assert chinese[key] == english[key], f"README.zh-CN.md differs from README.md in its {key}"


def test_the_readmes_point_to_each_other_and_the_chinese_one_has_the_glossary():
    assert "[中文](README.zh-CN.md)" in (REPO / "README.md").read_text()  # at the top, with a word on what it is
    chinese = (REPO / "README.zh-CN.md").read_text()
    assert "[English](README.md)" in chinese
    for term in ("节点", "进程", "rank", "local_rank", "world_size", "主节点", "后端", "进程组"):
        assert term in chinese, term


def test_the_check_sees_a_drift():
    text = (REPO / "README.md").read_text()
    assert facts(text) != facts(text.replace("make test", "make test-fast", 1))
