"""The tensor tables of the TensorRT-LLM 1.2 inflight-batching repository.

Names, data types, dims, `optional`, `reshape: { shape: [ ] }` and
`allow_ragged_batch` follow the `triton_backend/all_models/inflight_batcher_llm`
templates of the 1.2 line, declared in full (not only what the CPU engine
uses) so a client written for NVIDIA's repository works against ours
unchanged. One tensor per line: `name  TYPE  dims  [optional] [scalar] [ragged]`,
where `scalar` is the templates' `reshape: { shape: [ ] }` and TYPE may name a
dtype chosen per deployment (LOGITS, ENCODER_FEATURES, PROMPT_TABLE).
"""

from __future__ import annotations


def _table(text: str) -> list[tuple[str, str, tuple[int, ...], frozenset[str]]]:
    rows = []
    for line in text.strip().splitlines():
        name, dtype, dims, *flags = line.split()
        unknown = set(flags) - {"optional", "scalar", "ragged"}
        if unknown:
            raise ValueError(f"bad flag(s) {unknown} in tensor table line: {line!r}")
        rows.append((name, dtype, tuple(int(d) for d in dims.split(",")), frozenset(flags)))
    return rows


ENSEMBLE_INPUTS = _table("""
text_input                  STRING  1
decoder_text_input          STRING  1        optional
max_tokens                  INT32   1
num_return_sequences        INT32   1        optional
bad_words                   STRING  -1       optional
stop_words                  STRING  -1       optional
exclude_input_in_output     BOOL    1        optional
end_id                      INT32   1        optional
pad_id                      INT32   1        optional
top_k                       INT32   1        optional
top_p                       FP32    1        optional
temperature                 FP32    1        optional
length_penalty              FP32    1        optional
repetition_penalty          FP32    1        optional
min_tokens                  INT32   1        optional
presence_penalty            FP32    1        optional
frequency_penalty           FP32    1        optional
seed                        UINT64  1        optional
return_log_probs            BOOL    1        optional
return_context_logits       BOOL    1        optional
return_generation_logits    BOOL    1        optional
return_perf_metrics         BOOL    1        optional
return_num_input_tokens     BOOL    1        optional
return_num_output_tokens    BOOL    1        optional
beam_width                  INT32   1        optional
stream                      BOOL    1        optional
prompt_embedding_table      FP16    -1,-1    optional
prompt_table_extra_id       UINT64  1        optional
prompt_vocab_size           INT32   1        optional
embedding_bias_words        STRING  -1       optional
embedding_bias_weights      FP32    -1       optional
lora_task_id                UINT64  1        optional
lora_weights                FP16    -1,-1    optional ragged
lora_config                 INT32   -1,3     optional ragged
guided_decoding_guide_type  STRING  1        optional ragged
guided_decoding_guide       STRING  1        optional ragged
""")

# Shared by the ensemble and the BLS (the upstream ensemble lists
# kv_cache_alloc_total_blocks twice; it is declared once here).
TEXT_OUTPUTS = _table("""
text_output                  STRING  -1
cum_log_probs                FP32    -1
output_log_probs             FP32    -1,-1
context_logits               LOGITS  -1,-1
generation_logits            LOGITS  -1,-1,-1
batch_index                  INT32   1
sequence_index               INT32   1
kv_cache_alloc_new_blocks    INT32   1
kv_cache_reused_blocks       INT32   1
kv_cache_alloc_total_blocks  INT32   1
arrival_time_ns              INT64   1
first_scheduled_time_ns      INT64   1
first_token_time_ns          INT64   1
last_token_time_ns           INT64   1
acceptance_rate              FP32    1
total_accepted_draft_tokens  INT32   1
total_draft_tokens           INT32   1
num_input_tokens             INT32   1
num_output_tokens            INT32   1
""")

PREPROCESSING_INPUTS = _table("""
QUERY                   STRING  1
DECODER_QUERY           STRING  1            optional
IMAGE_BYTES             UINT8   -1,-1,-1,-1  optional
IMAGE_URL               STRING  1            optional
IMAGES                  STRING  -1           optional
VIDEO_BYTES             UINT8   -1,-1,-1,-1  optional
REQUEST_OUTPUT_LEN      INT32   1
BAD_WORDS_DICT          STRING  -1           optional
STOP_WORDS_DICT         STRING  -1           optional
EMBEDDING_BIAS_WORDS    STRING  -1           optional
EMBEDDING_BIAS_WEIGHTS  FP32    -1           optional
END_ID                  INT32   1            optional
PAD_ID                  INT32   1            optional
PROMPT_TABLE_EXTRA_ID   UINT64  1            optional
""")

