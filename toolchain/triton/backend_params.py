"""The C++ `tensorrtllm` backend's rules for reading its config.pbtxt parameters,
so the CPU stand-in accepts exactly what a GPU host accepts and refuses the rest.

Which keys exist, their C++ types, which are read without a fallback and what
their defaults are come from `toolchain/upstream/facts/backend_parameters.json`
(extracted from NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm/src/
model_state.cc and model_instance_state.cc, 1.2 line). The conversions mirror
what those files call:

* `GetParameter<std::string>`: a key absent from `parameters` throws
  "Cannot find parameter with name: <key>"; a key whose value has no
  `string_value` (protobuf drops an empty string) reads as "".
* integers and floats go through std::stoi / stoul / stoll / stoull / stof,
  which skip leading blanks, parse the longest valid prefix and throw only when
  there is none ("12abc" is 12; "${x}" and "" throw).
* booleans accept exactly True/true/TRUE/1 and False/false/FALSE/0.
* lists are csvStrToVecInt ("1,2,3") and csvStrToVecVecInt ("{0},{0,1}").

A parameter read inside a try/catch that swallows the error falls back to its
default on any of these failures (the C++ logs a warning); one read outside
fails the model load. Nothing here imports Triton, so it is tested directly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from toolchain.upstream import facts as upstream_facts

INT32 = (-(1 << 31), (1 << 31) - 1)
_INT_PREFIX = re.compile(r"[ \t\n\v\f\r]*([+-]?\d+)")
_FLOAT_PREFIX = re.compile(r"[ \t\n\v\f\r]*([+-]?(?:inf(?:inity)?|nan|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?))",
                           re.IGNORECASE)
TRUE = ("True", "true", "TRUE", "1")
FALSE = ("False", "false", "FALSE", "0")
# `if` conditions the backend reads a parameter under, as predicates over the values read so far.
CONDITIONS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "if (decodingMode && decodingMode->isLookahead())": lambda v: v.get("decoding_mode") == "lookahead",
}


class ParameterError(ValueError):
    """A parameter the C++ backend would refuse: the model fails to load."""


# ---- std:: conversions ----------------------------------------------------------------------------------------
def stoi(text: str, bits: tuple[int, int] = INT32) -> int:
    m = _INT_PREFIX.match(text)
    if not m:
        raise ValueError(f"stoi: no conversion of {text!r}")
    value = int(m.group(1))
    if not bits[0] <= value <= bits[1]:
        raise ValueError(f"stoi: {text!r} out of range")
    return value


def stou(text: str, bits: int) -> int:
    """std::stoul / stoull: a leading minus is accepted and wraps, as strtoul does."""
    m = _INT_PREFIX.match(text)
    if not m:
        raise ValueError(f"stoul: no conversion of {text!r}")
    value = int(m.group(1))
    if abs(value) >= 1 << 64:
        raise ValueError(f"stoul: {text!r} out of range")
    return value % (1 << bits)


def stof(text: str) -> float:
    m = _FLOAT_PREFIX.match(text)
    if not m:
        raise ValueError(f"stof: no conversion of {text!r}")
    value = float(m.group(1))
    if abs(value) != float("inf") and abs(value) > 3.4028234663852886e38:  # beyond FLT_MAX: ERANGE
        raise ValueError(f"stof: {text!r} out of range")
    return value


def to_bool(text: str) -> bool:
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ValueError(f"Cannot convert {text} to a boolean.")


def int_list(text: str) -> list[int]:
    """csvStrToVecInt: comma-separated ints; blanks before each; stops at an empty field."""
    if not text:
        raise ValueError("Cannot convert empty string to vector of vector of ints")
    out, pos = [], 0
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        end = text.find(",", pos)
        field = text[pos:] if end < 0 else text[pos:end]
        if not field:
            break
        out.append(stoi(field))
        if end < 0:
            break
        pos = end + 1
    if not out:
        raise ValueError("Empty vector")
    return out


def int_list_list(text: str) -> list[list[int]]:
    """csvStrToVecVecInt: "{0},{0,1}"; a group is only taken when a '}' follows it."""
    if not text:
        raise ValueError("Cannot convert empty string to vector of vector of ints")
    out, pos = [], 0
    while True:
        end = text.find("}", pos)
        if end < 0:  # getline hit the end of the stream: the C++ loop stops here
            break
        group = text[pos:end]
        if not group:
            break
        out.append(int_list(group[1:] if group.startswith("{") else group))
        pos = end + 1
        while pos < len(text) and text[pos].isspace():
            pos += 1
        comma = text.find(",", pos)
        pos = len(text) if comma < 0 else comma + 1
        while pos < len(text) and text[pos].isspace():
            pos += 1
    if not out:
        raise ValueError("Empty vector of vector")
    return out


PARSERS: dict[str, Callable[[str], Any]] = {
    "string": lambda s: s, "stoi": stoi, "stoll": lambda s: stoi(s, (-(1 << 63), (1 << 63) - 1)),
    "stoul": lambda s: stou(s, 32), "stoull": lambda s: stou(s, 64), "stof": stof, "bool": to_bool,
    "int_list": int_list, "int_list_list": int_list_list,
}


def cxx_default(text: str | None) -> Any:
    """The C++ initialiser of a fallback parameter as a Python value (None when it has none we model)."""
    if text is None or text == "std::nullopt":
        return None
    if text in ("true", "false"):
        return text == "true"
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    number = text.rstrip("fF")
    try:
        return int(number)
    except ValueError:
        try:
            return float(number)
        except ValueError:
            return None


# ---- reading a model config ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Parameter:
    name: str
    parse: str
    required: bool
    default: Any
    values: tuple[str, ...]
    when: tuple[str, ...]
    where: str
    unset_ok: bool = False
    """The backend compares the value with its own `${placeholder}`: empty or that placeholder means
    "feature off", and only a set value is checked (by check_load)."""


def parameters() -> list[Parameter]:
    """The backend's parameters in the order it reads them."""
    out = []
    for e in upstream_facts("backend_parameters")["parameters"]:
        unknown = [c for c in e["when"] if c not in CONDITIONS]
        if unknown:
            raise RuntimeError(f"backend_parameters.json: no predicate for condition {unknown[0]!r} "
                               f"({e['path']}:{e['line']}); add it to backend_params.CONDITIONS")
        out.append(Parameter(e["name"], e["parse"], e["required"], cxx_default(e["default"]),
                             tuple(v for v in e["values"] if not v.startswith("${")), tuple(e["when"]),
                             f"{e['path']}:{e['line']}", any(v.startswith("${") for v in e["values"])))
    return out


