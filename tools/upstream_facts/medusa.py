"""How TensorRT-LLM names and splits Medusa heads and what a MedusaForCausalLM
config holds: the module tree of tensorrt_llm/models/medusa/model.py (parameter
names are attribute paths, ColumnLinear splits dim 0, the heads' lm_head is
sized to pad_vocab_size), MedusaConfig's keyword parameters and the keys it reads
from the heads directory (tensorrt_llm/models/medusa/config.py), and the heads
file's tensor keys (tensorrt_llm/models/medusa/weight.py, load_medusa_hf).
"""

from __future__ import annotations

import ast

from tools.upstream_facts.common import classes, document, keyword_defaults, self_calls, verify_quotes

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
MODEL, CONFIG, WEIGHT = ("tensorrt_llm/models/medusa/model.py", "tensorrt_llm/models/medusa/config.py",
                         "tensorrt_llm/models/medusa/weight.py")
CONVERT = "examples/medusa/convert_checkpoint.py"
RULES = [
    {"rule": "architecture", "path": CONFIG, "quote": 'return cls(architecture="MedusaForCausalLM",'},
    {"rule": "hf_num_heads", "path": CONFIG, "quote": "'num_medusa_heads', None)"},
    {"rule": "hf_num_layers", "path": CONFIG, "quote": "num_medusa_layers = config.get('medusa_num_layers', None)"},
    {"rule": "hf_linear", "path": WEIGHT, "quote": 'w = state_dict[f"{h}.{l}.linear.weight"].clone()'},
    {"rule": "hf_linear_bias", "path": WEIGHT, "quote": 'b = state_dict[f"{h}.{l}.linear.bias"].clone()'},
    {"rule": "hf_lm_head", "path": WEIGHT, "quote": 'lm = state_dict[f"{h}.{trt_llm_medusa.num_medusa_layers}.weight"]'},
    {"rule": "lm_head_padded", "path": MODEL, "quote": "vocab_size_padded = pad_vocab_size(self.vocab_size,"},
    {"rule": "column_parallel", "path": MODEL, "quote": "self.linear = ColumnLinear(hidden_size,"},
    # The base model class and config follow the checkpoint's model_type (QWen's when it names qwen,
    # else LLaMA's); the example converter writes model_type, and qwen_type for qwen2.
    {"rule": "base_from_model_type", "path": MODEL,
     "quote": '"model_type") and "qwen" in config.model_type else LLaMAForCausalLM'},
    {"rule": "config_from_model_type", "path": CONFIG,
     "quote": "generic_medusa_config = QWenConfig if 'qwen' in model_type else LLaMAConfig"},
    {"rule": "model_type_written", "path": CONVERT, "quote": "'model_type': args.model_type,"},
    {"rule": "qwen_type_written", "path": CONVERT, "quote": "config['qwen_type'] = args.model_type"},
]


def _callee(call: ast.Call) -> str:
    return ast.unparse(call.func)


def extract(sources, previous=None):
    src = sources["trtllm"]
    model = classes(ast.parse(src.read(MODEL)))
    layer, head, generic = (self_calls(model[n]) for n in ("MedusaLayer", "MedusaHead", "GenericMedusaForCausalLM"))
    # The names follow the module tree: GenericMedusaForCausalLM.medusa_heads[h] (MedusaHead)
    # .medusa_layers[l] (MedusaLayer).linear, and MedusaHead.lm_head.
    heads_attr = next(a for a, c in generic.items() if _callee(c) == "ModuleList" and "MedusaHead" in ast.unparse(c))
    layers_attr = next(a for a, c in head.items() if _callee(c) == "ModuleList" and "MedusaLayer" in ast.unparse(c))
    linear_attr = next(a for a, c in layer.items() if _callee(c) == "ColumnLinear")
    lm_attr = next(a for a, c in head.items() if _callee(c) == "ColumnLinear")
    lm_bias = next((ast.literal_eval(k.value) for k in head[lm_attr].keywords if k.arg == "bias"), None)
    config_params = keyword_defaults(classes(ast.parse(src.read(CONFIG)))["MedusaConfig"],
                                     {"source": "trtllm", "path": CONFIG, "commit": src.commit_of(CONFIG)})
    rules = [dict(r, source="trtllm", commit=src.commit_of(r["path"]), line=0) for r in RULES]
    verify_quotes(rules, sources)
    facts = {
        "architecture": "MedusaForCausalLM",
        "config_params": config_params,
        "config_keys": {"num_heads": "num_medusa_heads", "num_layers": "num_medusa_layers",
                        "max_draft_len": "max_draft_len", "model_type": "model_type"},
        # The heads directory's config.json: MedusaConfig.from_hugging_face reads num_medusa_heads,
        # Medusa's own trainer and examples/medusa/convert_checkpoint.py medusa_num_heads.
        "hf_config_keys": {"num_heads": "num_medusa_heads", "num_heads_trainer": "medusa_num_heads",
                           "num_layers": "medusa_num_layers"},
        "names": {
            "trt_linear": f"{heads_attr}.{{h}}.{layers_attr}.{{l}}.{linear_attr}.{{part}}",
            "trt_lm_head": f"{heads_attr}.{{h}}.{lm_attr}.weight",
            "hf_linear": "{h}.{l}.linear.{part}",
            "hf_lm_head": "{h}.{L}.weight",
        },
        "lm_head_bias": lm_bias if lm_bias is not None else True,
        "split": {"linear": "dim 0 (ColumnLinear)", "lm_head": "pad rows to pad_vocab_size(vocab, tp), dim 0"},
        "rules": {r["rule"]: r for r in rules},
    }
    about = ("Medusa heads in a TensorRT-LLM checkpoint: tensor names from the module tree of "
             "tensorrt_llm/models/medusa/model.py, MedusaConfig parameters and heads-directory keys from config.py, "
             "heads-file keys from weight.py.")
    return document(about, sources, facts)
