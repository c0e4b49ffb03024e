"""The parameters the C++ `tensorrtllm` backend reads from its config.pbtxt.

Read from the backend's sources: every `GetParameter<T>("name")` call (a
variable name is resolved from its last string assignment), the C++ type it
is parsed as, whether it sits inside a `try` whose `catch` swallows the error
(a fallback) or not (a missing key fails the model load with "Cannot find
parameter with name: ..."), the default the variable holds before the call,
the string values it is compared against, and the `if` conditions around it.
"""

from __future__ import annotations

import re

from tools.upstream_facts.common import document, line_of

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
PREFIX = "triton_backend/inflight_batcher_llm/src/"
FILES = ("model_state.cc", "model_instance_state.cc")

CALL = re.compile(r"GetParameter<\s*([\w:<>\s]+?)\s*>\(\s*(\"[^\"]*\"|\w+)\s*\)")
# C++ type -> how the backend parses the string (model_state.cc specialisations).
PARSE = {
    "std::string": "string", "int32_t": "stoi", "int": "stoi", "SizeType32": "stoi",
    "executor::SizeType32": "stoi", "uint32_t": "stoul", "int64_t": "stoll", "uint64_t": "stoull",
    "size_t": "stoull", "float": "stof", "bool": "bool", "std::vector<int32_t>": "int_list",
    "std::vector<SizeType32>": "int_list", "executor::MedusaChoices": "int_list_list",
    "executor::EagleChoices": "int_list_list", "std::vector<std::vector<int32_t>>": "int_list_list",
}


def _blocks(text: str):
    """(open offset, close offset, kind, header) for every brace block; kind is
    try, catch, if, else or other; header the text before `{` on its statement."""
    out, stack = [], []
    i = 0
    while i < len(text):
        c = text[i]
        if c == '"':  # skip string literals
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
            continue
        if c == "{":
            head = re.sub(r"//[^\n]*", "", text[max(0, i - 400):i])
            head = re.split(r"[;{}]", head)[-1].strip()
            if head == "try":
                kind = "try"
            elif head.startswith("catch"):
                kind = "catch"
            elif head.startswith(("if", "else if")):
                kind = "if"
            elif head == "else":
                kind = "else"
            else:
                kind = "other"
            stack.append((i, kind, head))
        elif c == "}" and stack:
            start, kind, head = stack.pop()
            out.append((start, i, kind, head))
        i += 1
    return out


def _catch_after(text: str, blocks, try_close: int):
    for start, end, kind, _ in blocks:
        if kind == "catch" and start > try_close and not text[try_close + 1:start].replace("catch", "").strip(
                " \n\t()&:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"):
            return text[start:end + 1]
    return None


def _resolve(text: str, offset: int, arg: str) -> str:
    if arg.startswith('"'):
        return arg.strip('"')
    hits = list(re.finditer(rf"\b{re.escape(arg)}\s*=\s*\"([^\"]+)\"", text[:offset]))
    if not hits:
        raise SystemExit(f"cannot resolve parameter name variable {arg}")
    return hits[-1].group(1)


def _assigned(text: str, offset: int) -> str | None:
    start = text.rfind("\n", 0, offset) + 1
    m = re.search(r"(?:auto|std::string|[\w:<>]+)?\s*(\w+)\s*=\s*model_state_->\s*$", text[start:offset]) \
        or re.search(r"(\w+)\s*=\s*(?:model_state_->)?\s*$", text[start:offset])
    return m.group(1) if m else None


def _default(text: str, offset: int, var: str | None) -> str | None:
    if not var:
        return None
    hits = list(re.finditer(rf"[\w:<>]+\s+{re.escape(var)}\s*=\s*([^;]+);", text[:offset]))
    return hits[-1].group(1).strip() if hits else None


def _compared(text: str, offset: int, var: str | None, end: int) -> list[str]:
    if not var:
        return []
    return sorted(set(re.findall(rf"\b{re.escape(var)}\s*==\s*\"([^\"]*)\"", text[offset:end])))


def _function_end(text: str, blocks, offset: int) -> int:
    outer = [b for b in blocks if b[0] < offset < b[1] and b[2] == "other"]
    return min(outer, key=lambda b: b[0])[1] if outer else len(text)


def extract(sources, previous=None):
    src = sources["trtllm"]
    params: dict[str, dict] = {}
    for name in FILES:
        path = PREFIX + name
        text = src.read(path)
        blocks = _blocks(text)
        for m in CALL.finditer(text):
            if "template" in text[max(0, m.start() - 200):m.start()].split("\n")[-1]:
                continue
            ctype = " ".join(m.group(1).split())
            if ctype == "T" or m.group(2) == "name":  # the template and its specialisations
                continue
            key = _resolve(text, m.start(), m.group(2))
            enclosing = sorted((b for b in blocks if b[0] < m.start() < b[1]), key=lambda b: b[0])
            tries = [b for b in enclosing if b[2] == "try"]
            fallback = False
            if tries:
                catch = _catch_after(text, blocks, tries[-1][1])
                fallback = catch is not None and not re.search(r"\b(TLLM_THROW|throw)\b", catch)
            var = _assigned(text, m.start())
            entry = {
                "name": key,
                "cpp_type": ctype,
                "parse": PARSE.get(ctype, "unknown:" + ctype),
                "required": not fallback,
                "default": _default(text, m.start(), var) if fallback else None,
                "values": _compared(text, m.start(), var, _function_end(text, blocks, m.start())),
                "when": [b[3] for b in enclosing if b[2] == "if"],
                "source": "trtllm",
                "path": path,
                "commit": src.commit_of(path),
                "line": line_of(text, m.start()),
            }
            if entry["parse"].startswith("unknown"):
                raise SystemExit(f"{path}:{entry['line']}: unknown parameter type {ctype}")
            params.setdefault(key, entry)
    about = ("Parameters the C++ tensorrtllm backend reads (GetParameter calls). required=true: read outside a "
             "swallowing try/catch, so a missing key fails the model load ('Cannot find parameter with name: "
             "<key>'), or a value it rejects fails it; required=false: a missing or unparsable value falls back to "
             "`default`. `parse` is the C++ conversion (stoi/stoul/stoll/stoull/stof, bool: True/true/TRUE/1 or "
             "False/false/FALSE/0, int_list: csvStrToVecInt, int_list_list: csvStrToVecVecInt). `when` lists the "
             "if-conditions the read sits under.")
    return document(about, sources, {"parameters": sorted(params.values(), key=lambda e: (e["path"], e["line"]))})