PREPROCESSING_OUTPUTS = _table("""
INPUT_ID                    INT32   -1
REQUEST_INPUT_LEN           INT32   1
DECODER_INPUT_ID            INT32   -1
REQUEST_DECODER_INPUT_LEN   INT32   1
BAD_WORDS_IDS               INT32   2,-1
STOP_WORDS_IDS              INT32   2,-1
EMBEDDING_BIAS              FP32    -1
REQUEST_OUTPUT_LEN          INT32   -1
OUT_END_ID                  INT32   1
OUT_PAD_ID                  INT32   1
OUT_PROMPT_TABLE_EXTRA_IDS  UINT64  -1
PIXEL_VALUES                FP16    -1,-1,-1,-1
ASPECT_RATIO_IDS            INT64   -1
ASPECT_RATIO_MASK           INT64   -1,-1
CROSS_ATTENTION_MASK        INT64   -1,-1,-1
IMAGE_SIZES                 INT64   -1,2
IS_VIDEO_INPUT              BOOL    1
ATTENTION_MASK              INT64   -1
IMAGE_GRID_THW              INT64   3
VISION_INPUT_ID             INT32   -1
""")

POSTPROCESSING_INPUTS = _table("""
TOKENS_BATCH     INT32  -1,-1
SEQUENCE_LENGTH  INT32  -1
""")

POSTPROCESSING_OUTPUTS = _table("""
OUTPUT  STRING  -1
""")

TENSORRT_LLM_INPUTS = _table("""
input_ids                           INT32             -1     optional ragged
encoder_input_features              ENCODER_FEATURES  -1,-1  optional ragged
encoder_output_lengths              INT32             1      optional scalar
input_lengths                       INT32             1      scalar
request_output_len                  INT32             1      scalar
num_return_sequences                INT32             1      optional scalar
draft_input_ids                     INT32             -1     optional ragged
decoder_input_ids                   INT32             -1     optional ragged
decoder_input_lengths               INT32             1      optional scalar
draft_logits                        LOGITS            -1,-1  optional ragged
draft_acceptance_threshold          FP32              1      optional scalar
end_id                              INT32             1      optional scalar
pad_id                              INT32             1      optional scalar
stop_words_list                     INT32             2,-1   optional ragged
bad_words_list                      INT32             2,-1   optional ragged
embedding_bias                      FP32              -1     optional ragged
beam_width                          INT32             1      optional scalar
temperature                         FP32              1      optional scalar
runtime_top_k                       INT32             1      optional scalar
runtime_top_p                       FP32              1      optional scalar
runtime_top_p_min                   FP32              1      optional scalar
runtime_top_p_decay                 FP32              1      optional scalar
runtime_top_p_reset_ids             INT32             1      optional scalar
len_penalty                         FP32              1      optional scalar
early_stopping                      BOOL              1      optional scalar
repetition_penalty                  FP32              1      optional scalar
min_tokens                          INT32             1      optional scalar
beam_search_diversity_rate          FP32              1      optional scalar
presence_penalty                    FP32              1      optional scalar
frequency_penalty                   FP32              1      optional scalar
seed                                UINT64            1      optional scalar
return_log_probs                    BOOL              1      optional scalar
return_context_logits               BOOL              1      optional scalar
return_generation_logits            BOOL              1      optional scalar
return_perf_metrics                 BOOL              1      optional scalar
return_num_input_tokens             BOOL              1      optional scalar
return_num_output_tokens            BOOL              1      optional scalar
exclude_input_in_output             BOOL              1      optional scalar
stop                                BOOL              1      optional scalar
streaming                           BOOL              1      optional scalar
prompt_embedding_table              PROMPT_TABLE      -1,-1  optional ragged
prompt_table_extra_ids              UINT64            -1     optional ragged
prompt_vocab_size                   INT32             1      optional scalar
cross_attention_mask                BOOL              -1,-1  optional ragged
mrope_rotary_cos_sin                FP32              -1     optional
mrope_position_deltas               INT64             1      optional
lora_task_id                        UINT64            1      optional scalar
lora_weights                        FP16              -1,-1  optional ragged
lora_config                         INT32             -1,3   optional ragged
context_phase_params                UINT8             -1     optional ragged
skip_cross_attn_blocks              BOOL              1      optional ragged
retention_token_range_starts        INT32             -1     optional ragged
retention_token_range_ends          INT32             -1     optional ragged
retention_token_range_priorities    INT32             -1     optional ragged
retention_token_range_durations_ms  INT32             -1     optional ragged
retention_decode_priority           INT32             1      optional ragged
retention_decode_duration_ms        INT32             1      optional ragged
guided_decoding_guide_type          STRING            1      optional ragged
guided_decoding_guide               STRING            1      optional ragged
lookahead_window_size               INT32             1      optional ragged
lookahead_ngram_size                INT32             1      optional ragged
lookahead_verification_set_size     INT32             1      optional ragged
""")

TENSORRT_LLM_OUTPUTS = _table("""
output_ids                   INT32   -1,-1
sequence_length              INT32   -1
cum_log_probs                FP32    -1
output_log_probs             FP32    -1,-1
context_logits               LOGITS  -1,-1
generation_logits            LOGITS  -1,-1,-1
batch_index                  INT32   1
sequence_index               INT32   1
context_phase_params         UINT8   -1
kv_cache_alloc_new_blocks    INT32   1
kv_cache_reused_blocks       INT32   1
kv_cache_alloc_total_blocks  INT32   1
arrival_time_ns              INT64   1
first_scheduled_time_ns      INT64   1
first_token_time_ns          INT64   1
last_token_time_ns           INT64   1
acceptance_rate              FP32    1
total_accepted_draft_tokens  INT32   1
total_draft_tokens           INT32   1
num_input_tokens             INT32   1
num_output_tokens            INT32   1
""")

