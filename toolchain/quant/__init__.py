"""Quantization: pure tensor functions and the recipe checks.

- `formats`: one row per format (QuantAlgo, GPUs, calibration, stored tensors, bytes); everything
  else reads a format's facts there.
- `int_quant`: symmetric round-to-nearest int8/int4 (per channel, per group) and
  ModelOpt's int4 packing.
- `awq`: activation-aware scale and clipping search (the awq format).
- `smoothquant`: smoothing and the W8A8_SQ_PER_CHANNEL tensors.
- `fp8`: per-tensor e4m3 weights and scales.
- `fp8_block`: e4m3 weights with a scale per 128x128 tile, activations scaled per 1x128 (FP8 block scales).
- `fp4`: E2M1 rounding and nibble packing; NVFP4 (ModelOpt's packing, the GPU's activation quantizer) and
  MXFP4 (gpt-oss's expert blocks).
- `kv_cache`: KV-cache INT8/FP8 scales and storage.
- `prequantized`: AutoAWQ (GEMM) and GPTQ packing, unpacking and the zero-point conversion.
- `calibration`: the calibration data and layer-by-layer activation statistics.
- `view`: the quantization view (`Quantization`): the spec's section and the source checkpoint's
  format, resolved once by `quantization_of`, with the one "is anything quantized" answer.
- `recipe`: `check_recipe` on a view, run before any weight is read.

Nothing here imports the rest of the project except `toolchain.errors`, so
the checkpoint writer and the CPU engine can both build on it.
"""