def raw(config: dict, key: str) -> str:
    """GetParameter<std::string>: the string_value of `key`, "" when it has none."""
    params = config.get("parameters")
    if not isinstance(params, dict):
        raise ParameterError("Model config doesn't have a parameters section")
    if key not in params:
        raise ParameterError(f"Cannot find parameter with name: {key}")
    value = params[key]
    return value.get("string_value", "") if isinstance(value, dict) else ""


def is_unset(text: str, key: str) -> bool:
    """The backend's test for an unfilled optional string: empty, or its own template placeholder."""
    return text == "" or text == "${%s}" % key


def read(config: dict, *, warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every backend parameter of `config` (Triton's JSON model config) read by the C++ rules: the
    parsed value, or the default where the backend falls back. Raises ParameterError where the
    backend fails the load. The checks that follow the reads (engine path, guided decoding) are
    `check_load`'s."""
    warn = warn or (lambda message: None)
    values: dict[str, Any] = {}
    for p in parameters():
        if p.when and not all(CONDITIONS[c](values) for c in p.when):
            continue
        try:
            value = PARSERS[p.parse](raw(config, p.name))
            if p.values and value not in p.values and not p.unset_ok:
                raise ValueError(f"{p.name} {value!r} is not one of {', '.join(p.values)}")
        except (ParameterError, ValueError) as err:
            if p.required:
                raise ParameterError(f"{p.name}: {err}" if p.name not in str(err) else str(err)) from None
            warn(f"{p.name} is invalid or not specified ({err}); using the default {p.default!r}")
            value = p.default
        values[p.name] = value
    return values


def check_load(values: dict[str, Any], *, path_exists: Callable[[str], bool] = os.path.exists) -> str:
    """What the backend checks after reading (ModelInstanceState's constructor and
    getGuidedDecodingConfigFromParams): returns the decoder engine path."""
    gpt = values.get("gpt_model_path") or ""
    enc = values.get("encoder_model_path") or ""
    # A path that does not exist is caught with the missing key and left empty.
    gpt = gpt if gpt and path_exists(gpt) else ""
    enc = enc if enc and path_exists(enc) else ""
    if not gpt and not enc:
        raise ParameterError("Both encoder and decoder model paths are empty")
    backend = values.get("guided_decoding_backend", "")
    info = values.get("xgrammar_tokenizer_info_path", "")
    if not is_unset(backend, "guided_decoding_backend") and not is_unset(info, "xgrammar_tokenizer_info_path"):
        if not path_exists(info):
            raise ParameterError(f"Xgrammar's tokenizer info path at {info} does not exist.")
        if backend != "xgrammar":
            raise ParameterError("Guided decoding is currently supported with 'xgrammar' backend. "
                                 "Invalid guided_decoding_backend parameter provided.")
    return gpt if gpt else enc