BLS_INPUTS = _table("""
text_input                  STRING  1
decoder_text_input          STRING  1            optional
image_input                 FP16    -1,3,-1,-1   optional
image_bytes_input           UINT8   -1,-1,-1,-1  optional
image_url_input             STRING  1            optional
video_bytes_input           UINT8   -1,-1,-1,-1  optional
max_tokens                  INT32   1
bad_words                   STRING  -1           optional
stop_words                  STRING  -1           optional
exclude_input_in_output     BOOL    1            optional
end_id                      INT32   1            optional
pad_id                      INT32   1            optional
top_k                       INT32   1            optional
top_p                       FP32    1            optional
temperature                 FP32    1            optional
length_penalty              FP32    1            optional
repetition_penalty          FP32    1            optional
min_tokens                  INT32   1            optional
presence_penalty            FP32    1            optional
frequency_penalty           FP32    1            optional
seed                        UINT64  1            optional
return_log_probs            BOOL    1            optional scalar
return_context_logits       BOOL    1            optional scalar
return_generation_logits    BOOL    1            optional scalar
num_return_sequences        INT32   1            optional scalar
beam_width                  INT32   1            optional
stream                      BOOL    1            optional
prompt_embedding_table      FP16    -1,-1        optional
prompt_vocab_size           INT32   1            optional
prompt_table_extra_id       UINT64  1            optional
embedding_bias_words        STRING  -1           optional
embedding_bias_weights      FP32    -1           optional
num_draft_tokens            INT32   1            optional
use_draft_logits            BOOL    1            optional scalar
lora_task_id                UINT64  1            optional scalar
lora_weights                FP16    -1,-1        optional ragged
lora_config                 INT32   -1,3         optional ragged
return_perf_metrics         BOOL    1            optional scalar
return_num_input_tokens     BOOL    1            optional scalar
return_num_output_tokens    BOOL    1            optional scalar
guided_decoding_guide_type  STRING  1            optional
guided_decoding_guide       STRING  1            optional
""")

# Ensemble wiring of the 1.2 template: (step model, {step input: ensemble tensor},
# {step output: ensemble tensor}). Underscored names are internal tensors.
ENSEMBLE_STEPS = (
    ("preprocessing", {
        "QUERY": "text_input", "DECODER_QUERY": "decoder_text_input", "REQUEST_OUTPUT_LEN": "max_tokens",
        "BAD_WORDS_DICT": "bad_words", "STOP_WORDS_DICT": "stop_words",
        "EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
        "END_ID": "end_id", "PAD_ID": "pad_id", "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
    }, {
        "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "INPUT_ID": "_INPUT_ID",
        "REQUEST_DECODER_INPUT_LEN": "_REQUEST_DECODER_INPUT_LEN", "DECODER_INPUT_ID": "_DECODER_INPUT_ID",
        "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
        "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "EMBEDDING_BIAS": "_EMBEDDING_BIAS",
        "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID",
        "OUT_PROMPT_TABLE_EXTRA_IDS": "_OUT_PROMPT_TABLE_EXTRA_IDS",
    }),
    ("tensorrt_llm", {
        "input_ids": "_INPUT_ID", "decoder_input_ids": "_DECODER_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
        "decoder_input_lengths": "_REQUEST_DECODER_INPUT_LEN", "exclude_input_in_output": "exclude_input_in_output",
        "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID",
        "pad_id": "_PREPROCESSOR_PAD_ID", "embedding_bias": "_EMBEDDING_BIAS", "runtime_top_k": "top_k",
        "runtime_top_p": "top_p", "temperature": "temperature", "len_penalty": "length_penalty",
        "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
        "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
        "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
        "return_generation_logits": "return_generation_logits", "return_perf_metrics": "return_perf_metrics",
        "return_num_input_tokens": "return_num_input_tokens", "return_num_output_tokens": "return_num_output_tokens",
        "num_return_sequences": "num_return_sequences", "beam_width": "beam_width", "streaming": "stream",
        "prompt_embedding_table": "prompt_embedding_table", "prompt_vocab_size": "prompt_vocab_size",
        "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS",
        "prompt_table_extra_ids": "_OUT_PROMPT_TABLE_EXTRA_IDS", "lora_task_id": "lora_task_id",
        "lora_weights": "lora_weights", "lora_config": "lora_config",
        "guided_decoding_guide_type": "guided_decoding_guide_type", "guided_decoding_guide": "guided_decoding_guide",
    }, {
        "output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
        **{name: name for name in (
            "cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index",
            "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
            "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
            "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens",
            "num_output_tokens")},
    }),
    ("postprocessing", {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
     {"OUTPUT": "text_output"}),
)
