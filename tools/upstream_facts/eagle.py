"""How TensorRT-LLM names and splits an EAGLE-1 draft network and what an
EagleForCausalLM config holds: the module tree of tensorrt_llm/models/eagle/model.py
(eagle_nets[i] is an EagleNet: a LLaMAModel `drafter` built with fc_after_embed,
no first-layer input_layernorm and no ln_f, plus its own lm_head, all sharded over
the whole world at pp 1), the switches those flags turn in tensorrt_llm/models/llama/model.py,
EagleConfig's keyword parameters (tensorrt_llm/models/eagle/config.py) and the draft
checkpoint keys load_eagle_hf reads (tensorrt_llm/models/eagle/weight.py).
"""

from __future__ import annotations

import ast

from tools.upstream_facts.common import classes, document, keyword_defaults, self_calls, verify_quotes

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
MODEL, LLAMA, CONFIG, WEIGHT = ("tensorrt_llm/models/eagle/model.py", "tensorrt_llm/models/llama/model.py",
                                "tensorrt_llm/models/eagle/config.py", "tensorrt_llm/models/eagle/weight.py")
RULES = [
    {"rule": "architecture", "path": CONFIG, "quote": "'architecture': 'EagleForCausalLM',"},
    {"rule": "net_architecture", "path": CONFIG, "quote": "'architecture': \"LlamaForCausalLM\","},
    {"rule": "net_config_key", "path": CONFIG, "quote": "output['eagle_net_config'] = self.eagle_net_config.to_dict()"},
    {"rule": "nets_whole_world", "path": MODEL, "quote": "tp_size=config.mapping.world_size,"},
    {"rule": "nets_no_pp", "path": MODEL, "quote": "pp_size=1)"},
    {"rule": "fc_after_embed", "path": MODEL, "quote": "eagle_net_config.fc_after_embed = True"},
    {"rule": "no_first_input_layernorm", "path": MODEL,
     "quote": "eagle_net_config.use_input_layernorm_in_first_layer = False"},
    {"rule": "no_ln_f", "path": MODEL, "quote": "eagle_net_config.use_last_layernorm = False"},
    {"rule": "input_layernorm_when", "path": LLAMA, "quote": "and self.layer_idx == 0) or self.layer_idx > 0:"},
    {"rule": "fc_shape", "path": LLAMA, "quote": "self.fc = ColumnLinear(2 * config.hidden_size,"},
    {"rule": "fc_input_order", "path": LLAMA, "quote": "hidden_states = concat([hidden_states, hidden_states_for_embed],"},
    {"rule": "lm_head_padded", "path": MODEL, "quote": "vocab_size_padded = pad_vocab_size(config.vocab_size,"},
    {"rule": "hf_fc_weight", "path": WEIGHT, "quote": 'fc_embed_weight = eagle_state_dict["fc.weight"]'},
    {"rule": "hf_fc_bias", "path": WEIGHT, "quote": 'fc_ebmed_bias = eagle_state_dict["fc.bias"].clone().to(torch_dtype)'},
    {"rule": "lm_head_from_base", "path": WEIGHT, "quote": 'base_model_params["lm_head.weight"].clone().to(torch_dtype),'},
    {"rule": "drafter_prefix", "path": WEIGHT, "quote": 'renamed_weights[f"eagle_nets.{di}.drafter.{name}"] = param.clone()'},
    {"rule": "pickle_only_upstream", "path": WEIGHT, "quote": 'eagle_ckpt_file = Path(eagle_model_dir) / "pytorch_model.bin"'},
]


def _attr_calling(attrs: dict[str, ast.Call], callee: str) -> str:
    """The attribute whose constructor call is (or contains) a call of `callee`."""
    return next(a for a, call in attrs.items() if f"{callee}(" in ast.unparse(call))


def extract(sources, previous=None):
    src = sources["trtllm"]
    model = classes(ast.parse(src.read(MODEL)))
    llama = classes(ast.parse(src.read(LLAMA)))
    net, causal = self_calls(model["EagleNet"]), self_calls(model["EagleForCausalLM"])
    drafter_model = self_calls(llama["LLaMAModel"])
    nets_attr = _attr_calling(causal, "EagleNet")
    drafter_attr = _attr_calling(net, "LLaMAModel")
    lm_attr = _attr_calling(net, "ColumnLinear")
    fc_attr = _attr_calling(drafter_model, "ColumnLinear")
    embed_attr = _attr_calling(drafter_model, "Embedding")
    layers_attr = _attr_calling(drafter_model, "DecoderLayerList")
    config_params = keyword_defaults(classes(ast.parse(src.read(CONFIG)))["EagleConfig"],
                                     {"source": "trtllm", "path": CONFIG, "commit": src.commit_of(CONFIG)})
    rules = [dict(r, source="trtllm", commit=src.commit_of(r["path"]), line=0) for r in RULES]
    verify_quotes(rules, sources)
    drafter = f"{nets_attr}.{{i}}.{drafter_attr}"
    facts = {
        "architecture": "EagleForCausalLM",
        "net_architecture": "LlamaForCausalLM",
        "config_params": config_params,
        "config_keys": {"num_layers": "num_eagle_layers", "max_draft_len": "max_draft_len",
                        "max_non_leaves": "max_non_leaves_per_layer", "net_config": "eagle_net_config"},
        "names": {
            "drafter": drafter,
            "fc": f"{drafter}.{fc_attr}.{{part}}",
            "embedding": f"{drafter}.{embed_attr}.weight",
            "layer": f"{drafter}.{layers_attr}.{{layer}}.{{name}}",
            "lm_head": f"{nets_attr}.{{i}}.{lm_attr}.weight",
            "hf_fc": "fc.{part}",
        },
        "drafter": {"input_layernorm": "layers after the first only", "ln_f": False, "fc": "ColumnLinear(2H -> H, bias)",
                    "fc_input": "concat([token embedding, target hidden state])"},
        "split": {"world": "eagle nets use tp = world_size, pp = 1", "fc": "dim 0 (ColumnLinear)",
                  "lm_head": "pad rows to pad_vocab_size(vocab, tp), dim 0",
                  "layers": "as LLaMA's (qkv per head, dense and proj dim 1, fc and gate dim 0)"},
        "rules": {r["rule"]: r for r in rules},
    }
    about = ("EAGLE-1 draft networks in a TensorRT-LLM checkpoint: tensor names from the module trees of "
             "tensorrt_llm/models/eagle/model.py and llama/model.py, EagleConfig parameters from config.py, "
             "draft-checkpoint keys from weight.py.")
    return document(about, sources, facts)
