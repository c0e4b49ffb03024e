"""The performance model: how fast a deployment serves, predicted from the same facts as its memory plan.

A step of the engine on one rank costs the larger of its memory time (the weights it reads once per step, the
experts its tokens touch, the KV cache its sequences read and write, over the card's bandwidth) and its compute
time (2 FLOPs per weight per token at the format's tensor-core peak, attention at the half-precision peak), plus
its tensor-parallel all-reduces (two per layer, of the step's activations, ring formula), or under attention DP
each rank's own sequences through its whole attention and the experts' dispatch and combine per MoE layer; each
family's attention (windows, Llama 4's chunks, multi-head latent attention) is costed in `attention`. A pipeline runs
`pp` micro-batches through its stages, so a step takes `pp` times its slowest stage's time, and fewer sequences
than stages leave the bubble idle. In-flight batching in steady state at concurrency C mixes the generation
tokens of the requests past their prompt with chunks of the prompts of the others, within `max_num_tokens`; TTFT,
TPOT and throughput follow from that mix (`Schedule`), and the maximum throughput is the best concurrency up to
the largest batch the limits and the KV cache allow, as `trtllm-bench throughput` measures it (uniform ISL/OSL,
every request sent at once: TensorRT-LLM docs/source/performance/perf-overview.md).

A pure roofline is optimistic, so every time is divided by an achieved fraction of the datasheet figure and
fixed costs are added (`Efficiency`, one row per GPU generation). The rows are fitted to public measurements
(data/efficiency.json, made by tools/fit_efficiency.py from AIConfigurator's measured TensorRT-LLM runs;
plan/calibration.py holds the data and the checks), and every prediction names what it rests on (`basis`).
Pure functions of the model's parameters, the format's bytes (quant/formats.py through plan/memory.py) and the
GPU table (gpus.py): nothing here reads weights or runs anything.
"""

from toolchain.plan.perf.attention import Span, layer_caps
from toolchain.plan.perf.efficiency import (
                                            BASIS,
                                            DEFAULT_EFFICIENCY,
                                            EFFICIENCY,
                                            FITTED,
                                            FITTED_FILE,
                                            KERNEL_ROW_META,
                                            KERNEL_ROWS,
                                            Efficiency,
                                            basis_of,
                                            efficiency_of,
                                            kernel_row,
                                            measured_row,
)
from toolchain.plan.perf.host import (
                                            CPU_PRECISION,
                                            HOST_ACT_BYTES,
                                            HostRow,
                                            host_efficiency,
                                            host_row,
                                            host_step_time,
                                            step_time,
)
from toolchain.plan.perf.kernel_step import measured_kernels
from toolchain.plan.perf.kernels import SYSTEMS as KERNEL_SYSTEMS
from toolchain.plan.perf.predict import (
                                            Performance,
                                            acceptance,
                                            deployment,
                                            host_profile_of,
                                            performance_dict,
                                            predict,
                                            predict_spec,
                                            unavailable,
)
from toolchain.plan.perf.schedule import (
                                            Deployment,
                                            Point,
                                            Workload,
                                            arrival_wait,
                                            batch_candidates,
                                            batch_wait,
                                            best_point,
                                            first_wave_ttft,
                                            generation_alone,
                                            queued,
                                            steady_state,
)
from toolchain.plan.perf.step import (
                                            ACT_BYTES,
                                            StageCost,
                                            StepTime,
                                            Work,
                                            add,
                                            allreduce_seconds,
                                            attention_load,
                                            context_work,
                                            exchange_tokens,
                                            experts_touched,
                                            generation_work,
                                            gpu_step_time,
                                            stage_cost,
                                            transfer_seconds,
)
from toolchain.plan.perf.calibrated import CalibratedRow, calibrated_row
from toolchain.plan.perf.error_bars import bar_text, error_bar, params_billions

__all__ = ["ACT_BYTES", "BASIS", "CPU_PRECISION", "DEFAULT_EFFICIENCY", "EFFICIENCY", "FITTED", "FITTED_FILE",
           "HOST_ACT_BYTES", "KERNEL_ROW_META", "KERNEL_ROWS", "KERNEL_SYSTEMS", "Deployment", "Efficiency", "HostRow", "Performance", "Point", "Span", "StageCost", "StepTime",
           "Work", "Workload", "acceptance", "add", "allreduce_seconds", "arrival_wait", "attention_load", "basis_of",
           "batch_candidates", "batch_wait", "best_point", "context_work", "deployment", "efficiency_of", "exchange_tokens",
           "experts_touched", "first_wave_ttft", "generation_alone", "generation_work", "gpu_step_time", "host_efficiency",
           "host_profile_of", "host_row", "host_step_time", "kernel_row", "layer_caps", "measured_row", "measured_kernels", "performance_dict", "predict", "predict_spec", "queued",
           "stage_cost", "steady_state", "step_time", "transfer_seconds", "unavailable",
           "bar_text", "error_bar", "params_billions"]
__all__ += ["CalibratedRow", "calibrated_row"]
